"""Kernel microbenchmark: one activation row (decode) and 32 rows (prefill) against a
4096 x 4096 weight in each format, beside numpy's float32 matmul measured in the same
run. By default each format runs its calls back to back (as in a model's decode, where
kernel calls follow each other); ``--interleave`` alternates formats with numpy's BLAS
call by call, which shows what two thread pools (OpenMP and OpenBLAS) on two cores cost
each other. Medians and spreads (max - min over rounds) are reported.

    python benchmarks/kernels_bench.py [--rounds 15] [--size 4096] [--interleave] [--formats int4-gs64,ct-int4-g32]
    python benchmarks/kernels_bench.py --shape 5760x2880 --rows 1,4,8   # N x K (gpt-oss-20b's gate_up)

The minimum over rounds is printed beside the median: on a shared machine it is the
better estimate of what a kernel costs uncontended.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.formats.base import QuantTensor, f32_to_bf16
from colibri_core.formats.integer import MXFP4, Int4GS64, Int8Row
from colibri_core.testing.compressed_tensors import quantize_int4
from colibri_core.testing.mxfp4 import quantize_mxfp4


def weights(n: int, k: int, rng) -> dict:
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
    out = {"f32 (numpy BLAS)": w}
    for kind, fmt in (("q8", Int8Row()), ("q4", Int4GS64()), ("mxfp4", MXFP4())):
        t = fmt.encode("w", w)
        out[fmt.name] = QuantTensor(kind, t["w"][1], t["w.qs"][1], (n, k))
    codes = rng.integers(0, 0x7F, (n, k), dtype=np.uint8) | (rng.integers(0, 2, (n, k), dtype=np.uint8) << 7)
    out["fp8-e4m3-b128"] = QuantTensor("fp8", codes, rng.random((-(-n // 128), -(-k // 128))).astype(np.float32), (n, k))
    out["bf16"] = QuantTensor("bf16", f32_to_bf16(w), None, (n, k))
    # the checkpoint layouts read natively: compressed-tensors int4 (Kimi K2.5) and gpt-oss MXFP4
    packed, scales, _ = quantize_int4(w)
    out["ct-int4-g32"] = QuantTensor("q4g32", packed.view(np.uint8).reshape(n, -1), scales, (n, k))
    blocks, exponents, _ = quantize_mxfp4(w)
    out["mxfp4-hub"] = QuantTensor("mxfp4pair", blocks.reshape(n, -1), exponents, (n, k))
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--shape", default="", help="N x K of the weight (output x input features), e.g. 5760x2880; "
                   "overrides --size")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--rows", default="1,32")
    p.add_argument("--interleave", action="store_true")
    p.add_argument("--formats", default="", help="comma-separated formats to run (besides float32 numpy); default all")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    backend = CpuBackend()
    n, k = (int(v) for v in a.shape.lower().split("x")) if a.shape else (a.size, a.size)
    ws = weights(n, k, rng)
    if a.formats:
        wanted = set(a.formats.split(","))
        ws = {name: w for name, w in ws.items() if name in wanted or name.startswith("f32")}
    print(f"threads: OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'default')}, cores {os.cpu_count()}")
    for rows in map(int, a.rows.split(",")):
        x = rng.standard_normal((rows, k)).astype(np.float32)
        times = {name: [] for name in ws}

        def measure(name, w):
            backend.linear(x, w)  # warm caches and buffers
            start = time.perf_counter()
            for _ in range(5):
                backend.linear(x, w)
            times[name].append((time.perf_counter() - start) / 5 * 1e3)

        if a.interleave:
            for _ in range(a.rounds):
                for name, w in ws.items():
                    measure(name, w)
        else:
            for name, w in ws.items():
                for _ in range(a.rounds):
                    measure(name, w)
        base = statistics.median(times["f32 (numpy BLAS)"])
        print(f"\n{n}x{k}, {rows} row(s): median ms (spread), speed vs float32 numpy")
        print("| format | ms | min ms | spread | vs f32 numpy | weight GB/s |\n|---|---|---|---|---|---|")
        for name, t in times.items():
            med = statistics.median(t)
            print(f"| {name} | {med:.3f} | {min(t):.3f} | {max(t) - min(t):.3f} | {base / med:.2f}x | "
                  f"{ws[name].nbytes / med / 1e6:.1f} |")


if __name__ == "__main__":
    main()
