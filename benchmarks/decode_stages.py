"""Where a decode step's time goes: each stage of the model timed on the host, per
generated token, with the time the routed experts spent blocked on expert reads apart.

Stages: the token embedding, each layer's token mixer (attention with its norm), the
router, the routed experts (their compute, and apart from it the wait for their reads),
the shared expert or dense MLP, the prefetcher's prediction, and the final norm with the
LM head; what is left of the step (the norms before the MLPs, residual adds, Python)
is "other". Sampling happens between steps and is not part of them.
Prefill is not counted: only steps of one row. The stages are timed by wrapping the
model's blocks in this process, on a backend that computes on the host (``cpu``): a
backend that queues work on a device would charge it to whichever stage waits for it.

When the disk is not saturated (issue #20: "profile where time goes"), this says which
compute the reads do not hide: the stages before the first MoE layer's router and after
the last MoE layer run while no expert read can be in flight.

    python benchmarks/decode_stages.py --model DIR [--ram 4G] [--prefetch] [--direct-io] \
        [--tokens 32] [--prompt-tokens 8] [--cgroup 5G] [--json OUT.json]

With ``--cgroup`` (root) the measuring runs in a fresh child process in a memory cgroup
of that size, after the page cache is dropped, as ``streaming_table.py`` runs colibri.
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


class StageClock:
    """Time per stage over the one-row steps of a generation."""

    def __init__(self, store):
        self.store = store
        self.decoding = False
        self.totals: dict[str, float] = {}
        self.order: list[str] = []
        self.steps: list[float] = []

    def add(self, stage: str, seconds: float) -> None:
        if stage not in self.totals:
            self.totals[stage] = 0.0
            self.order.append(stage)
        self.totals[stage] += seconds

    def timed(self, stage: str, fn, *, reads: bool = False):
        """``fn`` wrapped: its time goes to ``stage`` while decoding (with ``reads``, the
        store's wait for reads inside it goes to "waiting on reads" instead)."""
        def wrapper(*args, **kwargs):
            if not self.decoding:
                return fn(*args, **kwargs)
            waited = self.store.stats.read_wait_ns if reads else 0
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - started
                if reads:
                    wait = (self.store.stats.read_wait_ns - waited) / 1e9
                    self.add("waiting on reads", wait)
                    spent -= wait
                self.add(stage, spent)
        return wrapper


def instrument(model) -> StageClock:
    """Wrap the blocks of ``model`` (a loaded colibri model) with a StageClock."""
    from colibri_core.nn.layers import SparseMoE

    lm = model.lm
    clock = StageClock(model.store)
    lm.embed = clock.timed("embedding", lm.embed)
    for n, layer in enumerate(lm.layers):
        if hasattr(layer, "mix"):
            layer.mix = clock.timed(f"layer {n} mixer", layer.mix)
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, SparseMoE):
            mlp.router = clock.timed("routers", mlp.router)
            mlp.experts = clock.timed("routed experts (compute)", mlp.experts, reads=True)
            if mlp.shared is not None:
                mlp.shared = clock.timed("shared experts", mlp.shared)
        elif mlp is not None:
            layer.mlp = clock.timed("dense MLPs", mlp)
    lm.norm = clock.timed("final norm and LM head", lm.norm)
    lm.lm_head = clock.timed("final norm and LM head", lm.lm_head)
    if lm.prefetcher is not None:
        lm.prefetcher.after_attention = clock.timed("prefetch prediction", lm.prefetcher.after_attention)
    forward = lm.forward

    def timed_forward(ids, cache, ops, **kwargs):
        clock.decoding = len(ids) == 1
        started = time.perf_counter()
        try:
            return forward(ids, cache, ops, **kwargs)
        finally:
            if clock.decoding:
                clock.steps.append(time.perf_counter() - started)
            clock.decoding = False

    lm.forward = timed_forward
    return clock


def profile(spec: dict) -> dict:
    import colibri_core
    from colibri_core.cli.bench import prompt_ids

    with colibri_core.load(spec["model"], **spec["options"]) as model:
        clock = instrument(model)
        ids = prompt_ids(model.lm.vocab_size, spec["prompt_tokens"], spec["seed"])
        result = model.generate(token_ids=ids, max_tokens=spec["tokens"], ignore_eos=True, temperature=1.0,
                                seed=spec["seed"])
        steps = len(clock.steps)
        if not steps:
            raise SystemExit("no decode step ran: ask for --tokens 2 or more")
        total = sum(clock.steps)
        stages = {name: clock.totals[name] for name in clock.order}
        stages["other (norms before the MLPs, residual adds, Python)"] = total - sum(stages.values())
        return {"model": spec["model"], "options": spec["options"], "decode_steps": steps,
                "decode_tok_s": result.stats.decode_tok_s, "step_ms_median": 1e3 * statistics.median(clock.steps),
                "stages_ms_per_token": {k: 1e3 * v / steps for k, v in stages.items()},
                "stages_share": {k: v / total for k, v in stages.items()}, "token_ids": result.token_ids}


def render(data: dict) -> str:
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
            "seed": a.seed}
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
