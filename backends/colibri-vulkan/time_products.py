"""Time the products' shader variants on this machine's Vulkan device: a 2048 x 2048
matrix-vector product (and 8 tokens) with int4-gs64 and bf16 weights (and int8, float32),
the plain shaders against the variants the device's features choose. Not a test:

    python backends/colibri-vulkan/time_products.py [--n 2048] [--k 2048] [--repeat 20]
    python backends/colibri-vulkan/time_products.py --dispatch   # host cost per dispatch

Each figure is the wall time of ``repeat`` products recorded into one command buffer and
submitted once, divided by ``repeat`` (recording included; one upload of x first).
``--dispatch`` instead times the host's side of one small elementwise dispatch (recording
only: ``ctx.dispatch`` alone and the whole backend operation), with its descriptor set
reused from the cache and written afresh, alternated 6 times; medians."""

from __future__ import annotations

import argparse
import time

import numpy as np

from colibri_core.testing.backend_kit import dequantize, host_form, pack
from colibri_vulkan.backend import VulkanBackend
from colibri_vulkan.device import VulkanContext


def time_product(backend, w, x, repeat: int) -> float:
    xs = backend.asarray(x)
    backend.to_host(backend.linear(xs, w))  # pipeline made, memory warm
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        outs = [backend.linear(xs, w) for _ in range(repeat)]
        backend.to_host(outs[-1])
        best = min(best, (time.perf_counter() - start) / repeat)
    return best


def time_dispatch(n: int = 2000) -> None:
    from colibri_vulkan import device
    from colibri_vulkan.backend import ELTWISE

    backend = VulkanBackend()
    ctx = backend.ctx
    x, y = backend.asarray(np.ones(16, np.float32)), backend.asarray(np.ones(16, np.float32))
    out = backend._new((16,))
    push = device.pack("iifff6i6i6i6iiii", 16, 1 | (1 << 8), 0.0, 0.0, 0.0,  # n, op "+" on 1 dimension, scalars
                       16, *[0] * 5, 1, *[0] * 5, 1, *[0] * 5, 1, *[0] * 5, 0, 0, 0)
    buffers = [out.alloc, x.alloc, y.alloc]
    backend.to_host(backend._eltwise(ELTWISE["+"], out, x, y))
    cached = device.CACHED_SETS
    figures: dict[str, list[float]] = {}
    try:
        for _ in range(6):
            for label, cap in (("reused set", cached), ("set written afresh", 0)):
                device.CACHED_SETS = cap
                if cap == 0:
                    ctx.sets.clear()
                for what, call in (("ctx.dispatch", lambda: ctx.dispatch("eltwise", buffers, push, (1, 1, 1))),
                                   ("backend operation", lambda: backend._eltwise(ELTWISE["+"], out, x, y))):
                    start = time.perf_counter()
                    for _ in range(n):
                        call()
                    figures.setdefault(f"{what}, {label}", []).append((time.perf_counter() - start) / n)
                    backend.to_host(out)
    finally:
        device.CACHED_SETS = cached
    for label, values in figures.items():
        print(f"{label}: {sorted(values)[len(values) // 2] * 1e6:.1f} us per dispatch (median of {len(values)})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--kinds", default="q4,bf16,q8,f32")
    parser.add_argument("--dispatch", action="store_true", help="time the host's cost per dispatch instead")
    args = parser.parse_args()
    if args.dispatch:
        return time_dispatch()
    rng = np.random.default_rng(0)
    w32 = (rng.standard_normal((args.n, args.k)) * 0.05).astype(np.float32)
    contexts = {"plain": VulkanContext(plain=True), "variant": VulkanContext(plain=False)}
    print(f"device: {contexts['variant'].info.describe()}\nfeatures: {contexts['variant'].features.describe()}")
    for tokens in (1, 8):
        x = rng.standard_normal((tokens, args.k)).astype(np.float32)
        for kind in args.kinds.split(","):
            packed = pack(kind, w32) if kind != "f32" else None
            truth = dequantize(packed) if packed is not None else w32
            row = []
            for label, ctx in contexts.items():
                backend = VulkanBackend(context=ctx)
                w = backend.prepare_weight(host_form(backend, packed, "linear") if packed is not None else w32)
                got = backend.to_host(backend.linear(backend.asarray(x), w))
                err = float(np.abs(got - x @ truth.T).max() / np.abs(x @ truth.T).max())
                seconds = time_product(backend, w, x, args.repeat)
                row.append(f"{label} {ctx.product_programs[kind]}: {seconds * 1e3:8.2f} ms (rel. err {err:.1e})")
            print(f"{kind:>5} {args.n}x{args.k}, {tokens} token(s): " + " | ".join(row))


if __name__ == "__main__":
    main()
