"""Where a backend's decode time goes: cProfile of a few decode steps of a model loaded
with every expert resident (the figures docs/benchmarks.md quotes for MLX's CPU build).

    python benchmarks/backend_profile.py --model /data/olmoe-full-int4 --backend mlx --steps 3
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import numpy as np

import colibri_core


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", type=int, default=18, help="Profile rows to print.")
    args = ap.parse_args()
    with colibri_core.load(args.model, backend=args.backend, history=False, preload=True) as model:
        cache = model.lm.new_cache(model.backend)
        model.lm.forward(np.arange(5, 9), cache, model.backend)  # a short prompt first
        profile = cProfile.Profile()
        profile.enable()
        for i in range(args.steps):
            model.lm.forward(np.array([9 + i]), cache, model.backend)
        profile.disable()
    pstats.Stats(profile).sort_stats("cumtime").print_stats(args.rows)


if __name__ == "__main__":
    main()
