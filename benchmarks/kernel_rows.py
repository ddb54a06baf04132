"""The AVX2 int8 and int4 row kernels alone, one core, one x row of 2048 inputs, by the
weight's size: from 64 rows (in L1/L2) to 32768 (in memory), best of 5, GB/s of weight
bytes. A small C program that includes ``_kernels.c`` (compiled here with ``cc -O3``
and linked with libpython, whose API the module's code references) calls the row
functions directly, without the threads, the Python call or the ``moe`` kernel
around them: what the kernel computes when the weight is in cache, and what one core
streams from memory. ``--hint`` compiles the kernels with another software-prefetch
locality (``PREFETCH_HINT``: nta is what colibri builds with); ``--kernels`` takes
another build's source (e.g. ``git show REV:colibri_core/compute/cpu/_kernels.c``).

    python benchmarks/kernel_rows.py [--hint nta|t0|t1|t2] [--gb 4] [--kernels FILE]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "colibri_core" / "compute" / "cpu" / "_kernels.c"
HINTS = {"nta": 0, "t2": 1, "t1": 2, "t0": 3}  # __builtin_prefetch's locality argument

HARNESS = r"""
#include KERNELS
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    const double total = argc > 1 ? atof(argv[1]) * 1e9 : 4e9;  /* bytes read per size */
    const int64_t K = 2048, sizes[] = {64, 256, 1024, 4096, 32768};
    use_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (!use_avx2) { puts("no AVX2 here: nothing to measure"); return 0; }
    float *x = malloc(sizeof(float) * K), *out = calloc(32768, sizeof(float));
    for (int k = 0; k < K; k++) x[k] = (float)((k * 7919) % 200 - 100) / 100.f;
    for (int kind = 0; kind < 2; kind++)
        for (int i = 0; i < 5; i++) {
            const int64_t N = sizes[i];
            const size_t nbytes = kind == 0 ? (size_t)(N * K) : (size_t)(N * K / 2);
            Weight W = {0};
            W.N = N; W.K = K; W.kind = kind == 0 ? K_Q8 : K_Q4;
            uint8_t *d = aligned_alloc(64, nbytes);
            for (size_t b = 0; b < nbytes; b++) d[b] = (uint8_t)(b * 31);
            if (kind == 0) {
                float *s = malloc(sizeof(float) * N);
                for (int64_t n = 0; n < N; n++) s[n] = 0.01f;
                W.scales = s;
            } else {  /* bfloat16 scales, as colibri's int4 containers store them */
                uint16_t *s = malloc(2 * (size_t)(N * K / 64));
                for (int64_t g = 0; g < N * K / 64; g++) s[g] = 0x3C00;
                W.scales = s; W.bf16_scales = 1;
            }
            W.data = d;
            QuantX X;
            if (quantize_x(x, 1, K, wants_qx(&W), 0, &X)) return 1;
            const int64_t reps = (int64_t)(total / 5 / nbytes) + 1;
            double best = 1e30;
            for (int t = 0; t < 5; t++) {
                const double t0 = now();
                for (int64_t r = 0; r < reps; r++) {
                    if (kind == 0) rows_q8i_avx2(&W, &X, x, 1, out, N, 0, N);
                    else rows_q4_avx2(&W, &X, 1, out, N, 0, N);
                }
                const double dt = (now() - t0) / reps;
                if (dt < best) best = dt;
            }
            printf("%s %6ld rows, %8.3f MiB: %.1f GB/s\n", kind == 0 ? "int8" : "int4", (long)N, nbytes / 1048576.0,
                   nbytes / best / 1e9);
            quantx_free(&X); free(d); free((void *)W.scales);
        }
    return 0;
}
"""


def python_link() -> list[str]:
    """The linker flags for libpython (the harness references the module's Python C API,
    which it never calls)."""
    libdir, version = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDVERSION")
    return [f"-L{libdir}", f"-lpython{version}", f"-Wl,-rpath,{libdir}"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hint", choices=sorted(HINTS), default="nta", help="the software prefetch's locality")
    p.add_argument("--gb", type=float, default=4.0, help="weight bytes read per size (GB)")
    p.add_argument("--kernels", type=Path, default=KERNELS, help="the _kernels.c to measure (default: this tree's; a source without "
                                                                  "PREFETCH_HINT keeps its own hint)")
    a = p.parse_args(argv)
    if a.gb <= 0:
        raise SystemExit("--gb must be positive")
    if not a.kernels.is_file():
        raise SystemExit(f"--kernels: {a.kernels} is not a file")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("kernel_rows.py needs a C compiler (cc)")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "rows.c", Path(tmp) / "rows"
        src.write_text(HARNESS)
        build = [cc, "-O3", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
                 f"-DKERNELS=\"{a.kernels.resolve()}\"", f"-DPREFETCH_HINT={HINTS[a.hint]}",
                 f"-I{sysconfig.get_paths()['include']}", str(src), "-o", str(exe), "-lm", *python_link()]
        done = subprocess.run(build, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"kernel_rows.py: compiling the harness failed: {done.stderr.strip().splitlines()[-1:]}")
        print(f"prefetch hint {a.hint} (PREFETCH_HINT={HINTS[a.hint]}), one core:", flush=True)
        return subprocess.run([str(exe), str(a.gb)]).returncode


if __name__ == "__main__":
    sys.exit(main())
