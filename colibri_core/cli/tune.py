"""``colibri tune``: measure this machine for one model within a time budget and save the
fastest placement options as a profile (colibri_core.cli.profiles), which ``run``,
``chat``, ``serve``, ``eval``, ``atlas`` and ``bench`` then apply by default.

What it measures:

- facts: the model's drive read at colibri's request size (one expert's bytes), with
  O_DIRECT and through the page cache (the file's pages forgotten first); memory
  bandwidth (a copy); the CPU threads this process may use;
- trials: ``--tokens`` tokens decoded after a seeded prompt, each in a fresh process
  (``colibri bench``'s child), the model's pages forgotten before each one (``--cache
  cold``) or not (``warm``), under the configurations: the defaults; ``--direct-io``;
  ``--prefetch`` with the router's top-k slots and with twice that; ``--pin-share`` 0.25
  and 0.75 (when a routing history exists: a first, unmeasured run makes one); fewer
  OpenMP threads (reported as advice: OpenMP reads ``OMP_NUM_THREADS`` when a process
  starts, so a profile cannot set it).

Then, for ``colibri serve``, its ``--slots``: the same model under the chosen placement
serving 1, 2, 4 and 8 concurrent requests (one per slot) in rounds; the profile takes the
fewest slots whose aggregate tokens per second is within ``SLOTS_WITHIN`` of the best
(more slots than that only slow each request down), once two rounds or more are in.

The configurations run in rounds, in a new order each round (so a slow minute of a shared
host falls on all of them), for about 70% of the budget; each one's median decode speed
is compared with the defaults'. Those at least ``GAIN`` faster whose slowest round still
beats the defaults' median are combined (one per dimension), and the combination runs
against the defaults in the time left; the profile takes whichever was faster. The table
also pairs each trial with the defaults' trial of its round (the median of those ratios,
and the rounds won), for the reader: a rule on them was tried and not adopted (an
identical configuration won 6 of 9 rounds by a median 1.045x: docs/benchmarks.md). The
table of every configuration is printed and kept in the profile. Options are placement
only: a profile changes speed, never tokens (the trials' greedy tokens are compared).
"""

from __future__ import annotations

import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

import click

from colibri_core.cli.modelarg import model_option
from colibri_core.cli.run import backend_options
from colibri_core.errors import UsageError

GAIN = 1.03  # an alternative must beat the defaults' median decode speed by 3%
EXPLORE_SHARE = 0.6  # of the budget, for the single changes; then the combination
SLOTS_SHARE = 0.2  # of the budget, last, for serve's slots
SLOTS = (1, 2, 4, 8)
SLOTS_WITHIN = 0.95  # the fewest slots reaching this share of the best aggregate tok/s
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """'5m', '90s', '1.5h', '300' (seconds) -> seconds."""
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"--time {text!r}: give a duration such as 90s, 5m or 1h")
    return float(match.group(1)) * {"s": 1, "m": 60, "h": 3600}[(match.group(2) or "s").lower()]


# -- the machine ---------------------------------------------------------------------------
def read_rates(path: Path, request: int, samples: int = 16) -> dict:
    """Bytes per second reading ``samples`` spread requests of ``request`` bytes from
    ``path``: with O_DIRECT and through the page cache (its pages forgotten first)."""
    from colibri_core.io.drives import read_rate

    out = {}
    for mode in ("direct", "buffered"):
        try:
            out[mode] = read_rate(path, request, samples, direct=mode == "direct")
        except OSError:
            out[mode] = None
    return out


def memory_rate(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Bytes per second a numpy copy moves (read + write), the best of ``repeats``."""
    import numpy as np

    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - started)
    return 2 * nbytes / best


# -- the trials ------------------------------------------------------------------------------
def configurations(top_k: int, cores: int, pin: bool, mirrors: tuple[str, ...] = ()) -> list[tuple[str, str, dict, dict]]:
    """(name, dimension, placement options, environment) of every configuration tried;
    ``mirrors`` (run's --mirror values): reading from them too is one."""
    out = [("defaults", "", {}, {}),
           ("direct I/O", "direct_io", {"direct_io": True}, {}),
           ("prefetch top-k", "prefetch", {"prefetch": True}, {}),
           (f"prefetch {2 * top_k}", "prefetch", {"prefetch": True, "prefetch_slots": 2 * top_k}, {})]
    if pin:
        out += [("pin share 0.25", "pin_share", {"pin_share": 0.25}, {}),
                ("pin share 0.75", "pin_share", {"pin_share": 0.75}, {})]
    if mirrors:
        out.append((f"{len(mirrors)} mirror{'s' if len(mirrors) > 1 else ''}", "mirrors", {"mirrors": list(mirrors)}, {}))
    if cores > 1:
        n = cores // 2
        out.append((f"{n} thread{'s' if n > 1 else ''}", "threads", {}, {"OMP_NUM_THREADS": str(n)}))
    return out


def trial(model_dir: Path, base: dict, options: dict, env: dict, *, tokens: int, prompt_tokens: int, cold: bool,
          history: bool | str = "read") -> dict:
    """One fresh process generating ``tokens`` tokens: its decode speed, hit rate, bytes read, tokens."""
    from colibri_core.cli.bench import drop_page_cache, run_json_child

    if cold:
        drop_page_cache(model_dir)
    spec = {"model": str(model_dir), "options": {**base, **options, "history": history}, "prompt_tokens": prompt_tokens,
            "tokens": tokens, "seed": 0}
    started = time.perf_counter()
    result = run_json_child([sys.executable, "-m", "colibri_core.cli.bench", "colibri", json.dumps(spec)],
                            env={**os.environ, **env}, timeout=3600)
    result["wall_s"] = time.perf_counter() - started
    return result


def slots_trial(model_dir: Path, options: dict, slots: int, *, tokens: int, prompt_tokens: int, cold: bool) -> dict:
    """One fresh process serving ``slots`` concurrent requests through the batched engine:
    their aggregate decode speed."""
    from colibri_core.cli.bench import drop_page_cache, run_json_child

    if cold:
        drop_page_cache(model_dir)
    spec = {"model": str(model_dir), "options": {**options, "history": "read"}, "slots": slots, "tokens": tokens,
            "prompt_tokens": prompt_tokens}
    return run_json_child([sys.executable, "-m", "colibri_core.cli.tune", json.dumps(spec)], timeout=3600)


def _child_slots(spec: dict) -> dict:
    import colibri_core
    from colibri_core.cli.bench import prompt_ids
    from colibri_core.engine.scheduler import Request, Scheduler

    with colibri_core.load(spec["model"], **spec["options"]) as model:
        n = spec["slots"]
        requests = [Request(prompt_ids(model.lm.vocab_size, spec["prompt_tokens"], seed=i), spec["tokens"])
                    for i in range(n)]
        with Scheduler(model, slots=n, max_queue=n) as sched:
            started = time.perf_counter()
            handles = [sched.submit(r) for r in requests]
            for h in handles:
                h.wait()
            elapsed = time.perf_counter() - started
        failed = next((h for h in handles if h.finish_reason == "error"), None)
        if failed is not None:
            raise SystemExit(f"a request failed: {failed.error}")
        generated = sum(len(h.token_ids) for h in handles)
        return {"slots": n, "aggregate_tok_s": generated / elapsed, "request_tok_s": spec["tokens"] / elapsed}


def choose_slots(rows: list[dict]) -> int | None:
    """The fewest slots whose median aggregate speed is within SLOTS_WITHIN of the best."""
    measured = [r for r in rows if r["aggregate_tok_s"]]
    if not measured:
        return None
    best = max(r["aggregate_tok_s"] for r in measured)
    return min(r["slots"] for r in measured if r["aggregate_tok_s"] >= SLOTS_WITHIN * best)


def summarise(name: str, dimension: str, options: dict, env: dict, runs: list[dict], baseline: float | None) -> dict:
    speeds = [r["decode_tok_s"] for r in runs if "error" not in r]
    median = statistics.median(speeds) if speeds else None
    return {"name": name, "dimension": dimension, "options": options, "env": env, "rounds": len(speeds),
            "decode_tok_s": median, "min_tok_s": min(speeds) if speeds else None,
            "max_tok_s": max(speeds) if speeds else None,
            "ratio": median / baseline if median and baseline else None,
            "hit_rate": statistics.median(r["hit_rate"] for r in runs if "error" not in r) if speeds else None,
            "bytes_per_token": statistics.median(r["decode_bytes_per_token"] for r in runs if "error" not in r)
            if speeds else None,
            "errors": [r["error"] for r in runs if "error" in r][:1],
            # every round's speed, in order: a later look can pair rounds (docs/benchmarks.md)
            "runs_tok_s": [round(s, 3) for s in speeds]}


class Tuner:
    """The rounds of ``colibri tune`` for one model: ``run()`` returns the chosen options
    and the table."""

    def __init__(self, model_dir: Path, base: dict, *, budget_s: float, tokens: int, prompt_tokens: int, cold: bool,
                 top_k: int, cores: int, pin: bool, say=lambda text: None, seed: int = 0, mirrors: tuple[str, ...] = ()):
        self.model_dir, self.base, self.budget_s = model_dir, base, budget_s
        self.tokens, self.prompt_tokens, self.cold = tokens, prompt_tokens, cold
        self.configs = configurations(top_k, cores, pin, mirrors)
        self.runs: dict[str, list[dict]] = {c[0]: [] for c in self.configs}
        self.say, self.rng = say, random.Random(seed)
        self.started = time.perf_counter()
        self.round = 0  # every trial is paired with the defaults' trial of its round
        self.tokens_seen: dict[str, list[int]] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def _run(self, config) -> None:
        name, _, options, env = config
        result = trial(self.model_dir, self.base, options, env, tokens=self.tokens, prompt_tokens=self.prompt_tokens,
                       cold=self.cold)
        result["round"] = self.round
        self.runs[name].append(result)
        if "error" in result:
            self.say(f"  {name}: failed: {result['error']}")
        else:
            self.tokens_seen.setdefault(name, result["token_ids"])
            if result["token_ids"] != self.tokens_seen["defaults" if "defaults" in self.tokens_seen else name]:
                raise RuntimeError(f"configuration {name!r} generated other tokens than the defaults: placement "
                                   "changed the model's output (a bug in colibri)")
            self.say(f"  {name}: {result['decode_tok_s']:.2f} tok/s")

    def _rounds(self, configs, until_s: float) -> int:
        """Rounds of ``configs`` (a new order each) while one more fits before ``until_s``
        (at least one)."""
        done, per_round = 0, 0.0
        while done == 0 or self.elapsed() + per_round <= until_s:
            began = time.perf_counter()
            order = list(configs)
            self.rng.shuffle(order)
            for config in order:
                self._run(config)
            done += 1
            self.round += 1
            per_round = time.perf_counter() - began
        return done

    def _table(self) -> tuple[list[dict], dict]:
        """Every configuration's row (with its trials paired with the defaults' of the same
        round: their median ratio and the rounds won), and per dimension the winner: at
        least GAIN faster than the defaults over two rounds or more, each of them faster
        than the defaults' median (one round cannot tell a change from the host's noise)."""
        base = summarise("defaults", "", {}, {}, self.runs["defaults"], None)["decode_tok_s"]
        configs = self.configs + ([self.combined] if self.combined is not None else [])
        rows = [summarise(n, d, o, e, self.runs[n], base) for n, d, o, e in configs]
        defaults = {r["round"]: r["decode_tok_s"] for r in self.runs["defaults"] if "error" not in r}
        for row in rows:
            ratios = [r["decode_tok_s"] / defaults[r["round"]] for r in self.runs[row["name"]]
                      if "error" not in r and r["round"] in defaults]
            row["paired_ratio"] = statistics.median(ratios) if ratios else None
            row["paired_wins"] = sum(x > 1 for x in ratios)
            row["paired_rounds"] = len(ratios)
        winners = {}
        for row in rows[1:]:
            if (row["decode_tok_s"] is None or row["ratio"] is None or row["ratio"] < GAIN or row["rounds"] < 2
                    or row["min_tok_s"] <= base):
                continue
            if row["dimension"] not in winners or row["decode_tok_s"] > winners[row["dimension"]]["decode_tok_s"]:
                winners[row["dimension"]] = row
        return rows, winners

    def run(self) -> tuple[dict, list[dict], dict]:
        placement, rows, notes = self._placement(self.budget_s * (1 - SLOTS_SHARE))
        notes["slots"] = self._slots(placement)
        return placement, rows, notes

    def _slots(self, placement: dict) -> dict:
        """serve's slots under ``placement``: rounds of 1, 2, 4, 8 concurrent requests in
        the time left (at least one)."""
        runs: dict[int, list[float]] = {n: [] for n in SLOTS}
        done, per_round = 0, 0.0
        while done == 0 or self.elapsed() + per_round <= self.budget_s:
            began = time.perf_counter()
            order = list(SLOTS)
            self.rng.shuffle(order)
            for n in order:
                result = slots_trial(self.model_dir, {**self.base, **placement}, n, tokens=self.tokens,
                                     prompt_tokens=self.prompt_tokens, cold=self.cold)
                if "error" in result:
                    self.say(f"  {n} slots: failed: {result['error']}")
                else:
                    runs[n].append(result["aggregate_tok_s"])
                    self.say(f"  {n} slots: {result['aggregate_tok_s']:.2f} tok/s in all")
            done += 1
            per_round = time.perf_counter() - began
        rows = [{"slots": n, "rounds": len(v), "aggregate_tok_s": statistics.median(v) if v else None,
                 "min_tok_s": min(v) if v else None, "max_tok_s": max(v) if v else None} for n, v in runs.items()]
        # one round cannot tell the host's noise from a difference: the profile then leaves --slots alone
        return {"rows": rows, "chosen": choose_slots(rows) if done >= 2 else None, "rounds": done}

    def _placement(self, until_s: float) -> tuple[dict, list[dict], dict]:
        self.combined = None
        rounds = self._rounds(self.configs, until_s * EXPLORE_SHARE)
        rows, winners = self._table()
        singles = {d: w for d, w in winners.items() if d not in ("threads", "combined")}
        notes = {"rounds": rounds, "confirm_rounds": 0, "threads_advice": None}
        if len(singles) > 1:  # combine the winners, then check the combination against the defaults
            options = {k: v for w in singles.values() for k, v in w["options"].items()}
            self.combined = ("combined", "combined", options, {})
            self.runs["combined"] = []
            notes["confirm_rounds"] = self._rounds([self.configs[0], self.combined], until_s)
        elif self._fits_round(until_s):
            notes["rounds"] += self._rounds(self.configs, until_s)
        rows, winners = self._table()
        singles = {d: w for d, w in winners.items() if d not in ("threads", "combined")}
        best = max([*singles.values(), *([winners["combined"]] if "combined" in winners else [])],
                   key=lambda w: w["decode_tok_s"], default=None)
        placement = dict(best["options"]) if best is not None else {}
        if "threads" in winners:
            notes["threads_advice"] = winners["threads"]["env"]["OMP_NUM_THREADS"]
        for row in rows:
            row["chosen"] = best is not None and row["name"] == best["name"]
        return placement, rows, notes

    def _fits_round(self, until_s: float) -> bool:
        per_trial = self.elapsed() / max(1, sum(len(r) for r in self.runs.values()))
        return self.elapsed() + per_trial * len(self.configs) <= until_s


def table(rows: list[dict]):
    from rich.table import Table

    from colibri_core.units import format_bytes

    t = Table(title="colibri tune: decode tok/s per configuration (median of its rounds; paired: the median ratio to "
                    "the defaults' trial of the same round)", title_justify="left")
    for col in ("configuration", "rounds", "tok/s", "range", "vs defaults", "paired", "rounds won", "expert hits",
                "read/token", ""):
        t.add_column(col, justify="left" if col in ("configuration", "") else "right", no_wrap=True)
    for row in rows:
        speed = row["decode_tok_s"]
        t.add_row(row["name"], str(row["rounds"]), f"{speed:.2f}" if speed else "failed",
                  f"{row['min_tok_s']:.2f}-{row['max_tok_s']:.2f}" if speed else "",
                  f"{row['ratio']:.3f}x" if row["ratio"] else "", f"{row['paired_ratio']:.3f}x" if row.get("paired_ratio") else "",
                  f"{row['paired_wins']}/{row['paired_rounds']}" if row.get("paired_rounds") and row["name"] != "defaults"
                  else "", f"{row['hit_rate']:.1%}" if speed else "",
                  format_bytes(row["bytes_per_token"]) if speed else "", "chosen" if row.get("chosen") else "")
    return t


def slots_table(rows: list[dict], chosen: int | None):
    from rich.table import Table

    t = Table(title="colibri serve --slots: tok/s of all requests together (median of its rounds)", title_justify="left")
    for col in ("slots", "rounds", "tok/s in all", "range", ""):
        t.add_column(col, justify="left" if col == "" else "right", no_wrap=True)
    for row in rows:
        speed = row["aggregate_tok_s"]
        t.add_row(str(row["slots"]), str(row["rounds"]), f"{speed:.2f}" if speed else "failed",
                  f"{row['min_tok_s']:.2f}-{row['max_tok_s']:.2f}" if speed else "",
                  "chosen" if row["slots"] == chosen else "")
    return t


@click.command("tune")
@model_option()
@click.option("--time", "duration", default="5m", show_default=True, metavar="DURATION",
              help="How long to measure, e.g. 90s, 5m, 1h (a trial under way finishes).")
@click.option("--ram", default=None, help="RAM budget the profile is tuned for (as colibri run's --ram).")
@click.option("--cap", type=int, default=None, help="At most N experts per MoE layer in each tier (as colibri run's).")
@click.option("--tokens", type=click.IntRange(2, 4096), default=32, show_default=True, help="Tokens decoded per trial.")
@click.option("--prompt-tokens", type=click.IntRange(1, 65536), default=32, show_default=True,
              help="Prompt length of each trial (seeded token ids).")
@click.option("--cache", type=click.Choice(["auto", "cold", "warm"]), default="auto", show_default=True,
              help="Forget the model's pages before each trial (cold) or not (warm); auto: cold when the experts do "
                   "not fit the RAM budget.")
@click.option("--name", default=None, help="The profile's name (default: the model directory's name).")
@click.option("--mirror", "mirrors", multiple=True, metavar="DIR[@BW]",
              help="A read-only copy of the model on another drive (as colibri run's): reading from it too is tried, "
                   "and its drive measured. Repeatable.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (the profile) instead of the table.")
@backend_options
def tune(model_dir, duration, ram, cap, tokens, prompt_tokens, cache, mirrors, name, as_json, backend, vram):
    """Measure this machine for the model in --model (the drive at colibri's request size,
    memory bandwidth, direct I/O, prefetch and its depth, the pinned share of the expert
    budget, threads, the mirrors given), interleaved and repeated within --time, and save
    the fastest placement as a profile that run, chat, serve, eval, atlas and bench apply
    by default."""
    from rich.console import Console

    from colibri_core.cli import profiles
    from colibri_core.engine.api import check_load_options, open_backend
    from colibri_core.model.blueprint import inspect_model
    from colibri_core.units import format_bytes

    err = Console(stderr=True, highlight=False)
    budget_s = parse_duration(duration)
    if name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", name):
        raise UsageError(f"--name {name!r}: letters, digits, '.', '_' and '-' (at most 100), starting with a letter or "
                         "digit")
    check_load_options(cap=cap)
    open_backend(backend, vram)
    path = Path(model_dir)
    from colibri_core.io.drives import MirrorSpec  # numpy: not at import, which the listing commands do

    mirror_specs = [MirrorSpec.parse(m) for m in mirrors]
    for spec in mirror_specs:
        if not spec.path.is_dir():
            raise UsageError(f"--mirror {spec.path}: not a directory")
    bp = inspect_model(path)
    if not bp.moe:
        raise UsageError(f"--model {model_dir}: has no routed experts, so no placement to tune")
    base = {"backend": backend, **({"ram": ram} if ram is not None else {}), **({"cap": cap} if cap is not None else {}),
            **({"vram": vram} if vram is not None else {})}
    started = time.perf_counter()
    say = (lambda text: None) if as_json else (lambda text: err.print(text, markup=False))

    # the machine
    shards = sorted(path.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    request = bp.expert_host_bytes
    rates = read_rates(shards[-1], request)
    memory = memory_rate()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    facts = {"expert_bytes": request, "read_direct_bytes_s": rates["direct"], "read_buffered_bytes_s": rates["buffered"],
             "memory_copy_bytes_s": memory, "cores": cores}
    say(f"colibri tune {path.name}: drive {_rate(rates['direct'])} O_DIRECT, {_rate(rates['buffered'])} buffered at "
        f"{format_bytes(request)} per read; memory copy {_rate(memory)}; {cores} threads")
    if mirror_specs:
        facts["mirrors"] = []
        for spec in mirror_specs:
            copy = spec.path / shards[-1].name
            mirror_rates = read_rates(copy, request) if copy.is_file() else {"direct": None, "buffered": None}
            facts["mirrors"].append({"path": str(spec.path), "read_direct_bytes_s": mirror_rates["direct"],
                                     "read_buffered_bytes_s": mirror_rates["buffered"]})
            say(f"  mirror {spec.path}: " + (f"{_rate(mirror_rates['direct'])} O_DIRECT, {_rate(mirror_rates['buffered'])} "
                                             f"buffered" if copy.is_file() else f"no copy of {shards[-1].name} to measure"))

    # the routing history pinning needs: one unmeasured run makes it when there is none
    from colibri_core.experts.history import FILENAME, cache_path

    pin = any(p.exists() for p in (path / FILENAME, cache_path(path)))
    cold = cache == "cold" or (cache == "auto" and _streams(path, base))
    if not pin:
        say("  no routing history yet: a first run makes one (pinning is tuned from it)")
        first = trial(path, base, {}, {}, tokens=tokens, prompt_tokens=prompt_tokens, cold=cold, history=True)
        if "error" in first:
            raise UsageError(f"--model {model_dir}: the first run failed: {first['error']}")
        pin = True
    say(f"trials: {tokens} tokens after {prompt_tokens} each, page cache {'forgotten (cold)' if cold else 'kept (warm)'}, "
        f"~{duration} in all")
    tuner = Tuner(path, base, budget_s=max(1.0, budget_s - (time.perf_counter() - started)), tokens=tokens,
                  prompt_tokens=prompt_tokens, cold=cold, top_k=bp.top_k, cores=cores, pin=pin, say=say,
                  mirrors=tuple(mirrors))
    placement, rows, notes = tuner.run()
    seconds = time.perf_counter() - started
    chosen = dict(placement)
    if notes["slots"]["chosen"] is not None:
        chosen["slots"] = notes["slots"]["chosen"]
    doc = profiles.new_document(path, chosen, budget={k: v for k, v in base.items() if k != "backend"} | {
        "backend": backend, "cache": "cold" if cold else "warm", "tokens": tokens, "prompt_tokens": prompt_tokens},
        table=rows, facts=facts | notes, seconds=seconds)
    target = profiles.write(doc, name or path.resolve().name)
    if as_json:
        click.echo(json.dumps(doc | {"path": str(target)}))
        return
    out = Console(highlight=False)
    if not out.is_terminal:
        out = Console(highlight=False, width=120)
    out.print(table(rows))
    out.print(slots_table(notes["slots"]["rows"], notes["slots"]["chosen"]))
    advice = f"; fewer threads were faster: OMP_NUM_THREADS={notes['threads_advice']}" if notes["threads_advice"] else ""
    err.print(f"profile {target.stem}: {profiles.describe(chosen)} ({notes['rounds']} rounds"
              + (f" + {notes['confirm_rounds']} of the combination" if notes["confirm_rounds"] else "")
              + f", {seconds:.0f} s of {budget_s:.0f}){advice}; saved "
              f"to {target}; colibri run, chat, serve, eval, atlas and bench apply it (--profile none: without)",
              markup=False)


def _rate(value) -> str:
    from colibri_core.units import format_bytes

    return "n/a" if value is None else f"{format_bytes(value)}/s"


def _streams(path: Path, base: dict) -> bool:
    """Whether the experts do not fit the RAM budget (so they stream: the page cache matters)."""
    from colibri_core.units import parse_size

    total = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    if "ram" not in base:
        return False
    return parse_size(base["ram"]) < total


if __name__ == "__main__":  # a trial of serve's slots (slots_trial): one JSON line
    print(json.dumps(_child_slots(json.loads(sys.argv[1]))))
