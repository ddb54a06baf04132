"""Backends side by side on one checkpoint: interleaved rounds of `colibri bench`, one
fresh process per backend per round (the machines are noisy: compare within a round,
quote medians).

    python benchmarks/backend_rounds.py --model ~/.cache/colibri/demo-olmoe --ram 394399744 \\
        --backends cpu,mlx --rounds 3 --out /tmp/demo-rounds.json
    python benchmarks/backend_rounds.py --model /data/olmoe-full-int4 --preload --backends cpu,mlx

Prints a markdown table: per backend the median decode tok/s, prefill seconds, load
seconds, peak RSS and expert hit rate, each round's decode tok/s, and each backend's
decode ratio to the first backend within the same round. Also says whether every
backend generated the same tokens in each round (sampled at temperature 1 with the same
seed: logits within rounding give the same draws).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def bench(args, backend: str) -> dict:
    cmd = [args.colibri, "bench", "--model", args.model, "--backend", backend, "--repeats", "1", "--tokens",
           str(args.tokens), "--prompt-tokens", str(args.prompt_tokens), "--temperature", "1", "--json"]
    if args.ram:
        cmd += ["--ram", args.ram]
    if args.preload:
        cmd.append("--preload")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)["runs"]["colibri"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--backends", default="cpu,mlx")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--ram", default=None)
    ap.add_argument("--preload", action="store_true")
    ap.add_argument("--colibri", default=str(Path(sys.executable).with_name("colibri")))
    ap.add_argument("--out", default=None, help="Write every run's JSON here.")
    args = ap.parse_args()
    backends = args.backends.split(",")
    rounds = []
    for r in range(args.rounds):
        runs = {b: bench(args, b) for b in backends}
        rounds.append(runs)
        print(f"round {r + 1}: " + ", ".join(f"{b} {runs[b]['decode_tok_s']:.2f} tok/s" for b in backends), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(rounds, indent=1))
    first = backends[0]
    same = all(len({tuple(run[b]["token_ids"]) for b in backends}) == 1 for run in rounds)
    print(f"model {args.model}; {args.rounds} interleaved rounds, {args.prompt_tokens}-token prompt, "
          f"{args.tokens} tokens at temperature 1; ram {args.ram or 'default'}{', preloaded' if args.preload else ''}; "
          f"same tokens on every backend in every round: {'yes' if same else 'NO'}\n")
    print("| backend | decode tok/s (median) | rounds | vs " + first + " (per round) | prefill s | load s | peak RSS GiB | hit rate |")
    print("|---|---|---|---|---|---|---|---|")
    for b in backends:
        col = [run[b] for run in rounds]
        med = lambda key: statistics.median(c[key] for c in col)  # noqa: E731
        ratios = ", ".join(f"{run[b]['decode_tok_s'] / run[first]['decode_tok_s']:.2f}x" for run in rounds)
        each = ", ".join(f"{c['decode_tok_s']:.2f}" for c in col)
        print(f"| {b} | {med('decode_tok_s'):.2f} | {each} | {ratios} | "
              f"{med('prefill_s'):.3f} | {med('load_s'):.2f} | {med('peak_rss_bytes') / 2**30:.2f} | {med('hit_rate'):.2f} |")


if __name__ == "__main__":
    main()
