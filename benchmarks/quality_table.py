"""What each weight format costs in quality, on a trained model's held-out text.

    python benchmarks/quality_table.py --model DIR [--out OUT]   # OUT.json and OUT.md

For each format the model is converted with ``colibri convert`` (fp8: rewritten to
DeepSeek's block-scaled e4m3 layout, which convert does not write), then scored beside
the bf16 source on every held-out domain the model carries (``heldout/NAME.txt``) with
``colibri_core.engine.perplexity.compare``: perplexity, its change, KL(source ||
format) per token and top-1 agreement. Run it on colibri-trained's models; random
weights say nothing here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import colibri_core
from colibri_core.cli.convert import HELDOUT_TOKENS, HELDOUT_WINDOW, convert
from colibri_core.engine import perplexity as ppl
from colibri_core.engine.perplexity import HELDOUT_DIR
from colibri_core.io import smallfile

# (label, routed experts, dense linears); "fp8" is a rewrite, not a convert choice
FORMATS = [
    ("bf16 (source)", None, None),
    ("experts int8-row", "int8", "keep"),
    ("experts int4-gs64", "int4", "keep"),
    ("experts mxfp4", "mxfp4", "keep"),
    ("experts + dense fp8-e4m3 (32x32 blocks)", "fp8", None),
    ("dense int8-row", "keep", "int8"),
    ("experts int4 + dense int8", "int4", "int8"),
]
FP8_BLOCK = (32, 32)  # DeepSeek's 128 x 128 would cover whole matrices of a 64-wide model


def variant(src: Path, work: Path, experts: str | None, dense: str | None) -> Path:
    if experts is None:
        return src
    out = work / f"{experts}-{dense}"
    if experts == "fp8":
        from colibri_core.testing.fp8 import fp8_rewrite

        shutil.copytree(src, out)
        fp8_rewrite(FP8_BLOCK)(out)
        return out
    convert(src, out, experts=experts, dense=dense)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    parser.add_argument("--tokens", type=int, default=HELDOUT_TOKENS, help="scored tokens per domain")
    args = parser.parse_args(argv)
    domains = sorted(p.stem for p in (args.model / HELDOUT_DIR).glob("*.txt"))
    if not domains:
        sys.exit(f"error: {args.model} carries no {HELDOUT_DIR}/*.txt to score")
    rows = []
    with tempfile.TemporaryDirectory() as tmp, colibri_core.load(args.model, history=False) as source:
        texts = {d: smallfile.read_text(args.model / HELDOUT_DIR / f"{d}.txt", 64 << 20, "held-out text") for d in domains}
        wins = {d: ppl.windows(source.encode(t), HELDOUT_WINDOW, args.tokens) for d, t in texts.items()}
        for label, experts, dense in FORMATS:
            path = variant(args.model, Path(tmp), experts, dense)
            started = time.time()
            with colibri_core.load(path, history=False) as model:
                size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
                for d in domains:
                    r = ppl.compare(model, source, wins[d]).as_dict()
                    rows.append({"format": label, "domain": d, "bytes": size, **r})
                    print(f"{label:42s} {d:7s} ppl {r['perplexity']:9.3f} ({r['perplexity_delta']:+.3f}) "
                          f"KL {r['kl']:.5f} top-1 {100 * r['top1_agreement']:.2f}%", flush=True)
            print(f"  ({time.time() - started:.1f} s, {size / 2**20:.1f} MiB of weights)", flush=True)
    if args.out:
        args.out.with_suffix(".json").write_text(json.dumps({"model": str(args.model), "rows": rows}, indent=1) + "\n")
        lines = ["| format | weights | " + " | ".join(f"{d}: ppl (delta), KL, top-1" for d in domains) + " |",
                 "|---|---|" + "---|" * len(domains)]
        for label, _, _ in FORMATS:
            mine = {r["domain"]: r for r in rows if r["format"] == label}
            cells = [f"{mine[d]['perplexity']:.2f} ({mine[d]['perplexity_delta']:+.2f}), {mine[d]['kl']:.4f}, "
                     f"{100 * mine[d]['top1_agreement']:.1f}%" for d in domains]
            lines.append(f"| {label} | {mine[domains[0]]['bytes'] / 2**20:.1f} MiB | " + " | ".join(cells) + " |")
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
