"""Where a decode step's time goes: the engine's own stage clock (colibri_core.nn.stages,
what serve's profiling page shows per turn) summed over the one-row steps of a generation,
per generated token, with the time the routed experts spent blocked on expert reads apart.

Stages: the token embedding, the token mixers (attention with its norm), the routers
(with the norm before them), the routed experts (their compute, and apart from it the wait
for their reads), the shared experts or dense MLPs, the prefetcher's prediction, and the
final norm with the LM head; "other" is the rest of the step (residual adds, Python).
Sampling happens between steps and is not part of them. Prefill is not counted: only
steps of one row. On a backend that queues work on a device a stage's time is where the
host waited for it (``Backend.deferred``): run this on ``cpu``.

When the disk is not saturated (issue #20: "profile where time goes"), this says which
compute the reads do not hide: the stages before the first MoE layer's router and after
the last MoE layer run while no expert read can be in flight.

    python benchmarks/decode_stages.py --model DIR [--ram 4G] [--prefetch] [--direct-io] \
        [--tokens 32] [--prompt-tokens 8] [--cgroup 5G] [--json OUT.json] [--overhead ROUNDS]

With ``--cgroup`` (root) the measuring runs in a fresh child process in a memory cgroup
of that size, after the page cache is dropped, as ``streaming_table.py`` runs colibri.
``--overhead ROUNDS`` measures what the clock costs instead: ROUNDS generations whose
one-row steps alternate between running with the clock and without (every other step,
the first one's state alternating by round), so drift and noise fall on both alike; the
median step time of each and their ratio (issue #50: "overhead measured and stated"),
beside the same ratio from as many rounds in which neither arm has the clock (A/A: the
noise floor the A/B ratio is read against).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere


def clocked(model, clock, steps: list[float], plain: list[float] | None = None) -> None:
    """``model``'s one-row forward passes run with ``clock``, their times appended to
    ``steps``; with ``plain``, every other one runs without it, its time appended there
    (``lm.forward.turn``: [steps so far, whether the clocked arm runs without it too])."""
    lm = model.lm
    forward = lm.forward
    turn = [0, False]

    def timed_forward(ids, cache, ops, **kwargs):
        if len(ids) != 1:
            return forward(ids, cache, ops, **kwargs)
        turn[0] += 1
        off = plain is not None and turn[0] % 2 == 0
        bare = off or turn[1]
        started = time.perf_counter()
        if not bare:
            clock.start()
        try:
            return forward(ids, cache, ops, **kwargs) if bare else forward(ids, cache, ops, clock=clock, **kwargs)
        finally:
            (plain if off else steps).append(time.perf_counter() - started)

    timed_forward.turn = turn
    lm.forward = timed_forward


def profile(spec: dict) -> dict:
    import colibri_core
    from colibri_core.cli.bench import prompt_ids
    from colibri_core.nn.stages import StageClock

    with colibri_core.load(spec["model"], **spec["options"]) as model:
        clock, steps, plain = StageClock(), [], [] if spec.get("overhead") else None
        ids = prompt_ids(model.lm.vocab_size, spec["prompt_tokens"], spec["seed"])

        def generate():
            return model.generate(token_ids=ids, max_tokens=spec["tokens"], ignore_eos=True, temperature=1.0,
                                  seed=spec["seed"])

        if plain is not None:
            reference = generate().token_ids  # no clock at all: the tokens the alternating runs must give
            clocked(model, clock, steps, plain)
            return overhead(generate, model.lm.forward.turn, steps, plain, reference, spec)
        clocked(model, clock, steps)
        result = generate()
        if not steps:
            raise SystemExit("no decode step ran: ask for --tokens 2 or more")
        total = sum(steps)
        stages = clock.seconds()
        stages["other"] += total - sum(stages.values())  # between the last lap and the step's end
        n = len(steps)
        return {"model": spec["model"], "options": spec["options"], "decode_steps": n,
                "decode_tok_s": result.stats.decode_tok_s, "step_ms_median": 1e3 * statistics.median(steps),
                "stages_ms_per_token": {k: 1e3 * v / n for k, v in stages.items()},
                "stages_share": {k: v / total for k, v in stages.items()}, "token_ids": result.token_ids}


def overhead(generate, turn: list[int], on: list[float], off: list[float], reference: list[int], spec: dict) -> dict:
    """Generations whose steps alternate with and without the clock, then as many whose
    steps alternate between two arms without it (A/A)."""
    ratios = {}
    for arm in ("clock", "none"):
        on.clear()
        off.clear()
        turn[1] = arm == "none"
        for r in range(spec["overhead"]):
            turn[0] = r % 2  # which state a round's first step takes alternates
            if generate().token_ids != reference:
                raise SystemExit("the clock changed the tokens: a bug")
        ratios[arm] = (1e3 * statistics.median(on), 1e3 * statistics.median(off), len(on), len(off))
    on_ms, off_ms, n_on, n_off = ratios["clock"]
    return {"model": spec["model"], "options": spec["options"], "rounds": spec["overhead"], "tokens": spec["tokens"],
            "steps_on": n_on, "steps_off": n_off, "median_step_ms_on": on_ms, "median_step_ms_off": off_ms,
            "ratio_tok_s_on_to_off": off_ms / on_ms, "aa_ratio": ratios["none"][1] / ratios["none"][0]}


def render(data: dict) -> str:
    if "ratio_tok_s_on_to_off" in data:
        return (f"{data['model']}: {data['rounds']} generations of {data['tokens']} tokens, steps alternating; median "
                f"decode step with the stage clock {data['median_step_ms_on']:.3f} ms ({data['steps_on']} steps), "
                f"without {data['median_step_ms_off']:.3f} ms ({data['steps_off']}): tokens/s "
                f"{data['ratio_tok_s_on_to_off']:.4f}x (A/A, neither arm clocked: {data['aa_ratio']:.4f}x); "
                f"options {json.dumps(data['options'])}")
    lines = [f"{data['model']}: {data['decode_steps']} decode steps, {data['decode_tok_s']:.2f} tok/s, "
             f"median step {data['step_ms_median']:.1f} ms; options {json.dumps(data['options'])}", "",
             "| stage | ms per token | share |", "|---|---|---|"]
    for name, ms in data["stages_ms_per_token"].items():
        lines.append(f"| {name} | {ms:.1f} | {100 * data['stages_share'][name]:.1f}% |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--ram", default=None, help="colibri's --ram")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--prefetch-window", default=None)
    p.add_argument("--direct-io", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cgroup", default=None, help="memory cgroup size for a fresh child process (root)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--overhead", type=int, default=0, metavar="ROUNDS",
                   help="measure the clock's cost: ROUNDS generations, steps alternating with and without it")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        print(json.dumps(profile(json.loads(a.child))))
        return 0
    if a.tokens < 2:
        p.error("--tokens: at least 2 (the first token comes from the prompt's prefill)")
    options = {"history": "read", "prefetch": a.prefetch, "direct_io": a.direct_io, "backend": "cpu"}
    for key in ("ram", "prefetch_window"):
        if getattr(a, key) is not None:
            options[key] = getattr(a, key)
    spec = {"model": str(a.model), "options": options, "tokens": a.tokens, "prompt_tokens": a.prompt_tokens,
            "seed": a.seed, "overhead": a.overhead}
    from colibri_core.errors import ColibriError

    try:
        if a.cgroup is None:
            data = profile(spec)
        else:
            from colibri_core.cli.bench import drop_page_cache, run_json_child
            from colibri_core.units import parse_size

            data = {"cache": drop_page_cache(a.model),
                    **run_json_child([sys.executable, str(Path(__file__).resolve()), "--model", str(a.model),
                                      "--child", json.dumps(spec)], cgroup=parse_size(a.cgroup))}
    except ColibriError as exc:  # a bad model or option, no writable memory cgroup for --cgroup
        raise SystemExit(f"error: {exc}") from None
    if "error" in data:
        raise SystemExit(f"error: the measuring child failed: {data['error']}")
    print(render(data))
    if a.json is not None:
        tmp = a.json.with_name(f".{a.json.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
