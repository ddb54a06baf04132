"""Oversized prompts: a text with more characters than the context's tokens can cover
(the tokenizer's bound on characters per token) is refused before it is tokenized, on
every route; a small request is not held up while huge ones are refused; and prompts are
tokenized on a thread per slot, the requests waiting for one counting against
--max-queue."""

import asyncio
import re
import threading
import time

import httpx
import pytest

from colibri_serve.service import ApiError, Service

HUGE = "the quick brown fox jumps over the lazy dog " * (3_900_000 // 44)  # 3.9 MB, ~2.7 M tokens here


def refused_unread(r, param):
    assert r.status_code == 400, r.text[:300]
    body = r.json()
    error = body["error"]
    message = error["message"]
    # the length check's words: the prompt's characters (a chat's as its template renders them), not its tokens,
    # which were never counted
    found = re.match(r"the prompt has (\d+) characters, more than the model's context of 64 tokens can hold "
                     r"\((\d+) characters at most with this tokenizer\)$", message)
    assert found and int(found[1]) >= len(HUGE) and int(found[2]) < 64 * 100, message
    if body.get("type") != "error":
        assert error["code"] == "context_length_exceeded" and error["param"] == param


def test_a_prompt_far_over_the_context_is_refused_without_tokenizing(random_server):
    url = random_server.url
    chat = {"model": "random-olmoe", "messages": [{"role": "user", "content": HUGE}]}
    refused_unread(httpx.post(url + "/v1/completions", json={"model": "random-olmoe", "prompt": HUGE}, timeout=60), "prompt")
    refused_unread(httpx.post(url + "/v1/chat/completions", json=chat, timeout=60), "messages")
    refused_unread(httpx.post(url + "/v1/messages", json={**chat, "max_tokens": 5}, timeout=60), "messages")
    refused_unread(httpx.post(url + "/v1/messages/count_tokens", json=chat, timeout=60), "messages")
    # what fits is served as before
    r = httpx.post(url + "/v1/completions", json={"model": "random-olmoe", "prompt": "the cat", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_a_small_request_is_not_held_up_by_huge_ones(random_server):
    url = random_server.url
    answers = []

    def huge():
        answers.append(httpx.post(url + "/v1/completions", json={"model": "random-olmoe", "prompt": HUGE}, timeout=120))

    senders = [threading.Thread(target=huge) for _ in range(6)]
    for sender in senders:
        sender.start()
    time.sleep(0.3)
    started = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"model": "random-olmoe", "prompt": "hi", "max_tokens": 2}, timeout=120)
    waited = time.perf_counter() - started
    for sender in senders:
        sender.join()
    assert r.status_code == 200
    assert all(a.status_code == 400 for a in answers)
    # tokenizing them took ~5 s each, one after the other while holding the GIL: the small one waited ~30 s
    assert waited < 10, waited


def test_prompts_waiting_to_be_tokenized_count_against_the_queue():
    service = Service(lambda: None, model_name="m", slots=1, max_queue=1)
    release = threading.Event()

    def slow_work(n):
        release.wait(30)
        return [n]

    async def go():
        first = asyncio.create_task(service.tokenize(slow_work, 1))  # takes the one tokenizing thread
        second = asyncio.create_task(service.tokenize(slow_work, 2))  # waits for it: the queue's one place
        await asyncio.sleep(0.1)
        with pytest.raises(ApiError) as refused:
            await service.tokenize(slow_work, 3)
        assert refused.value.kind == "queue_full" and refused.value.retry_after == 1
        release.set()
        (one, took), (two, _) = await first, await second
        assert one == [1] and two == [2] and took >= 0.05  # the seconds the work took, for the turn's profile
        assert (await service.tokenize(slow_work, 4))[0] == [4]  # counted out again once done

    try:
        asyncio.run(go())
    finally:
        release.set()
        service.close()


def test_a_client_gone_while_its_prompt_waits_gives_its_place_back():
    service = Service(lambda: None, model_name="m", slots=1, max_queue=0)
    release = threading.Event()

    async def go():
        first = asyncio.create_task(service.tokenize(release.wait, 30))
        await asyncio.sleep(0.1)
        with pytest.raises(ApiError):
            await service.tokenize(release.wait, 30)
        first.cancel()  # its client went away: the running tokenizer ends on its own, then its place is free
        release.set()
        for _ in range(100):
            if service._tokenizing == 0:
                break
            await asyncio.sleep(0.02)
        assert (await service.tokenize(len, "abc"))[0] == 3

    try:
        asyncio.run(go())
    finally:
        release.set()
        service.close()
