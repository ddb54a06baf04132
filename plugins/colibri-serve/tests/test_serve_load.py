"""A bounded load test on loopback: 32 concurrent streaming clients send 320 greedy
requests, then 32 more disconnect mid-stream. Every reply must be exactly the one its
prompt gets alone (nothing lost, truncated or interleaved), the slots and KV
reservations must all come back, and the server's memory must return to where it was.
Time to first token (p50, p99) is printed."""

import asyncio
import json
import statistics
import time

import httpx

CLIENTS = 32
REQUESTS = 320
PROMPTS = [f"bird {i} flies to the old oak tree" for i in range(8)]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics").text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line and not line.startswith("#")}


def body(i: int, stream: bool, max_tokens: int = 24) -> dict:
    return {"model": "random-olmoe", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "temperature": 0, "max_tokens": max_tokens, "stream": stream}


async def streamed(client: httpx.AsyncClient, url: str, i: int) -> tuple[str, float, list[str]]:
    started = time.perf_counter()
    ttft, pieces, finishes, done = None, [], [], False
    async with client.stream("POST", url + "/v1/chat/completions", json=body(i, True)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            choice = chunk["choices"][0]
            if choice["delta"].get("content"):
                ttft = ttft or time.perf_counter() - started
                pieces.append(choice["delta"]["content"])
            if choice["finish_reason"]:
                finishes.append(choice["finish_reason"])
    assert done and len(finishes) == 1, (done, finishes)
    return "".join(pieces), ttft or time.perf_counter() - started, finishes


async def disconnected(client: httpx.AsyncClient, url: str, i: int) -> None:
    async with client.stream("POST", url + "/v1/chat/completions", json=body(i, True, max_tokens=40)) as r:
        async for line in r.aiter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                return  # leave after the first token: the connection closes


async def load(url: str, expected: dict[int, str]) -> list[float]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        queue = asyncio.Queue()
        for i in range(REQUESTS):
            queue.put_nowait(i)
        ttfts: list[float] = []

        async def worker():
            while not queue.empty():
                i = queue.get_nowait()
                text, ttft, _ = await streamed(client, url, i)
                assert text == expected[i % len(PROMPTS)], f"request {i}: {text!r}"
                ttfts.append(ttft)

        await asyncio.gather(*(worker() for _ in range(CLIENTS)))
        await asyncio.gather(*(disconnected(client, url, i) for i in range(CLIENTS)))
    return ttfts


def test_bounded_load_with_disconnects(start_server, random_model):
    server = start_server(random_model, "--slots", "8", "--max-queue", "64")
    expected = {}
    for i in range(len(PROMPTS)):
        r = httpx.post(server.url + "/v1/chat/completions", json=body(i, False), timeout=120).json()
        expected[i] = r["choices"][0]["message"]["content"]
    assert len(set(expected.values())) > 1
    baseline = rss_bytes(server.proc.pid)

    started = time.perf_counter()
    ttfts = asyncio.run(load(server.url, expected))
    took = time.perf_counter() - started
    assert len(ttfts) == REQUESTS

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics(server.url)
        if m["colibri_active"] == 0 and m["colibri_queue_depth"] == 0:
            break
        time.sleep(0.1)
    assert m["colibri_active"] == 0 and m["colibri_queue_depth"] == 0
    assert m["colibri_kv_reserved_bytes"] == 0  # no prompt reached a whole prefill chunk: nothing retained
    assert m["colibri_requests_total"] == len(PROMPTS) + REQUESTS + CLIENTS
    # the disconnected ones stopped early: fewer tokens than running each of them to max_tokens
    assert m["colibri_tokens_total"] < (len(PROMPTS) + REQUESTS) * 24 + CLIENTS * 40
    grown = rss_bytes(server.proc.pid) - baseline
    assert grown < 64 << 20, f"server memory grew by {grown / 2**20:.1f} MiB"
    ordered = sorted(ttfts)
    p50, p99 = statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))]
    print(f"\nload: {REQUESTS} streamed requests, {CLIENTS} clients: ttft p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms; "
          f"memory {grown / 2**20:+.1f} MiB; {took:.1f} s")
