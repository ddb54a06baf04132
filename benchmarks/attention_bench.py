"""The CPU attention kernel alone, at the full OLMoE shape (16 heads of 128): a prefill's
(T queries over T positions, the keys and values in the caches) and a decode step's
(one query per layer over 16 layers' caches of --positions each, 512 MiB in float32 at
2048: read from memory, as a decode step reads them), with float32 or float16 keys and
values. ``--kernels`` names other builds of ``_kernels`` (a .so, e.g. the previous tree's)
to run alternately with this tree's, each in a fresh process, rounds interleaved.

    python benchmarks/attention_bench.py [--kernels OTHER.so ...] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HEADS, DIM, LAYERS = 16, 128, 16
PREFILL = ((128, 20), (512, 3), (2048, 1))  # (prompt tokens, repeats)


def child(so: str, positions: int) -> dict:
    import numpy as np

    spec = importlib.util.spec_from_file_location("_kernels", so)
    kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kernels)
    rng = np.random.default_rng(0)
    out = {}
    for t, repeats in PREFILL:  # keys and values of one layer, in the cache's layout
        q = rng.standard_normal((t, HEADS, DIM)).astype(np.float32)
        k = rng.standard_normal((HEADS, t + 64, DIM)).astype(np.float32)[:, :t]
        v = rng.standard_normal((HEADS, t + 64, DIM)).astype(np.float32)[:, :t]
        o = np.empty((t, HEADS, DIM), np.float32)
        kernels.attention(q, k, v, 0, DIM**-0.5, o)
        started = time.perf_counter()
        for _ in range(repeats):
            kernels.attention(q, k, v, 0, DIM**-0.5, o)
        out[f"prefill_{t}_ms_per_layer"] = (time.perf_counter() - started) / repeats * 1e3
    for dtype in ("float32", "float16"):
        ks = [rng.standard_normal((HEADS, positions + 64, DIM)).astype(dtype) for _ in range(LAYERS)]
        vs = [rng.standard_normal((HEADS, positions + 64, DIM)).astype(dtype) for _ in range(LAYERS)]
        q = rng.standard_normal((1, HEADS, DIM)).astype(np.float32)
        o = np.empty((1, HEADS, DIM), np.float32)
        times = []
        for _ in range(5):
            started = time.perf_counter()
            try:
                for layer in range(LAYERS):
                    kernels.attention(q, ks[layer][:, :positions], vs[layer][:, :positions], positions - 1, DIM**-0.5, o)
            except ValueError:  # a build without float16 caches
                break
            times.append(time.perf_counter() - started)
        if times:
            ms = statistics.median(times) * 1e3
            out[f"decode_{dtype}_ms_per_token"] = ms
            out[f"decode_{dtype}_gb_s"] = 2 * LAYERS * HEADS * positions * DIM * np.dtype(dtype).itemsize / ms / 1e6
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", nargs="*", default=[], help="other builds of _kernels to compare")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--positions", type=int, default=2048, help="context of the decode step")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child[0], int(a.child[1]))))
        return
    here = Path(__file__).resolve().parents[1] / "colibri_core" / "compute" / "cpu"
    builds = {"this tree": str(next(here.glob("_kernels*.so")))} | {k: k for k in a.kernels}
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    results: dict[str, list[dict]] = {name: [] for name in builds}
    for r in range(a.rounds):
        for name, so in builds.items():
            run = subprocess.run([sys.executable, __file__, "--child", so, str(a.positions)], env=env, capture_output=True,
                                 text=True, check=True)
            results[name].append(json.loads(run.stdout))
            print(f"round {r + 1} {name}: {results[name][-1]}", file=sys.stderr)
    keys = sorted({k for runs in results.values() for run in runs for k in run})
    print(f"{a.threads} threads, {a.rounds} rounds, medians; decode: one query over {LAYERS} layers x {a.positions} positions")
    print("| measure | " + " | ".join(builds) + " |")
    print("|---|" + "---|" * len(builds))
    for k in keys:
        cells = [f"{statistics.median(run[k] for run in runs):.2f}" if all(k in run for run in runs) else "-"
                 for runs in results.values()]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
