"""Routing measured on trained routers: prefetch precision / recall per layer and domain,
and the routing-history A/B (history learned on domain X, tested on X and on Y, against
plain LRU) at two RAM budgets.

    python benchmarks/routing_tables.py --model models/colibri-trained/colibri_trained/olmoe-16x64 \\
        --out benchmarks/results/2026-12-06-routing-trained   # OUT.json and OUT.md

Workload: each domain's held-out text (``heldout/NAME.txt``) is tokenized and cut in two
halves by tokens: the first half teaches the routing histories, the second is the test
text (disjoint, so no history has seen the text it is tested on). The test feeds
``--test-tokens`` of the second half, in windows of ``--window`` tokens spread evenly over
it (a fresh KV cache per window, one store for the run), **one token per forward pass**
(teacher-forced decode): every step is a one-row decode step, what prefetch and the store
serve while generating, while the tokens stay the domain's real text. A tiny model's own
continuation drifts and loops, which flatters every cache; a short free-running decode
(sampled, continuing held-out prompts) is measured beside it for prefetch as a check.

1. Prefetch: colibri's look-ahead (``load(prefetch=True)``: the next MoE layer's norm and
   router applied to the hidden state leaving this layer's attention) is recorded per
   step and MoE layer: precision = predicted experts the layer used / predicted, recall =
   used experts that were predicted / used, as ``StoreStats.prefetch_precision`` counts
   them (the first MoE layer has no predictor). All experts resident (no budget), so the
   predictions alone are measured. With one row and the default slots (= top-k) the
   prediction names top-k experts and the layer uses top-k, so precision equals recall;
   the surest-first order gives the pair for narrower ``--prefetch-slots`` too.
2. History A/B: per budget (``--caps``: experts held per MoE layer, ``load(cap=N)``), a
   cold store per run (fresh load, prefetch off so the counts are deterministic):
   plain LRU (``history=False``) against a history learned on each domain (and on all
   four mixed, the same tokens in all) saved as ``colibri-usage.json`` in a scratch copy
   of the model (links to its files) and loaded with ``history="read"``: the hottest
   experts of the history are pinned at load (``pin_share`` 0.5 of the budget, the
   default), then re-pinned live from what the test itself routes (colibri's default),
   and again with the pins frozen at load (the history alone). Hit rate = lookups served
   by RAM / all lookups; bytes per token = expert bytes read from disk over the test,
   re-pins included, the pinned set's read at load reported apart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import colibri_core  # noqa: E402
from benchmarks.hostinfo import cpu_name  # noqa: E402
from colibri_core.engine.perplexity import HELDOUT_DIR  # noqa: E402
from colibri_core.experts.history import FILENAME as HISTORY_FILE, READ_ONLY_MARKER  # noqa: E402

DEFAULT_MODEL = ROOT / "models/colibri-trained/colibri_trained/olmoe-16x64"
MIXED = "mixed"  # a history learned on all domains, an equal share of each


# -- workload ------------------------------------------------------------------------
def domains_of(model_dir: Path) -> list[str]:
    return sorted(p.stem for p in (Path(model_dir) / HELDOUT_DIR).glob("*.txt"))


def split_heldout(model, model_dir: Path, domains: list[str]) -> dict[str, tuple[list[int], list[int]]]:
    """Per domain (learn, test): the held-out text's tokens cut in two halves."""
    halves = {}
    for d in domains:
        ids = model.encode((Path(model_dir) / HELDOUT_DIR / f"{d}.txt").read_text(encoding="utf-8"))
        halves[d] = (ids[: len(ids) // 2], ids[len(ids) // 2:])
    return halves


def spread_windows(ids: list[int], tokens: int, window: int) -> list[list[int]]:
    """``tokens`` tokens of ``ids`` as windows of ``window`` (the last may be shorter),
    spread evenly over ``ids`` (disjoint when ``ids`` is long enough)."""
    sizes = [window] * (tokens // window) + ([tokens % window] if tokens % window else [])
    if sum(sizes) > len(ids):
        raise SystemExit(f"{tokens} test tokens asked, the test half holds {len(ids)}")
    starts = np.linspace(0, len(ids) - sizes[0], len(sizes)).astype(int) if len(sizes) > 1 else [0]
    return [ids[s : s + n] for s, n in zip(starts, sizes)]


def teacher_forced_decode(model, windows: list[list[int]], recorder=None) -> int:
    """Each window through the model one token per forward pass (a fresh KV cache per
    window): one-row decode steps on the text itself. Returns the steps run."""
    steps = 0
    for win in windows:
        cache = model.lm.new_cache(model.backend)
        if recorder is not None:
            recorder.new_sequence()
        for token in win:
            model.lm.forward(np.asarray([token]), cache, model.backend)
            model.store.after_tokens(1)  # what the generation loop does after a token (re-pinning)
            steps += 1
    return steps


# -- prefetch --------------------------------------------------------------------------
class RoutingRecorder:
    """Scores the prefetcher's predictions per MoE layer, as ``ExpertStore`` scores them
    in ``StoreStats`` (predicted / predicted_used / used), by wrapping this store's
    ``prefetch`` and ``end_layer``; one-row steps only (a prompt's prediction is cut
    short by the slot bound and says nothing of decoding). Also counts how many of a
    layer's experts the same layer used at the step before (what an LRU of top-k slots
    keeps): the look-ahead's baseline."""

    def __init__(self, store, top_k: int):
        layers = len(store.layouts)
        self.top_k = top_k
        self.predicted = np.zeros(layers, np.int64)
        self.predicted_used = np.zeros(layers, np.int64)
        self.used = np.zeros(layers, np.int64)  # used experts of steps that had a prediction
        self.used_by_rank = np.zeros((layers, top_k), np.int64)  # predictions of rank r that were used
        self.predicted_by_rank = np.zeros((layers, top_k), np.int64)
        self.reused = np.zeros(layers, np.int64)  # used experts the layer used at the step before too
        self.reuse_used = np.zeros(layers, np.int64)
        self.steps = np.zeros(layers, np.int64)  # one-row steps seen per layer
        self._prediction: list[list[int] | None] = [None] * layers
        self._previous: list[set[int] | None] = [None] * layers
        prefetch, end_layer = store.prefetch, store.end_layer

        def recording_prefetch(layer, experts, *args, **kwargs):
            self._prediction[layer] = [int(e) for e in experts]  # the last prediction counts, as in the store
            return prefetch(layer, experts, *args, **kwargs)

        def recording_end_layer(layer, indices, experts):
            self._score(layer, np.asarray(indices), experts)
            return end_layer(layer, indices, experts)

        store.prefetch, store.end_layer = recording_prefetch, recording_end_layer

    def new_sequence(self) -> None:
        self._previous = [None] * len(self._previous)

    def _score(self, layer: int, indices: np.ndarray, experts) -> None:
        predicted, self._prediction[layer] = self._prediction[layer], None
        if indices.ndim != 2 or indices.shape[0] != 1:  # a prompt or a batch
            self._previous[layer] = None
            return
        used = {int(e) for e in np.asarray(experts).ravel()}
        self.steps[layer] += 1
        if predicted:
            self.predicted[layer] += len(predicted)
            self.predicted_used[layer] += len(used.intersection(predicted))
            self.used[layer] += len(used)
            for rank, e in enumerate(predicted[: self.top_k]):
                self.predicted_by_rank[layer, rank] += 1
                self.used_by_rank[layer, rank] += e in used
        if self._previous[layer] is not None:
            self.reused[layer] += len(used & self._previous[layer])
            self.reuse_used[layer] += len(used)
        self._previous[layer] = used

    def summary(self) -> dict:
        share = lambda a, b: float(a) / float(b) if b else None  # noqa: E731
        scored = [layer for layer in range(len(self.steps)) if self.predicted[layer]]
        layers = [{"layer": layer, "steps": int(self.steps[layer]), "predicted": int(self.predicted[layer]),
                   "predicted_used": int(self.predicted_used[layer]), "used": int(self.used[layer]),
                   "precision": share(self.predicted_used[layer], self.predicted[layer]),
                   "recall": share(self.predicted_used[layer], self.used[layer]),
                   "reuse_from_previous_token": share(self.reused[layer], self.reuse_used[layer])}
                  for layer in range(len(self.steps))]
        precision = [layers[i]["precision"] for i in scored]
        # the same predictions read narrower: the s surest of each (``--prefetch-slots s``)
        hits_by_rank, by_rank = self.used_by_rank[scored].sum(0), self.predicted_by_rank[scored].sum(0)
        used = int(self.used[scored].sum())
        by_slots = [{"slots": s + 1, "precision": share(hits_by_rank[: s + 1].sum(), by_rank[: s + 1].sum()),
                     "recall": share(hits_by_rank[: s + 1].sum(), used)} for s in range(self.top_k)]
        by_precision = sorted(scored, key=lambda i: layers[i]["precision"])
        worst, best = (by_precision[0], by_precision[-1]) if scored else (None, None)
        return {"precision": share(self.predicted_used.sum(), self.predicted.sum()),
                "recall": share(self.predicted_used.sum(), self.used.sum()),
                "layer_mean_precision": float(np.mean(precision)) if precision else None,
                "layer_min": {"layer": worst, "precision": layers[worst]["precision"]} if scored else None,
                "layer_max": {"layer": best, "precision": layers[best]["precision"]} if scored else None,
                "precision_by_rank": [share(h, n) for h, n in zip(hits_by_rank, by_rank)],
                "by_slots": by_slots,
                "reuse_from_previous_token": share(self.reused.sum(), self.reuse_used.sum()),
                "layers": layers}


def measure_prefetch(model_dir: Path, windows: list[list[int]], *, free_prompts: list[list[int]] = (),
                     free_tokens: int = 0, seed: int = 0) -> dict:
    """Prefetch precision / recall per MoE layer over teacher-forced decode steps, all
    experts resident; with ``free_prompts``, also over ``free_tokens`` sampled tokens
    (temperature 1) after each prompt. Also checks the recorder against the store's own
    counters (``StoreStats``): they must agree."""
    with colibri_core.load(model_dir, prefetch=True, history=False) as model:
        top_k = model.placement.prefetch_slots  # default slots: the router's top-k
        recorder = RoutingRecorder(model.store, top_k)
        steps = teacher_forced_decode(model, windows, recorder)
        stats = model.store.stats
        result = {"steps": steps, **recorder.summary(),
                  "store_counters": {"predicted": stats.predicted, "predicted_used": stats.predicted_used,
                                     "used": stats.used}}
        if free_prompts:
            free = RoutingRecorder(model.store, top_k)
            distinct = []
            for i, prompt in enumerate(free_prompts):
                free.new_sequence()
                out = model.generate(token_ids=prompt, max_tokens=free_tokens, temperature=1.0, seed=seed + i,
                                     ignore_eos=True)
                distinct.append(len(set(out.token_ids)) / max(1, len(out.token_ids)))
            summary = free.summary()
            result["free_decode"] = {"prompts": len(free_prompts), "tokens": free_tokens,
                                     "precision": summary["precision"], "recall": summary["recall"],
                                     "distinct_token_share": float(np.mean(distinct)),
                                     "reuse_from_previous_token": summary["reuse_from_previous_token"]}
    return result


# -- routing history A/B ---------------------------------------------------------------
def scratch_copy(model_dir: Path, into: Path) -> Path:
    """A writable view of a model directory: links to its files, without its read-only
    marker, so a routing history is saved inside it (never in the user's cache)."""
    into.mkdir(parents=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and f.name not in (READ_ONLY_MARKER, HISTORY_FILE):
            (into / f.name).symlink_to(f.resolve())
    return into


def learn_history(model_dir: Path, learn: list[int], into: Path, window: int) -> Path:
    """A scratch copy of the model whose ``colibri-usage.json`` colibri saved after running
    ``learn`` (teacher-forced, in windows): what a user's earlier sessions would leave."""
    copy = scratch_copy(model_dir, into)
    with colibri_core.load(copy, history=True, pin="off") as model:
        for i in range(0, len(learn), window):
            model.logits(learn[i : i + window])
    if not (copy / HISTORY_FILE).is_file():
        raise SystemExit(f"{copy}: colibri saved no routing history")
    return copy


def store_run(model_dir: Path, windows: list[list[int]], *, cap: int, history: bool, repin: bool = True) -> dict:
    """One cold store (fresh load) under ``cap`` experts per MoE layer, prefetch off:
    plain LRU (``history`` False) or pinned by the saved history (re-pinned live unless
    ``repin`` is False). Counts over the teacher-forced decode of ``windows``."""
    with colibri_core.load(model_dir, cap=cap, history="read" if history else False, pin="auto",
                           prefetch=False) as model:
        store = model.store
        if not repin:
            store.pin_policy.interval = sys.maxsize  # the pins chosen at load stay
        loaded_bytes = store.disk.bytes_read  # the pinned set, read at load
        pinned_at_load = sorted(store.ram.pinned_set())
        before = store.stats.snapshot()
        steps = teacher_forced_decode(model, windows)
        after = store.stats.snapshot()
        counted = ("hits_pinned", "hits_lru", "hits_device", "hits_prefetched", "misses", "repins")
        delta = {k: after[k] - before[k] for k in counted}
        hits = delta["hits_pinned"] + delta["hits_lru"] + delta["hits_device"]
        lookups = hits + delta["hits_prefetched"] + delta["misses"]
        test_bytes = store.disk.bytes_read - loaded_bytes
        return {"cap": cap, "tokens": steps, "lookups": lookups, "hits": hits, **delta,
                "hit_rate": hits / lookups if lookups else None,
                "bytes_read": test_bytes, "bytes_per_token": test_bytes / steps if steps else None,
                "pinned_load_bytes": loaded_bytes, "pinned_at_load": [list(p) for p in pinned_at_load],
                "lru_slots": model.placement.slots, "pinned_capacity": model.placement.pinned,
                "expert_bytes": model.placement.expert_bytes, "moe_layers": model.placement.moe_layers}


def compact_row(r: dict) -> dict:
    """A run's row for the report: the pinned set as its size (the pairs themselves, up to
    a few hundred per run, would make the report megabytes)."""
    r = dict(r)
    if isinstance(r.get("pinned_at_load"), list):
        r["pinned_at_load"] = len(r["pinned_at_load"])
    return r


def history_ab(model_dir: Path, halves: dict, test_windows: dict, *, caps: list[int], learn_tokens: int,
               window: int, work: Path, progress=print) -> list[dict]:
    domains = list(halves)
    learned = {}
    for d in domains:
        learned[d] = halves[d][0][:learn_tokens]
    share = learn_tokens // len(domains)  # the mixed history: the same tokens, a quarter of each
    learned[MIXED] = [t for d in domains for t in halves[d][0][:share]]
    copies = {name: learn_history(model_dir, ids, work / name, window) for name, ids in learned.items()}
    rows = []
    for cap in caps:
        for test in domains:
            arms = [(None, True)] + [(name, repin) for name in copies for repin in (True, False)]
            for name, repin in arms:
                r = store_run(copies[name] if name else model_dir, test_windows[test], cap=cap,
                              history=name is not None, repin=repin)
                r.update({"learned_on": name or "none (plain LRU)", "test": test,
                          "pins": "none" if name is None else ("live re-pin" if repin else "frozen at load")})
                rows.append(compact_row(r))
                progress(f"cap {cap:3d} test {test:7s} history {r['learned_on']:17s} {r['pins']:14s} "
                         f"hit {100 * r['hit_rate']:5.1f}%  {r['bytes_per_token'] / 1024:7.1f} KiB/token")
    return rows


# -- report ----------------------------------------------------------------------------
def machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def markdown(report: dict) -> str:
    lines = ["# Routing on trained routers (colibri-trained)", "",
             f"- command: `{report['command']}`",
             f"- machine: {report['machine']} (shared with other work; counts, not timings, so the load does not "
             "matter)",
             f"- date: {report['date']}; cache state irrelevant (counts, not timings; every store run starts cold: a "
             "fresh load)", ""]
    for run in report["models"]:
        lines += model_markdown(run)
    return "\n".join(lines) + "\n"


def model_markdown(report: dict) -> list[str]:
    w = report["workload"]
    lines = [f"## {Path(report['model']).name}", "",
             f"- wall {report['wall_s']:.0f} s; workload: per domain, held-out tokens cut in halves (learn | test; "
             + ", ".join(f"{d} {a}|{b}" for d, (a, b) in w["tokens_per_domain"].items())
             + f"); test = {w['test_tokens']} tokens of the second half in windows of {w['window']} spread over it, "
             f"fed one token per forward pass (teacher-forced decode); histories learned on {w['learn_tokens']} "
             f"tokens of the first half (mixed: {w['learn_tokens'] // len(report['domains'])} of each domain)", ""]
    p = report["prefetch"]
    lines += ["### Prefetch look-ahead, one-row decode steps (all experts resident)", "",
              f"Slots = top-k ({w['top_k']}): precision = recall. `slots 4`: the 4 surest of the same predictions. "
              "`reuse`: share of a layer's experts it used at the previous token too (an LRU of top-k slots). "
              f"`free decode`: {w['free_prompts']} sampled continuations (T=1) of {w['free_tokens']} tokens after "
              "held-out prompts.", "",
              "| domain | steps | precision | recall | layer min | layer max | slots 4: prec / rec | reuse "
              "| free decode prec |",
              "|---|---|---|---|---|---|---|---|---|"]
    for d in report["domains"]:
        r = p[d]
        s4 = next((s for s in r["by_slots"] if s["slots"] == 4), None)
        free = r.get("free_decode")
        lines.append(f"| {d} | {r['steps']} | {pct(r['precision'])} | {pct(r['recall'])} | "
                     f"{pct(r['layer_min']['precision'])} (L{r['layer_min']['layer']}) | "
                     f"{pct(r['layer_max']['precision'])} (L{r['layer_max']['layer']}) | "
                     f"{pct(s4['precision']) if s4 else '-'} / {pct(s4['recall']) if s4 else '-'} | "
                     f"{pct(r['reuse_from_previous_token'])} | {pct(free['precision']) if free else '-'} |")
    lines += ["", "Per MoE layer (precision = recall; layer 0 has no predictor):", "",
              "| MoE layer | " + " | ".join(report["domains"]) + " |", "|---|" + "---|" * len(report["domains"])]
    for layer in range(len(p[report["domains"][0]]["layers"])):
        cells = [pct(p[d]["layers"][layer]["precision"]) for d in report["domains"]]
        if all(c == "-" for c in cells):
            continue
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    rows = report["history_ab"]
    if rows:
        first = rows[0]
        lines += ["", "### Routing history A/B (cold store per run, prefetch off)", "",
                  f"Cell: hit rate / KiB read per token (expert {first['expert_bytes'] / 1024:.0f} KiB, "
                  f"{first['moe_layers']} MoE layers; all misses would read "
                  f"{first['moe_layers'] * w['top_k'] * first['expert_bytes'] / 1024:.0f} KiB/token). "
                  "History rows pin the history's hottest experts at load (half the budget) and read "
                  "them then (`pinned MiB`, not in the per-token figure)."]
        for cap in sorted({r["cap"] for r in rows}):
            mine = [r for r in rows if r["cap"] == cap]
            share = cap / report["experts_per_layer"]
            tests = " | ".join(f"test {d}" for d in report["domains"])
            lines += ["", f"#### cap {cap} of {report['experts_per_layer']} experts per layer ({share:.0%} of "
                      f"routed-expert bytes): LRU slots {mine[0]['lru_slots']}/layer without history", "",
                      f"| history learned on | pins | pinned MiB | {tests} |",
                      "|---|---|---|" + "---|" * len(report["domains"])]
            arms = []
            for r in mine:
                if (r["learned_on"], r["pins"]) not in arms:
                    arms.append((r["learned_on"], r["pins"]))
            for name, pins in arms:
                cells = []
                for d in report["domains"]:
                    r = next(x for x in mine if x["learned_on"] == name and x["pins"] == pins and x["test"] == d)
                    cells.append(f"{pct(r['hit_rate'])} / {r['bytes_per_token'] / 1024:.1f}")
                r0 = next(x for x in mine if x["learned_on"] == name and x["pins"] == pins)
                lines.append(f"| {name} | {pins} | {r0['pinned_load_bytes'] / 2**20:.2f} | " + " | ".join(cells) + " |")
    return lines + [""]


def measure_model(model_dir: Path, args, progress=print) -> dict:
    """Both tables for one model: its prefetch precision / recall, and the history A/B."""
    started = time.time()
    caps = [int(c) for c in args.caps.split(",") if c]
    domains = domains_of(model_dir)
    if not domains:
        raise SystemExit(f"{model_dir} carries no {HELDOUT_DIR}/*.txt")
    with colibri_core.load(model_dir, history=False, prefetch=True) as model:
        halves = split_heldout(model, model_dir, domains)
        experts_per_layer = model.placement.experts_per_layer
        top_k = model.placement.prefetch_slots  # default slots: the router's top-k
    for d, (learn, test) in halves.items():
        if len(learn) < args.learn_tokens:
            raise SystemExit(f"{d}: the learning half holds {len(learn)} tokens, --learn-tokens {args.learn_tokens}")
    windows = {d: spread_windows(halves[d][1], args.test_tokens, args.window) for d in domains}
    prefetch = {}
    for d in domains:
        prompts = [w[: args.window // 4] for w in windows[d][: args.free_prompts]]
        prefetch[d] = r = measure_prefetch(model_dir, windows[d], free_prompts=prompts, free_tokens=args.free_tokens)
        progress(f"{model_dir.name}: prefetch {d:7s} precision {pct(r['precision'])} recall {pct(r['recall'])} "
                 f"layers {pct(r['layer_min']['precision'])}..{pct(r['layer_max']['precision'])} "
                 f"reuse {pct(r['reuse_from_previous_token'])} "
                 f"free decode {pct(r.get('free_decode', {}).get('precision'))}")
    rows = []
    if not args.skip_ab:
        with tempfile.TemporaryDirectory(prefix="colibri-routing-") as work:
            rows = history_ab(model_dir, halves, windows, caps=caps, learn_tokens=args.learn_tokens,
                              window=args.window, work=Path(work), progress=progress)
    return {"model": str(model_dir), "wall_s": time.time() - started, "domains": domains,
            "experts_per_layer": experts_per_layer,
            "workload": {"test_tokens": args.test_tokens, "window": args.window, "learn_tokens": args.learn_tokens,
                         "top_k": top_k, "free_prompts": args.free_prompts, "free_tokens": args.free_tokens,
                         "split": "held-out tokens: first half learns histories, second half tests",
                         "tokens_per_domain": {d: [len(a), len(b)] for d, (a, b) in halves.items()}},
            "prefetch": prefetch, "history_ab": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, action="append", help=f"repeatable (default {DEFAULT_MODEL})")
    parser.add_argument("--out", type=Path, default=None, help="write OUT.json and OUT.md")
    parser.add_argument("--test-tokens", type=int, default=2048, help="test tokens per domain (second half)")
    parser.add_argument("--window", type=int, default=256, help="tokens per sequence (a fresh KV cache each)")
    parser.add_argument("--learn-tokens", type=int, default=4096, help="history tokens per domain (first half)")
    parser.add_argument("--caps", default="16,32", help="RAM budgets: experts held per MoE layer, comma-separated")
    parser.add_argument("--free-prompts", type=int, default=4, help="sampled decodes per domain (0: none)")
    parser.add_argument("--free-tokens", type=int, default=64)
    parser.add_argument("--skip-ab", action="store_true", help="prefetch tables only")
    args = parser.parse_args(argv)
    command = "python benchmarks/routing_tables.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(command, flush=True)
    report = {"command": command, "machine": machine(), "date": datetime.date.today().isoformat(),
              "models": [measure_model(m, args, progress=lambda s: print(s, flush=True))
                         for m in (args.model or [DEFAULT_MODEL])]}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(report))
        print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
