"""``colibri plan`` beside ``colibri run`` on the demo model and a smaller one, at several
RAM budgets (the table in docs/cli.md). Builds both models under DIR.

    python benchmarks/plan_vs_run.py --dir /tmp/plan-vs-run
"""

from __future__ import annotations

import argparse
from pathlib import Path

from colibri_core.cli.demo import DEFAULT_SPEC, DemoSpec, ensure_demo_model
from colibri_core.testing.calibration import compare, markdown

SMALL = DemoSpec(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_experts=32, num_experts_per_tok=4,
                 intermediate_size=256, tokenizer_vocab=512, shard_bytes=64 << 20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args()
    root = Path(args.dir)
    for name, spec, slots in (("demo", DEFAULT_SPEC, [8, 16, 32, None]), ("small", SMALL, [4, 8, 16, None])):
        model = ensure_demo_model(root / name, spec)
        print(markdown(name, compare(model, slots, tokens=args.tokens, pin="on")))


if __name__ == "__main__":
    main()
