"""colibri and llama.cpp resident, in the same seconds: per round two fresh processes load
their model, one after the other, and then take turns, burst after burst, each generating
``--tokens`` tokens after the same prompt while the other waits on a pipe.

Why: on a shared host the memory's read rate moves by tens of percent in phases of a few
seconds (``kernel_bandwidth.py --trace``). A round that runs one engine's process after
the other's lets each meet a different phase, and a decode bound by the memory takes the
phase it runs in; short alternating bursts let both engines meet the same phases, so
each pair's ratio compares the engines, not the moments. And both are measured warm, as a
server decodes: on an AMD EPYC, llama.cpp's decode in a fresh process after colibri's ran
9-29% under its warm rate, for a cause not found (docs/benchmarks.md).

    python benchmarks/paired_bursts.py --model /data/olmoe-int8 --gguf /data/olmoe-q8_0.gguf \
        --llama-python /venvs/llama/bin/python --rounds 6 --bursts 8 --out /tmp/int8-pairs
    python benchmarks/paired_bursts.py --model /data/olmoe-int4 --vs-model /data/olmoe-int8

Per burst: decode tok/s as ``colibri bench`` measures it ((tokens - 1) / time from the
first token to the last) and the prompt's prefill time, temperature 1, the burst's own seed, the same for both engines
(the prompt is ``colibri bench``'s seeded random ids; llama.cpp is timed by
``llama_cpp_bench.timed_generation``, with colibri's sampler). colibri loads with
``--preload``; llama.cpp in its default mode (mmap, its repacking as it decides). The first burst of each process is a
warm-up and is not counted. Bursts alternate which engine goes first; ``--gap`` seconds of
quiet come before each (the threads of the engine that just ran stop spinning).
``--vs-model`` pairs colibri with colibri on another model instead (two formats of one
checkpoint, say). Prints a markdown table (per round: each engine's median and range,
the ratio of the medians, the pairs' ratios, the medians of the prefill times and their
ratio, the 1-minute load; then the round medians' spread) and writes OUT.json and OUT.md. Both models stay in memory together: the machine
needs the RAM for both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


# -- the two workers: load, say so, then one burst per request line ------------------------
def colibri_worker(model_dir: str, kv_cache: str = "float32") -> None:
    import colibri_core
    from colibri_core.cli.bench import measured_generation, prompt_ids

    started = time.perf_counter()
    model = colibri_core.load(model_dir, preload=True, kv_cache=kv_cache)
    answer({"load_s": time.perf_counter() - started, "anon_huge_pages_bytes": anon_huge_pages()})

    def burst(request: dict) -> dict:
        ids = prompt_ids(model.lm.vocab_size, request["prompt_tokens"], request["seed"])
        result, measures = measured_generation(model, ids, request["tokens"], temperature=1.0, seed=request["seed"])
        return {"decode_tok_s": result.stats.decode_tok_s, "prefill_s": result.stats.prefill_s,
                "distinct_tokens": measures["distinct_tokens"]}

    serve(burst)
    model.close()


def llama_worker(gguf: str, threads: int, context: int) -> None:
    import llama_cpp
    from benchmarks.llama_cpp_bench import timed_generation  # (the tree's root is on PYTHONPATH)

    started = time.perf_counter()
    llm = llama_cpp.Llama(model_path=gguf, n_threads=threads, n_ctx=context, verbose=False, use_mmap=True)
    answer({"load_s": time.perf_counter() - started})
    serve(lambda request: timed_generation(llm, request["tokens"], request["prompt_tokens"], request["seed"]))


def anon_huge_pages() -> int | None:
    """Bytes of this process's memory in transparent huge pages (the store asks for them)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("AnonHugePages:"))
    except (OSError, StopIteration):
        return None


def answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve(burst) -> None:
    for line in sys.stdin:
        answer(burst(json.loads(line)))


# -- the parent: rounds of paired bursts --------------------------------------------------
class Worker:
    def __init__(self, name: str, cmd: list[str]):
        self.name = name
        self.log = tempfile.TemporaryFile("w+")  # not a pipe: a chatty worker must not block on it
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.seek(0)
            tail = self.log.read().strip().splitlines()[-5:]
            sys.exit(f"the {self.name} worker stopped (exit {self.proc.returncode}): {' | '.join(tail)}")
        return json.loads(line)

    def burst(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def engines(args) -> dict[str, list[str]]:
    """{name: the worker's command}: colibri first, then its peer (llama.cpp on --gguf, or
    colibri on --vs-model), in the order they load."""
    here = str(Path(__file__).resolve())
    first = {"colibri": [sys.executable, here, "--worker", "colibri", "--model", args.model, "--kv-cache", args.kv_cache]}
    if args.vs_model:
        return {**first, "colibri (--vs-model)": [sys.executable, here, "--worker", "colibri", "--model", args.vs_model]}
    return {**first, "llama.cpp": [args.llama_python, here, "--worker", "llama", "--gguf", args.gguf, "--threads",
                                   str(args.threads), "--context", str(args.prompt_tokens + args.tokens + 8)]}


def one_round(args, number: int) -> dict:
    workers, ready = {}, {}
    try:
        for name, cmd in engines(args).items():  # one after the other: colibri takes its huge pages first
            workers[name] = Worker(name, cmd)
            ready[name] = workers[name].read()
        names = list(workers)
        loaded = []
        for name in names:
            huge = ready[name].get("anon_huge_pages_bytes")
            loaded.append(f"{name} {ready[name]['load_s']:.1f} s"
                          + (f" ({huge / 2**30:.2f} GiB in huge pages)" if huge is not None else ""))
        print(f"  loaded: {', '.join(loaded)}", file=sys.stderr)
        bursts = []
        for b in range(args.bursts + 1):  # burst 0 warms each process up
            order = names if b % 2 == 0 else names[::-1]
            pair = {"burst": b, "first": order[0], "load_1min": os.getloadavg()[0]}
            for name in order:
                time.sleep(args.gap)
                request = {"seed": number * 1000 + b, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens}
                pair[name] = workers[name].burst(request)
            pair["ratio"] = pair[names[0]]["decode_tok_s"] / pair[names[1]]["decode_tok_s"]
            bursts.append(pair)
            print(f"  round {number} burst {b}: " + ", ".join(f"{n} {pair[n]['decode_tok_s']:.2f}" for n in names)
                  + f" tok/s, ratio {pair['ratio']:.2f}" + (" (warm-up)" if b == 0 else ""), file=sys.stderr)
    finally:
        for w in workers.values():
            w.close()
    counted = bursts[1:]
    med = {name: statistics.median(p[name]["decode_tok_s"] for p in counted) for name in names}
    prefill = {name: statistics.median(p[name]["prefill_s"] for p in counted) for name in names}
    ratios = [p["ratio"] for p in counted]
    return {"round": number, "engines": names, "prompt_tokens": args.prompt_tokens, "ready": ready, "bursts": bursts,
            "median_tok_s": med,
            "ratio_of_medians": med[names[0]] / med[names[1]], "pair_ratio_median": statistics.median(ratios),
            "pair_ratio_min": min(ratios), "pair_ratio_max": max(ratios), "median_prefill_s": prefill,
            "prefill_time_ratio": prefill[names[0]] / prefill[names[1]]}


def table(rounds: list[dict]) -> str:
    a, b = rounds[0]["engines"]
    lines = [f"| round | {a} tok/s (median, range) | {b} tok/s (median, range) | ratio of medians | "
             f"pairs' ratios (median, range) | prefill s, {a} / {b} (medians) | prefill time ratio | load |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rounds:
        counted = r["bursts"][1:]
        cells = []
        for name in (a, b):
            rates = [p[name]["decode_tok_s"] for p in counted]
            cells.append(f"{r['median_tok_s'][name]:.2f} ({min(rates):.2f}-{max(rates):.2f})")
        loads = [p["load_1min"] for p in counted]
        lines.append(f"| {r['round']} | {cells[0]} | {cells[1]} | {r['ratio_of_medians']:.2f}x | "
                     f"{r['pair_ratio_median']:.2f}x ({r['pair_ratio_min']:.2f}-{r['pair_ratio_max']:.2f}) | "
                     f"{r['median_prefill_s'][a]:.3f} / {r['median_prefill_s'][b]:.3f} | "
                     f"{r['prefill_time_ratio']:.2f}x | {min(loads):.1f}-{max(loads):.1f} |")
    per_round = [r["ratio_of_medians"] for r in rounds]
    lines.append(f"\nratio of medians by round: {min(per_round):.2f}-{max(per_round):.2f}x "
                 f"(median {statistics.median(per_round):.2f}x)")
    prefill = [r["prefill_time_ratio"] for r in rounds]
    lines.append(f"prefill time, {a} / {b}, by round: {min(prefill):.2f}-{max(prefill):.2f}x "
                 f"(median {statistics.median(prefill):.2f}x; {rounds[0]['prompt_tokens']}-token prompt)")
    for name in (a, b):
        medians = [r["median_tok_s"][name] for r in rounds]
        spread = (max(medians) - min(medians)) / statistics.median(medians)
        lines.append(f"{name}: round medians {min(medians):.2f}-{max(medians):.2f} tok/s, spread {spread:.1%} of "
                     "their median")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="colibri model directory (loaded with preload)")
    ap.add_argument("--gguf", help="llama.cpp GGUF of the same model")
    ap.add_argument("--vs-model", help="pair colibri with colibri on this model instead of llama.cpp (another "
                                       "format of it, say)")
    ap.add_argument("--llama-python", default=sys.executable,
                    help="python of the environment with llama-cpp-python (and colibri-core, for its sampler)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bursts", type=int, default=8, help="counted bursts per engine per round (after one warm-up)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--gap", type=float, default=0.3, help="seconds of quiet before each burst")
    ap.add_argument("--kv-cache", default="float32", choices=["float32", "float16"], help="colibri's --kv-cache")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads")
    ap.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    ap.add_argument("--worker", choices=["colibri", "llama"], help=argparse.SUPPRESS)
    ap.add_argument("--context", type=int, default=128, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker == "colibri":
        return colibri_worker(a.model, a.kv_cache)
    if a.worker == "llama":
        return llama_worker(a.gguf, a.threads, a.context)
    if not a.model:
        ap.error("--model is required")
    if bool(a.gguf) == bool(a.vs_model):
        ap.error("give the peer: --gguf (llama.cpp) or --vs-model (colibri), one of them")
    for option, least in (("rounds", 1), ("bursts", 1), ("tokens", 2)):  # a decode rate needs two tokens
        if getattr(a, option) < least:
            ap.error(f"--{option} must be at least {least}")
    if a.gap < 0:
        ap.error("--gap must not be negative")
    for path in (a.model, a.gguf or a.vs_model, a.llama_python):
        if not Path(path).exists():
            ap.error(f"{path}: no such file or directory")
    sys.path.insert(0, str(HERE.parent))
    from benchmarks.streaming_table import children_import_this_tree

    children_import_this_tree()  # both workers run this tree's colibri_core
    print(f"$ {' '.join(sys.argv)}", file=sys.stderr)
    rounds = []
    for number in range(1, a.rounds + 1):
        print(f"round {number} {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.2f}", file=sys.stderr)
        rounds.append(one_round(a, number))
    report = table(rounds)
    print(report)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        for suffix, text in ((".json", json.dumps({"argv": sys.argv, "rounds": rounds}, indent=1)), (".md", report + "\n")):
            part = a.out.with_name(a.out.name + suffix + ".part")
            part.write_text(text)
            os.replace(part, a.out.with_name(a.out.name + suffix))


if __name__ == "__main__":
    main()
