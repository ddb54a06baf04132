"""``colibri plan`` against ``colibri run``: the projection, then the measurement.

For each RAM budget, ``plan`` projects a run (the prompt length and token count the run
will have) and then ``run`` makes it; both read the routing history that one earlier run
of the same workload recorded, as a user's next session of the same work would. (The
same workload: the demo models have random weights, and each prompt's sampled tokens
settle into their own routing, so a history of another prompt predicts nothing there.
Placement never changes tokens, so the measured run routes exactly as the history says,
in its own order: the projection's assumption of independent draws is what is tested.) The compute kernels
run on one thread in both: on a busy shared machine a multi-threaded kernel call waits
for a descheduled thread at every barrier, which swings single calls by 100x, while one
thread slows in proportion to its share of the CPU, in the plan's measurement and in the
run alike. Each speed is the faster of two fresh processes (``repeats``): the one less
disturbed by other jobs, as a benchmark's minimum over rounds is; hit rates are counts,
the same in both. Used by tests/test_plan_calibration.py and benchmarks/plan_vs_run.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from colibri_core.experts.history import FILENAME

SINGLE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
PROMPT_IDS = [42, 7, 180, 99, 23, 250, 64, 131]


@dataclass
class Comparison:
    slots: int | None  # RAM LRU slots per layer the budget gives (None: the default budget)
    ram: int | None  # bytes, None for the default
    plan_hit_rate: float  # the run's projected hit rate, from empty caches
    steady_hit_rate: float  # projected, once warm
    run_hit_rate: float  # measured
    plan_tok_s: float
    run_tok_s: float


def _colibri(*args, env: dict) -> dict:
    full = {k: v for k, v in os.environ.items() if k != "COLIBRI_DEBUG"}
    full.update(env)
    out = subprocess.run([sys.executable, "-m", "colibri_core", *map(str, args)], capture_output=True, text=True,
                         env=full, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"colibri {' '.join(map(str, args))} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def budget_for_slots(model_dir: Path, slots: int) -> int:
    """The --ram that gives ``slots`` RAM LRU slots per layer (no pinning, no prefetch)."""
    from colibri_core.model.blueprint import inspect_model

    bp = inspect_model(model_dir)
    try:
        return bp.dense_bytes + (slots * len(bp.moe) + max(1, bp.top_k)) * bp.expert_ram_bytes
    finally:
        bp.close()


def compare(model_dir: Path, slots: list[int | None], *, tokens: int = 48, pin: str = "auto",
            env: dict | None = None, repeats: int = 2) -> list[Comparison]:
    """Record the routing history of the workload once, then plan and run it at each budget (``slots``
    per layer; None is the default budget). ``model_dir`` is written to (the history)."""
    env = {**SINGLE_THREAD, **(env or {})}
    (model_dir / FILENAME).unlink(missing_ok=True)
    workload = ["--token-ids", ",".join(map(str, PROMPT_IDS)), "--max-tokens", tokens, "--temperature", "1", "--seed", "0",
                "--ignore-eos", "--json"]
    _colibri("run", "--model", model_dir, *workload, "--history", "save", "--pin", "off", env=env)
    rows = []
    for n in slots:
        ram = budget_for_slots(model_dir, n) if n is not None else None
        budget = ["--ram", ram] if ram is not None else []
        plans, runs = [], []
        for _ in range(repeats):  # interleaved, so a burst of load meets both alike
            plans.append(_colibri("plan", "--model", model_dir, "--prompt-tokens", len(PROMPT_IDS), "--tokens", tokens,
                                  "--pin", pin, "--json", *budget, env=env))
            runs.append(_colibri("run", "--model", model_dir, *workload, "--history", "read", "--pin", pin, *budget,
                                 env=env)["stats"])
        plan, run = plans[0], runs[0]
        rows.append(Comparison(n, ram, plan["projected_hit_rate"], plan["steady_hit_rate"], run["hit_rate"],
                               max(p["projected_decode_tok_s"] for p in plans), max(r["decode_tok_s"] for r in runs)))
    return rows


def markdown(model: str, rows: list[Comparison]) -> str:
    lines = ["| model | RAM slots/layer | plan hit rate (run) | plan hit rate (warm) | run hit rate | plan tok/s | run tok/s |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {model} | {r.slots if r.slots is not None else 'all (default --ram)'} | {r.plan_hit_rate:.1%} | "
                     f"{r.steady_hit_rate:.1%} | {r.run_hit_rate:.1%} | {r.plan_tok_s:.1f} | {r.run_tok_s:.1f} |")
    return "\n".join(lines)
