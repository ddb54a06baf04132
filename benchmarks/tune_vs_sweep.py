#!/usr/bin/env python3
"""How close do ``colibri plan`` and ``colibri tune`` come to the best placement? (issue #47)

For each model and RAM budget: the full grid of the placement options tune chooses among
(``--direct-io`` off/on x ``--prefetch`` off / top-k slots / twice that x ``--pin-share``
0.25 / 0.5 / 0.75: 18 points) measured in fresh processes, in shuffled rounds, each
trial as tune's own (``colibri_core.cli.tune.trial``: colibri bench's run, the page cache
forgotten first when the experts stream); ``colibri plan``'s projected decode speed for
every point (plan models pinning and prefetch, not O_DIRECT: its pick leaves O_DIRECT off;
the drive's bandwidth is measured by the first plan and given to the others, so that
their projections differ by the placement only); and ``colibri tune`` run
for ``--tune-time`` with its own profile directory. Then, by the grid's measured medians:
the best point, the defaults, plan's pick (the point it projects fastest) and tune's
pick, each as a share of the best.

    .venv/bin/python benchmarks/tune_vs_sweep.py --model olmoe:6M --model olmoe:9M \\
        --model deepseek_v3:3.4M --model deepseek_v3:4.4M --rounds 3 --tune-time 2m

A model is ``DIR:RAM`` or ``NAME:RAM`` with NAME a colibri-trained model (olmoe,
deepseek_v3). Writes JSON and Markdown to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.hostinfo import write_record  # noqa: E402
from benchmarks.trace_streaming import git_head, machine  # noqa: E402


def grid(top_k: int) -> list[dict]:
    """Every combination of the options tune chooses among; the defaults first."""
    points = []
    for direct, prefetch, pin in itertools.product((False, True), (0, top_k, 2 * top_k), (0.5, 0.25, 0.75)):
        options = {}
        if direct:
            options["direct_io"] = True
        if prefetch:
            options.update(prefetch=True, prefetch_slots=prefetch)
        if pin != 0.5:
            options["pin_share"] = pin
        points.append(options)
    return points


def label(options: dict) -> str:
    from colibri_core.cli.profiles import describe

    return describe(options)


def key(options: dict) -> str:
    return json.dumps(options, sort_keys=True)


def plan_projection(model: Path, ram: str, options: dict, disk_bw: float | None = None) -> dict:
    args = [sys.executable, "-m", "colibri_core", "plan", "--model", str(model), "--ram", ram, "--json"]
    if disk_bw is not None:
        args += ["--disk-bw", str(int(disk_bw))]
    if options.get("prefetch"):
        args += ["--prefetch", "--prefetch-slots", str(options["prefetch_slots"])]
    if "pin_share" in options:
        args += ["--pin-share", str(options["pin_share"])]
    out = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"colibri plan failed: {out.stderr.strip()}")
    return json.loads(out.stdout)


def run_tune(model: Path, ram: str, duration: str, tokens: int, prompt_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "XDG_CONFIG_HOME": home}
        out = subprocess.run([sys.executable, "-m", "colibri_core", "tune", "--model", str(model), "--ram", ram,
                              "--time", duration, "--tokens", str(tokens), "--prompt-tokens", str(prompt_tokens),
                              "--json"], capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"colibri tune failed: {out.stderr.strip()[-400:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def sweep(model: Path, ram: str, points: list[dict], rounds: int, tokens: int, prompt_tokens: int, cold: bool,
          seed: int) -> dict[str, list[float]]:
    from colibri_core.cli.tune import trial

    rng = random.Random(seed)
    runs: dict[str, list[float]] = {key(p): [] for p in points}
    reference = None
    for r in range(rounds):
        order = list(points)
        rng.shuffle(order)
        for options in order:
            result = trial(model, {"ram": ram}, options, {}, tokens=tokens, prompt_tokens=prompt_tokens, cold=cold)
            if "error" in result:
                raise RuntimeError(f"{label(options)}: {result['error']}")
            reference = reference or result["token_ids"]
            if result["token_ids"] != reference:
                raise RuntimeError(f"{label(options)}: other tokens than the first trial's (placement changed the model)")
            runs[key(options)].append(result["decode_tok_s"])
        print(f"  {model.name} {ram}: round {r + 1} of {rounds} done", file=sys.stderr, flush=True)
    return runs


def resolve_model(text: str) -> tuple[Path, str]:
    name, _, ram = text.rpartition(":")
    if not name or not ram:
        raise SystemExit(f"--model {text!r}: DIR:RAM or NAME:RAM")
    path = Path(name)
    if not path.is_dir():
        import colibri_trained

        path = colibri_trained.path(name)
    return path, ram


def one(model: Path, ram: str, a) -> dict:
    from colibri_core.cli.tune import _streams
    from colibri_core.model.blueprint import inspect_model

    bp = inspect_model(model)
    points = grid(bp.top_k)
    cold = _streams(model, {"ram": ram})
    tuned = run_tune(model, ram, a.tune_time, a.tokens, a.prompt_tokens)
    tune_pick = {k: v for k, v in tuned["options"].items() if k != "slots"}
    first = plan_projection(model, ram, {})
    plans = {}
    for p in points:  # O_DIRECT is not in plan's model: a point projects as the same point without it
        shared = {k: v for k, v in p.items() if k != "direct_io"}
        plans[key(p)] = plans.get(key(shared)) or plan_projection(model, ram, shared, first["disk_bandwidth"])[
            "projected_decode_tok_s"]
    runs = sweep(model, ram, points, a.rounds, a.tokens, a.prompt_tokens, cold, a.seed)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    best_key = max(medians, key=medians.get)
    plan_key = max((k for k in plans if plans[k] is not None and "direct_io" not in json.loads(k)), key=plans.get)
    rows = [{"options": p, "label": label(p), "measured_tok_s": medians[key(p)], "min_tok_s": min(runs[key(p)]),
             "max_tok_s": max(runs[key(p)]), "plan_tok_s": plans[key(p)]} for p in points]
    picks = {"best of the sweep": best_key, "defaults": key({}), "plan's pick": plan_key, "tune's pick": key(tune_pick)}
    return {"model": str(model), "name": model.name, "ram": ram, "cold": cold, "rows": rows,
            "plan_disk_bandwidth": first["disk_bandwidth"],
            "tune": {"options": tuned["options"], "seconds": tuned.get("tuned_s"), "table": tuned.get("table")},
            "picks": {name: {"options": json.loads(k), "label": label(json.loads(k)), "measured_tok_s": medians.get(k),
                             "share_of_best": medians[k] / medians[best_key] if k in medians else None}
                      for name, k in picks.items()}}


def markdown(report: dict) -> str:
    lines = [f"# colibri tune and plan against a full sweep, {report['date']}", "", f"`{report['command']}`", "",
             f"Machine: {report['machine']}; commit {report['commit']}; {report['rounds']} shuffled rounds of the "
             f"18-point grid per model and budget, {report['tokens']} tokens after {report['prompt_tokens']} per "
             "trial, each a fresh process; tune ran first for its own time.", ""]
    for m in report["results"]:
        lines += [f"## {m['name']} at --ram {m['ram']} (page cache {'forgotten' if m['cold'] else 'kept'} per trial)", "",
                  "| pick | placement | measured tok/s (median) | share of the best |", "|---|---|---|---|"]
        for name, p in m["picks"].items():
            share = f"{p['share_of_best']:.3f}" if p["share_of_best"] is not None else "n/a"
            rate = f"{p['measured_tok_s']:.1f}" if p["measured_tok_s"] is not None else "n/a"
            lines.append(f"| {name} | {p['label']} | {rate} | {share} |")
        lines += ["", "| placement | measured tok/s | range | plan's projection |", "|---|---|---|---|"]
        for r in sorted(m["rows"], key=lambda r: -r["measured_tok_s"]):
            plan = f"{r['plan_tok_s']:.1f}" if r["plan_tok_s"] is not None else "n/a"
            lines.append(f"| {r['label']} | {r['measured_tok_s']:.1f} | {r['min_tok_s']:.1f}-{r['max_tok_s']:.1f} | {plan} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, help="DIR:RAM or NAME:RAM (repeatable)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--tune-time", default="2m")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--tag", default="tune-vs-sweep")
    a = ap.parse_args(argv)
    started = time.perf_counter()
    results = [one(*resolve_model(m), a) for m in a.model]
    report = {"date": datetime.date.today().isoformat(), "machine": machine(), "commit": git_head(),
              "command": " ".join(["benchmarks/tune_vs_sweep.py", *(argv or sys.argv[1:])]), "rounds": a.rounds,
              "tokens": a.tokens, "prompt_tokens": a.prompt_tokens, "results": results,
              "seconds": time.perf_counter() - started}
    text = markdown(report)
    write_record(Path(a.out), f"{report['date']}-{a.tag}", report, text + "\n")
    print(text)


if __name__ == "__main__":
    main()
