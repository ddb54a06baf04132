"""Greedy tokens through the API are ``colibri run --chat``'s for the same conversation,
and a request's tokens do not change when 7 others run beside it (random demo model)."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai

from colibri_core.testing.cli import colibri_env


def run_chat_tokens(model, prompt, system=None, max_tokens=20):
    args = [sys.executable, "-m", "colibri_core", "run", "--model", str(model), "--chat", prompt, "--json",
            "--max-tokens", str(max_tokens)] + (["--system", system] if system else [])
    out = subprocess.run(args, capture_output=True, text=True, env=colibri_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    return result["token_ids"], result["text"]


def api_tokens(client, messages, max_tokens=20):
    r = client.chat.completions.create(model="random-olmoe", messages=messages, temperature=0, max_tokens=max_tokens,
                                       extra_body={"return_token_ids": True})
    return r.choices[0].model_extra["token_ids"], r.choices[0].message.content, r


def test_api_greedy_tokens_equal_colibri_run_chat(random_server, random_model):
    client = openai.OpenAI(base_url=random_server.url + "/v1", api_key="none", max_retries=0)
    for prompt, system in (("Once upon a time", None), ("The small bird", "be brief")):
        expected_ids, expected_text = run_chat_tokens(random_model, prompt, system)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids, text, r = api_tokens(client, messages)
        assert ids == expected_ids and text == expected_text
        assert r.usage.completion_tokens == len(expected_ids)
        streamed = client.chat.completions.create(model="random-olmoe", messages=messages, temperature=0, max_tokens=20,
                                                  stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected_text
        ant = anthropic.Anthropic(base_url=random_server.url, api_key="none", max_retries=0)
        m = ant.messages.create(model="random-olmoe", max_tokens=20, messages=[{"role": "user", "content": prompt}],
                                extra_body={"temperature": 0}, **({"system": system} if system else {}))
        assert "".join(b.text for b in m.content) == expected_text


def test_tokens_alone_equal_tokens_among_seven_others(random_server):
    client = openai.OpenAI(base_url=random_server.url + "/v1", api_key="none", max_retries=0)
    prompts = [[{"role": "user", "content": f"bird number {i} flies over the forest"}] for i in range(8)]
    alone = [api_tokens(client, p, max_tokens=16)[0] for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: api_tokens(client, p, max_tokens=16)[0], prompts))
    assert together == alone
    assert len({tuple(t) for t in alone}) > 1  # the prompts do lead to different replies


def test_a_server_with_drafts_gives_the_same_tokens_and_counts_the_drafts(start_server, random_model, random_server):
    """serve --draft ngram: prompt lookup drafts on a prompt that repeats itself; every
    request's tokens are those of a server without drafts, and the usage says how many
    drafted tokens were accepted and rejected (OpenAI's completion_tokens_details)."""
    drafting = start_server(random_model, "--draft", "ngram", "--draft-depth", "3")
    plain = openai.OpenAI(base_url=random_server.url + "/v1", api_key="none", max_retries=0)
    drafted = openai.OpenAI(base_url=drafting.url + "/v1", api_key="none", max_retries=0)
    messages = [[{"role": "user", "content": "the bird flies, the bird flies, the bird"}],
                [{"role": "user", "content": "1 2 3 1 2 3 1 2 3"}]]
    details = []
    for m in messages:
        expected, _, _ = api_tokens(plain, m, max_tokens=20)
        ids, _, r = api_tokens(drafted, m, max_tokens=20)
        assert ids == expected
        details.append(r.usage.completion_tokens_details)
    assert all(d is not None for d in details)
    assert sum(d.accepted_prediction_tokens + d.rejected_prediction_tokens for d in details) > 0
