"""Serving under a RAM budget that streams: colibri serve beside llama-cpp-python's server.

Per round, for each concurrency level C and each engine: drop the page cache, start a
fresh server inside a memory cgroup (nothing else runs in it; the clients run outside),
wait until it has loaded, send one short warm-up request, then run C closed-loop clients: each
sends streaming /v1/completions requests back to back (its own seeded random prompt,
temperature 1, --tokens tokens each). After --ramp seconds of that load, a window of
--window seconds opens; counted in it:
- aggregate tok/s: tokens streamed to all clients inside the window / its length
  (prefills of requests arriving meanwhile included: what a loaded server delivers);
- disk bytes per token: the server process's ``read_bytes`` over the window
  (/proc/PID/io: page-cache misses and O_DIRECT reads alike) / those tokens;
- p50 time to first token and the requests finished (ramp and window).
The server is stopped when the window closes.
A server that serialises requests (llama_cpp.server) queues the clients; one that
batches (colibri) decodes them together.

    python benchmarks/serve_bench.py --colibri-model /work/bench/olmoe-full-int4-tok \
        --gguf /work/bench/olmoe-q4_0.gguf --llama-python /work/llvenv/bin/python --llama-no-repack \
        --prompt-text --cgroup 3G --ram 2G --levels 1,4,16 --tokens 32 --prompt-tokens 8 \
        --rounds 2 --cold --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from colibri_core.cli.bench import Cgroup, drop_page_cache
from colibri_core.units import parse_size


NO_REPACK_SERVER = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from llama_cpp_bench import disable_repacking
disable_repacking()
sys.argv[0] = "llama_cpp.server"
from llama_cpp.server.__main__ import main
main()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


class Server:
    """One engine's server process in its own memory cgroup."""

    def __init__(self, engine: str, a, port: int):
        self.engine, self.port = engine, port
        if engine == "colibri":
            cmd = [str(Path(sys.executable).with_name("colibri")), "serve", "--model", str(a.colibri_model),
                   "--port", str(port), "--slots", str(max(a.levels)), "--ram", a.ram, *a.colibri_args.split()]
        else:
            # llama_cpp.server has no switch for llama.cpp's weight repacking (which cannot
            # load in a small cgroup): --llama-no-repack turns it off in the model defaults
            launch = ["-c", NO_REPACK_SERVER] if a.llama_no_repack else ["-m", "llama_cpp.server"]
            cmd = [a.llama_python, *launch, "--model", str(a.gguf), "--port", str(port),
                   "--n_threads", str(a.threads), "--n_ctx", str(a.llama_ctx), "--use_mmap", "True",
                   "--use_mlock", "False",  # its default where mlock works: a model locked in RAM cannot stream
                   "--interrupt_requests", "False",  # queue concurrent requests rather than cut the running one
                   *a.llama_args.split()]
        self.cmd = cmd
        self.group = Cgroup.create(parse_size(a.cgroup)) if a.cgroup else None
        self.log = open(a.log_dir / f"{engine}-{port}.log", "w")
        preexec = (lambda: self.group.add(os.getpid())) if self.group else None
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=preexec)
        self.url = f"http://127.0.0.1:{port}"

    def wait_ready(self, timeout: float) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.engine} server exited with {self.proc.returncode}: see {self.log.name}")
            try:  # colibri's /health answers 503 until loaded; llama-cpp-python has none
                health = httpx.get(self.url + "/health", timeout=2)
                models = httpx.get(self.url + "/v1/models", timeout=2)
                if models.status_code == 200 and health.status_code in (200, 404):
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.engine} server not ready after {timeout} s")

    def model_name(self) -> str:
        return httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def stop(self) -> dict:
        peak = self.group.peak() if self.group else None
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.group:
            self.group.remove()
        self.log.close()
        return {"cgroup_peak_bytes": peak}


def stream_request(url: str, model: str, prompt: list[int] | str, tokens: int, seed: int, arrivals: list) -> dict:
    """One streaming completion; appends each token's arrival time to ``arrivals``."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 1.0, "seed": seed,
            "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first, chunks, usage = None, 0, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            choices = event.get("choices") or []
            if choices and choices[0].get("finish_reason") is None:
                now = time.perf_counter()
                first = first or now
                arrivals.append(now)
                chunks += 1
    return {"sent": sent, "first": first, "chunks": chunks,
            "usage_tokens": usage["completion_tokens"] if usage else None}


def level(server: Server, model: str, concurrency: int, a, round_no: int) -> dict:
    """Closed loop: ``concurrency`` clients each send requests back to back; after a ramp,
    tokens and disk reads are counted over a fixed window."""
    import numpy as np

    stop_at = time.perf_counter() + a.ramp + a.window
    arrivals: list[float] = []  # list.append is atomic: the clients share it
    done: list[dict] = []
    errors: list[str] = []

    def client(i: int) -> None:
        rng = np.random.default_rng(1000 * round_no + 97 * concurrency + i)
        n = 0
        while time.perf_counter() < stop_at:
            prompt = ("".join(chr(97 + c) for c in rng.integers(0, 26, a.prompt_tokens)) if a.prompt_text
                      else rng.integers(0, a.vocab, a.prompt_tokens).tolist())
            try:
                done.append(stream_request(server.url, model, prompt, a.tokens, 10000 * i + n, arrivals))
            except httpx.HTTPError as exc:
                if time.perf_counter() < stop_at:  # after the window the server is stopped under it
                    errors.append(repr(exc))
                return
            n += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(a.ramp)
    before, w0 = read_bytes(server.proc.pid), time.perf_counter()
    time.sleep(max(0.0, stop_at - time.perf_counter()))
    disk, w1 = read_bytes(server.proc.pid) - before, time.perf_counter()
    in_window = sum(1 for t in list(arrivals) if w0 <= t < w1)
    finished = [d for d in done if d["usage_tokens"] is not None]
    return {"concurrency": concurrency, "window_s": w1 - w0, "tokens_in_window": in_window,
            "tok_s": in_window / (w1 - w0), "disk_read_bytes": disk,
            "disk_bytes_per_token": disk / in_window if in_window else None,
            "requests_finished": len(done), "ttft_p50_s": statistics.median([d["first"] - d["sent"] for d in done if d["first"]] or [float("nan")]),
            # one text chunk per token, or the count is wrong: checked against usage where given
            "chunk_count_mismatches": sum(1 for d in finished if d["usage_tokens"] != d["chunks"]),
            "errors": errors[:3], "elapsed_s": time.perf_counter() - t0}


def run_level(engine: str, concurrency: int, a, round_no: int) -> dict:
    """A fresh server (cold page cache, its own cgroup) for one concurrency level: what a
    level leaves queued (a serialising server's backlog) cannot leak into the next."""
    cache = drop_page_cache(a.colibri_model if engine == "colibri" else a.gguf.parent) if a.cold else "warm"
    while loadavg() > a.max_load:
        time.sleep(5)
    load_at_start = loadavg()
    server = Server(engine, a, free_port())
    try:
        ready_s = server.wait_ready(a.ready_timeout)
        model = server.model_name()
        stream_request(server.url, model, "warm up" if a.prompt_text else list(range(1, 9)), 4, 0, [])
        result = level(server, model, concurrency, a, round_no)
    finally:
        tail = server.stop()
    result = {"engine": engine, "round": round_no, "cache": cache, "loadavg_at_start": load_at_start,
              "loadavg_at_end": loadavg(), "ready_s": ready_s, "command": server.cmd, **result, **tail}
    print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--colibri-model", type=Path, required=True)
    p.add_argument("--gguf", type=Path, help="the same model for llama.cpp (omit to run colibri only)")
    p.add_argument("--llama-python", default="python", help="a Python with llama-cpp-python[server]")
    p.add_argument("--cgroup", default=None, help="memory limit of each server's cgroup, e.g. 3G")
    p.add_argument("--ram", default="2.5G", help="colibri's --ram")
    p.add_argument("--colibri-args", default="--prefetch --direct-io", help="more colibri serve options")
    p.add_argument("--llama-args", default="", help="more llama_cpp.server options")
    p.add_argument("--llama-no-repack", action="store_true", help="llama.cpp without weight repacking (use_extra_bufts off)")
    p.add_argument("--prompt-text", action="store_true",
                   help="send prompts as text (random letters, about --prompt-tokens of them) instead of token ids: "
                        "llama_cpp.server takes text only; give colibri a model directory with the same tokenizer")
    p.add_argument("--llama-ctx", type=int, default=2048)
    p.add_argument("--levels", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--ramp", type=float, default=30, help="seconds of load before the window opens")
    p.add_argument("--window", type=float, default=60, help="seconds over which tokens and reads are counted")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--vocab", type=int, default=50304, help="prompt ids are drawn below this")
    p.add_argument("--only", choices=["colibri", "llama.cpp"], help="run one engine")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--cold", action="store_true", help="drop the page cache before each server starts")
    p.add_argument("--max-load", type=float, default=1.0, help="start a server only below this 1-minute load")
    p.add_argument("--ready-timeout", type=float, default=900)
    p.add_argument("--log-dir", type=Path, default=Path("/tmp"))
    p.add_argument("--json", type=Path, help="write all results here")
    a = p.parse_args(argv)
    engines = [e for e in ["colibri"] + (["llama.cpp"] if a.gguf else []) if not a.only or e == a.only]
    results = []
    for r in range(a.rounds):  # interleaved: each round runs every level of every engine once
        for c in a.levels:
            for engine in engines:
                results.append(run_level(engine, c, a, r))
            if a.json:
                tmp = a.json.with_suffix(".tmp")
                tmp.write_text(json.dumps(results, indent=1))
                tmp.replace(a.json)
    for lv in results:
        per_token = f"{lv['disk_bytes_per_token'] / 1e6:.1f} MB/token" if lv["disk_bytes_per_token"] else "-"
        print(f"{lv['engine']:10} r{lv['round']} c={lv['concurrency']:>3}  {lv['tok_s']:.2f} tok/s  disk {per_token}  "
              f"ttft p50 {lv['ttft_p50_s']:.1f} s  finished {lv['requests_finished']}  errors {len(lv['errors'])}")


if __name__ == "__main__":
    main()
