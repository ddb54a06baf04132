"""Expert-store benchmark: hit rate and decode speed under RAM budgets, cold page cache.

For each budget (a share of the experts' resident bytes, on top of the dense weights)
and each policy — LRU alone, LRU + pinned hot set, LRU + pinning + prefetch — this runs
``colibri run --json`` in a fresh process after dropping the page cache, and reports
the expert hit rate, decode tokens/s and the physical bound: measured disk bandwidth /
bytes missed per token. The routing history used for pinning comes from a separate
warm-up generation on other prompts (history can overfit, so evaluation prompts differ).

    python benchmarks/store_bench.py --model /data/olmoe-syn --budgets 10,25,50,100 --repeats 3

Needs root to drop the page cache (sync; echo 3 > /proc/sys/vm/drop_caches).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

POLICIES = {
    "LRU": ["--pin", "off"],
    "LRU+pin": ["--pin", "on"],
    "LRU+pin+prefetch": ["--pin", "on", "--prefetch"],
}


def colibri(*args, check=True) -> dict | None:
    out = subprocess.run([sys.executable, "-m", "colibri_core", *map(str, args)], capture_output=True, text=True)
    if check and out.returncode != 0:
        raise SystemExit(f"colibri {' '.join(map(str, args))} failed:\n{out.stderr}")
    return json.loads(out.stdout) if out.stdout.strip().startswith(("{", "[")) else None


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def disk_bandwidth(model: Path, total=1 << 30, chunk=64 << 20) -> float:
    """Cold O_DIRECT reads of 64 MiB from the shards: bytes/s."""
    from colibri_core.io.drives import aligned_empty

    drop_caches()
    shards = sorted(model.glob("*.safetensors"))
    chunk = min(chunk, max(os.path.getsize(s) for s in shards) // 4096 * 4096)  # small test models
    buf = aligned_empty(chunk)
    done, started = 0, time.perf_counter()
    for shard in shards:
        fd = os.open(shard, os.O_RDONLY | os.O_DIRECT)
        try:
            size = os.path.getsize(shard) // chunk * chunk
            for offset in range(0, size, chunk):
                done += os.preadv(fd, [memoryview(buf)], offset)
                if done >= total:
                    return done / (time.perf_counter() - started)
        finally:
            os.close(fd)
    return done / (time.perf_counter() - started)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--budgets", default="10,25,50,100", help="percent of the experts' resident bytes")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--warmup-tokens", type=int, default=256, help="tokens generated to build the routing history")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--out", type=Path, default=None, help="write all raw results as JSON here")
    a = p.parse_args(argv)

    plan = colibri("plan", "--model", a.model, "--json", "--disk-bw", "1G", "--pin", "off")
    config = json.loads((a.model / "config.json").read_text())
    vocab = config["vocab_size"]
    rng = np.random.default_rng(1234)
    train_prompt = ",".join(map(str, rng.integers(0, vocab, 32)))
    eval_prompts = [",".join(map(str, rng.integers(0, vocab, 16))) for _ in range(a.repeats)]

    history = a.model / "colibri-usage.json"
    history.unlink(missing_ok=True)
    colibri("run", "--model", a.model, "--token-ids", train_prompt, "--max-tokens", a.warmup_tokens,
            "--temperature", "1", "--seed", "99", "--pin", "off", "--json")
    bandwidth = disk_bandwidth(a.model)
    print(f"disk bandwidth (cold O_DIRECT, 64 MiB reads): {bandwidth / 1e9:.2f} GB/s", file=sys.stderr)

    rows, raw = [], []
    for pct in map(int, a.budgets.split(",")):
        ram = plan["dense_bytes"] + pct * plan["experts_total_bytes"] // 100
        for policy in a.policies.split(","):
            runs = []
            for r, prompt in enumerate(eval_prompts):
                drop_caches()
                result = colibri("run", "--model", a.model, "--token-ids", prompt, "--max-tokens", a.tokens,
                                 "--temperature", "1", "--seed", r, "--ram", ram, "--history", "read",
                                 *POLICIES[policy], "--json")
                s = result["stats"]
                per_token = s["bytes_read"] / max(s["generated_tokens"], 1)
                runs.append({**s, "bytes_per_token": per_token,
                             "bound_tok_s": bandwidth / per_token if per_token else float("inf")})
            raw.append({"budget_pct": pct, "ram": ram, "policy": policy, "runs": runs})
            med = lambda k: statistics.median(x[k] for x in runs)
            spread = lambda k: max(x[k] for x in runs) - min(x[k] for x in runs)
            rows.append((pct, ram, policy, med("hit_rate"), med("hits_prefetched") / max(1, med("expert_hits") + med("hits_prefetched") + med("expert_misses")),
                         med("decode_tok_s"), spread("decode_tok_s"), med("bytes_per_token"), med("bound_tok_s")))
            r = rows[-1]
            print(f"{pct:>3}% {policy:<17} hit {r[3]:.1%} prefetched {r[4]:.1%} decode {r[5]:.2f} tok/s "
                  f"(spread {r[6]:.2f}) {r[7] / 2**20:.1f} MiB/token, bound {r[8]:.2f} tok/s", file=sys.stderr)

    print("| budget (experts) | RAM | policy | hit rate | served by prefetch | decode tok/s (median, spread) | "
          "disk MiB/token | bound tok/s | share of bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for pct, ram, policy, hit, pre, tok_s, spread, per_token, bound in rows:
        share = f"{tok_s / bound:.0%}" if bound != float("inf") else "n/a (no reads)"
        bound_text = f"{bound:.2f}" if bound != float("inf") else "∞"
        print(f"| {pct}% | {ram / 2**30:.2f} GiB | {policy} | {hit:.1%} | {pre:.1%} | {tok_s:.2f} ({spread:.2f}) | "
              f"{per_token / 2**20:.1f} | {bound_text} | {share} |")
    if a.out:
        a.out.write_text(json.dumps({"disk_bandwidth": bandwidth, "plan": plan, "results": raw}, indent=1))


if __name__ == "__main__":
    main()
