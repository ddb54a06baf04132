"""How close the CPU backend's decode kernel streams experts to the memory's read rate,
measured in one process: each sweep runs the ``moe`` kernel once per layer over distinct
experts of the OLMoE shape (a working set far past the caches, as decode streams them,
in the store's own huge-page buffers), then reads a buffer with a plain load loop on the
same threads (C, compiled here with ``cc -O2 -march=native -fopenmp``). The ratio of the
two rates is the figure to compare between kernel variants: on shared machines the
memory's rate itself moves by tens of percent within minutes. ``--layers 1 --experts 1``
keeps the experts in the last-level cache (one OLMoE expert: 6 MiB int8, 3 MiB int4),
each sweep passing over them until it has read 256 MiB: what the kernel computes per
second when memory is not what holds it back. ``--trace SECONDS`` times the load loop
alone every 0.2 s instead, to show how the memory's own rate moves. The script imports the
colibri_core of the tree it lies in, whatever PYTHONPATH says: to compare two builds,
run each tree's own copy, alternating.

    python benchmarks/kernel_bandwidth.py [--format q8|q4|q4g32|fp8|mxfp4pair] [--layers 40] [--experts 8] [--sweeps 10]
    python benchmarks/kernel_bandwidth.py --trace 90 [--read-mib 512]
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from colibri_core.compute.cpu.backend import CpuBackend  # noqa: E402
from colibri_core.formats.base import QuantTensor  # noqa: E402
from colibri_core.formats.integer import Int4GS64, Int8Row  # noqa: E402
from colibri_core.io.buffers import expert_buffer, huge_buffer  # noqa: E402

LOAD_LOOP = r"""
#include <stddef.h>
#include <stdint.h>
uint64_t read_all(const uint64_t *p, size_t n) {  /* n a multiple of 8 */
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    #pragma omp parallel for reduction(+:a0,a1,a2,a3,a4,a5,a6,a7) schedule(static)
    for (size_t i = 0; i < n; i += 8) {
        a0 += p[i]; a1 += p[i + 1]; a2 += p[i + 2]; a3 += p[i + 3];
        a4 += p[i + 4]; a5 += p[i + 5]; a6 += p[i + 6]; a7 += p[i + 7];
    }
    return a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}
"""


def load_loop(workdir: Path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("kernel_bandwidth.py needs a C compiler (cc) for its load loop")
    src, lib = workdir / "loop.c", workdir / "loop.so"
    src.write_text(LOAD_LOOP)
    subprocess.run([cc, "-O2", "-march=native", "-fopenmp", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    fn = ctypes.CDLL(str(lib)).read_all
    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
    return fn


def trace(seconds: float, read_mib: int) -> None:
    """The load loop's rate every 0.2 s, ten to a line (the memory's own rate over time)."""
    if seconds <= 0 or read_mib < 1:
        raise SystemExit("--trace and --read-mib must be positive")
    with tempfile.TemporaryDirectory() as tmp:
        read_all = load_loop(Path(tmp))
        raw = huge_buffer(read_mib << 20)
        raw[:] = 1
        begin, line = time.perf_counter(), []
        while time.perf_counter() - begin < seconds:
            start = time.perf_counter()
            read_all(raw.ctypes.data, raw.nbytes // 8)
            line.append(raw.nbytes / (time.perf_counter() - start) / 1e9)
            if len(line) == 10:
                print(f"{time.perf_counter() - begin:6.1f} s: " + " ".join(f"{r:.0f}" for r in line) + " GB/s", flush=True)
                line = []
            time.sleep(0.2)
        if line:
            print(f"{time.perf_counter() - begin:6.1f} s: " + " ".join(f"{r:.0f}" for r in line) + " GB/s")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", choices=["q8", "q4", "q4g32", "fp8", "mxfp4pair"], default="q8",
                   help="int8-row, int4-gs64, compressed-tensors int4 (pair order), fp8-e4m3 with 128 x 128 block "
                        "scales, or MXFP4 (gpt-oss / fp4-e2m1-g32 layout) experts")
    p.add_argument("--layers", type=int, default=40, help="layers of --experts distinct experts each (q8: 6 MiB an expert)")
    p.add_argument("--experts", type=int, default=8, help="distinct experts per layer (the top-k, 8)")
    p.add_argument("--sweeps", type=int, default=10)
    p.add_argument("--read-mib", type=int, default=1024, help="size of the load loop's buffer")
    p.add_argument("--trace", type=float, metavar="SECONDS", help="only the load loop, timed every 0.2 s for this long")
    a = p.parse_args(argv)
    if a.trace is not None:
        return trace(a.trace, a.read_mib)
    backend = CpuBackend()
    if backend.kernels is None:
        raise SystemExit("the compiled CPU kernels are not built")
    hidden, inter, top_k = 2048, 1024, a.experts
    if top_k < 1 or a.layers < 1 or a.sweeps < 1:
        raise SystemExit("--layers, --experts and --sweeps must be at least 1")
    rng = np.random.default_rng(0)
    encoded = {}
    for shape in ((inter, hidden), (hidden, inter)):
        rows, cols = shape
        if a.format == "mxfp4pair":  # 16 bytes of e2m1 pairs and one E8M0 exponent per 32 inputs
            encoded[shape] = (rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8),
                              rng.integers(118, 124, (rows, cols // 32), dtype=np.uint8))
            continue
        if a.format == "q4g32":  # compressed-tensors int4: 16 bytes of nibble pairs, a bfloat16 scale per 32 inputs
            encoded[shape] = (rng.integers(0, 256, (rows, cols // 2), dtype=np.uint8),
                              np.full((rows, cols // 32), 0x3C00, dtype=np.uint16))  # 2^-7
            continue
        if a.format == "fp8":  # e4m3 bytes (no NaN codes), a float32 scale per 128 x 128 block
            data = rng.integers(0, 0x7E, (rows, cols), dtype=np.uint8) | (rng.integers(0, 2, (rows, cols), dtype=np.uint8) << 7)
            encoded[shape] = (data, np.full((-(-rows // 128), -(-cols // 128)), 1e-3, dtype=np.float32))
            continue
        fmt = Int8Row() if a.format == "q8" else Int4GS64()
        t = fmt.encode("w", (rng.standard_normal(shape) * 0.02).astype(np.float32))
        encoded[shape] = (t["w"][1], t["w.qs"][1])

    def placed(shape):
        data, scales = encoded[shape]
        buf = expert_buffer(data.nbytes + scales.nbytes)
        d = buf[: data.nbytes].view(data.dtype).reshape(data.shape)
        s = buf[data.nbytes :].view(scales.dtype).reshape(scales.shape)
        d[...], s[...] = data, scales
        return backend._prepared(QuantTensor(a.format, d, s, shape))

    layers = [[(placed((inter, hidden)), placed((inter, hidden)), placed((hidden, inter))) for _ in range(top_k)]
              for _ in range(a.layers)]
    matrix_bytes = {shape: data.nbytes + scales.nbytes for shape, (data, scales) in encoded.items()}
    nbytes = a.layers * top_k * (2 * matrix_bytes[(inter, hidden)] + matrix_bytes[(hidden, inter)])  # gate, up, down
    passes = -(-(256 << 20) // nbytes)  # a working set that fits a cache is read over and over
    with tempfile.TemporaryDirectory() as tmp:
        read_all = load_loop(Path(tmp))
        raw = huge_buffer(a.read_mib << 20)
        raw[:] = 1
        x = rng.standard_normal((1, hidden)).astype(np.float32)
        out = np.zeros((1, hidden), np.float32)
        weights, rows = np.full(top_k, 1 / top_k, np.float32), np.zeros(top_k, np.int32)
        offsets = np.arange(top_k + 1, dtype=np.int64)
        kernel_rates, load_rates = [], []
        for _ in range(a.sweeps):
            start = time.perf_counter()
            for _ in range(passes):
                for experts in layers:
                    backend.kernels.moe(x, experts, rows, weights, offsets, out)
            kernel_rates.append(passes * nbytes / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            read_all(raw.ctypes.data, raw.nbytes // 8)
            load_rates.append(raw.nbytes / (time.perf_counter() - start) / 1e9)
    ratios = [k / r for k, r in zip(kernel_rates, load_rates)]
    print(f"{a.format}: {a.layers} layers x {top_k} experts, {nbytes / 2**30:.3f} GiB; kernel "
          f"{statistics.median(kernel_rates):.1f} GB/s, load loop {statistics.median(load_rates):.1f} GB/s, "
          f"ratio median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}; "
          f"INT4_PATH {backend.kernels.INT4_PATH}, MXFP4PAIR_PATH {backend.kernels.MXFP4PAIR_PATH})")


if __name__ == "__main__":
    main()
