"""How predictable a synthetic checkpoint's routing is: prefetch precision and recall.

Trained MoEs predict the next layer's experts from the current hidden state with about
75-80% exact match; a synthetic checkpoint should be made to match what a benchmark
claims (``--residual-mix`` of ``synthetic_olmoe.py`` and ``synthetic_frontier.py``).
This runs colibri's own router look-ahead (``--prefetch``) on a short sampled generation
(temperature 1, a few seeded prompt tokens) and reports, over the decode steps only (the
prompt's prefill is one batch, whose prediction the slot bound cuts short):

- precision: predicted experts the next MoE layer used / predicted;
- recall: used experts that were predicted / used (with slots = top-k the two are close);
- expert coverage: distinct experts the generated tokens touched / experts, per layer;
- distinct tokens generated (a looping generation touches few experts).

    python benchmarks/prefetch_calibrate.py measure --model /data/frontier-syn [--model ...]
    # choose --residual-mix: generate small checkpoints at several mixes, measure, delete
    python benchmarks/prefetch_calibrate.py sweep --generator frontier --mixes 0.02,0.3,0.6,1.2 \\
        -- --moe-layers 2 --moe-intermediate 128 --vocab 4096
    # spread routing at a chosen precision (olmoe): the write gain, at the default mix
    python benchmarks/prefetch_calibrate.py sweep --generator olmoe --write-gains 0.5,1,2,4 \\
        -- --hidden 2048 --layers 16 --heads 16 --experts 64 --top-k 8 --intermediate 64 --vocab 4096

Routing predictability depends on the hidden size, the experts and top-k and the mix, not
on the expert intermediate size or the vocabulary (every write is scaled by 1/sqrt(fan-in)),
so a sweep at the full hidden size and expert count with small experts calibrates the full
checkpoint; measure the written full checkpoint once to confirm.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GENERATORS = {"olmoe": HERE / "synthetic_olmoe.py", "frontier": HERE / "synthetic_frontier.py"}


def measure(model: Path, *, tokens: int = 48, prompt_tokens: int = 4, runs: int = 2, seed: int = 0,
            backend: str = "cpu") -> dict:
    """Decode-only prefetch precision / recall (pooled over ``runs`` seeded generations),
    expert coverage and distinct tokens of one checkpoint."""
    import colibri_core
    from colibri_core.cli.bench import measured_generation, prompt_ids

    config = json.loads((model / "config.json").read_text())
    per_run = []
    # history "read": the routing history gives the coverage and is not saved (the
    # checkpoint is left as it was)
    with colibri_core.load(model, prefetch=True, history="read", backend=backend) as m:
        for r in range(runs):
            ids = prompt_ids(m.lm.vocab_size, prompt_tokens, seed + r)
            result, measures = measured_generation(m, ids, tokens, temperature=1.0, seed=seed + r)
            per_run.append({**measures, "token_ids": result.token_ids,
                            "whole_precision": result.stats.prefetch_precision,
                            "whole_recall": result.stats.prefetch_recall})
    precision = [x["decode_prefetch_precision"] for x in per_run if x["decode_prefetch_precision"] is not None]
    recall = [x["decode_prefetch_recall"] for x in per_run if x["decode_prefetch_recall"] is not None]
    coverage = [x["expert_coverage_mean"] for x in per_run if x["expert_coverage_mean"] is not None]
    mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
    return {"model": str(model), "synthetic": config.get("colibri_synthetic"), "tokens": tokens,
            "prompt_tokens": prompt_tokens, "runs": runs, "precision": mean(precision), "recall": mean(recall),
            "expert_coverage_mean": mean(coverage), "distinct_tokens": mean([x["distinct_tokens"] for x in per_run]),
            "per_run": per_run}


def knobs(synthetic: dict | None) -> str:
    """A synthetic checkpoint's predictability knobs (config.json's ``colibri_synthetic``)."""
    if not synthetic:
        return "?"
    text = f"mix {synthetic.get('residual_mix', '?')}"
    return text + (f", write gain {synthetic['write_gain']:g}" if synthetic.get("write_gain") else "")


def _line(r: dict) -> str:
    pct = lambda v: f"{v:6.1%}" if v is not None else "     -"  # noqa: E731
    return (f"{r['model']}: {knobs(r.get('synthetic'))}: precision {pct(r['precision'])}, "
            f"recall {pct(r['recall'])}, expert coverage {pct(r['expert_coverage_mean'])}, "
            f"distinct tokens {r['distinct_tokens']:.0f} / {r['tokens']}")


def cmd_measure(a) -> list[dict]:
    results = []
    for model in a.model:
        if not (model / "config.json").exists():
            raise SystemExit(f"{model}: no config.json (not a model directory)")
        r = measure(model, tokens=a.tokens, prompt_tokens=a.prompt_tokens, runs=a.runs, seed=a.seed, backend=a.backend)
        print(_line(r), file=sys.stderr, flush=True)
        results.append(r)
    return results


def cmd_sweep(a) -> list[dict]:
    generator = GENERATORS[a.generator]
    option, values = ("--write-gain", a.write_gains) if a.write_gains else ("--residual-mix", a.mixes)
    if option == "--write-gain" and a.generator != "olmoe":
        raise SystemExit("--write-gains: only the olmoe generator has --write-gain")
    try:
        values = [float(x) for x in values.split(",")]
    except ValueError:
        raise SystemExit(f"{'--write-gains' if a.write_gains else '--mixes'}: not a comma-separated list of numbers: "
                         f"{values!r}") from None
    results = []
    work = Path(tempfile.mkdtemp(prefix="colibri-calibrate-", dir=a.work_dir))
    try:
        for value in values:
            out = work / f"{option[2:]}-{value:g}"
            cmd = [sys.executable, str(generator), "--out", str(out), option, str(value), *a.generator_args]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{generator.name} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
            r = measure(out, tokens=a.tokens, prompt_tokens=a.prompt_tokens, runs=a.runs, seed=a.seed,
                        backend=a.backend)
            r["model"] = f"{a.generator} {option[2:].replace('-', ' ')} {value:g}"
            print(_line(r), file=sys.stderr, flush=True)
            results.append(r)
            shutil.rmtree(out, ignore_errors=True)  # one checkpoint on disk at a time
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("measure", "sweep"):
        s = sub.add_parser(name)
        s.add_argument("--tokens", type=int, default=48, help="tokens generated per run (temperature 1)")
        s.add_argument("--prompt-tokens", type=int, default=4)
        s.add_argument("--runs", type=int, default=2, help="seeded generations pooled")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--backend", default="cpu")
        s.add_argument("--json", type=Path, default=None, help="also write the results here")
        if name == "measure":
            s.add_argument("--model", type=Path, action="append", required=True)
        else:
            s.add_argument("--generator", choices=sorted(GENERATORS), required=True)
            knob = s.add_mutually_exclusive_group(required=True)
            knob.add_argument("--mixes", help="comma-separated --residual-mix values")
            knob.add_argument("--write-gains", help="comma-separated --write-gain values (olmoe; the mix comes "
                                                    "from the generator options, default 0.02)")
            s.add_argument("--work-dir", default=None, help="where the checkpoints are written (one at a time)")
            s.add_argument("generator_args", nargs="*", help="after --: the generator's geometry options")
    a = p.parse_args(argv)
    for name in ("tokens", "prompt_tokens", "runs"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    results = cmd_measure(a) if a.command == "measure" else cmd_sweep(a)
    if a.json:
        tmp = a.json.with_name(f".{a.json.name}.tmp")
        tmp.write_text(json.dumps(results, indent=1))
        tmp.replace(a.json)
    print(json.dumps([{k: v for k, v in r.items() if k != "per_run"} for r in results], indent=1))


if __name__ == "__main__":
    main()
