"""Trace-driven streaming at full size (issue #44, item 5): a trained router's routing
drives the full-size OLMoE-shaped checkpoint's expert store, cold, in a memory cgroup,
beside the disk's bound and llama.cpp.

The synthetic checkpoints route by a knob (``synthetic_olmoe.py --write-gain``), which
approximates how a trained router spreads tokens and how predictable it is. Here the
routing comes from a trained model instead: colibri-trained's OLMoE-geometry model (16
layers x 64 experts, top-8: the routing geometry of OLMoE-1B-7B, small widths).

``record``: the trained model runs teacher-forced over each domain's held-out text
(``heldout/NAME.txt``, from the start of its second half: routing_tables.py's test half),
one token per forward pass, prefetch on; per step and MoE layer it records the router's
top-8 expert ids and weights, and the experts colibri's look-ahead predicted for that
layer (what ``ExpertStore.prefetch`` was asked for, surest first). One ``NAME.npz`` per
domain, with its manifest (model hash, domain, token count, the trace's own statistics)
inside and in ``manifest.json``.

``replay``: per round, in a rotated order, each in a fresh process after the page cache
is dropped, all in one memory cgroup (``--cgroup``):

1. the disk bound: ``streaming_table.disk_bound`` (cold O_DIRECT reads of the
   checkpoint's expert spans by colibri's I/O pool's thread count), in this run;
2. colibri on the full-size checkpoint, loaded as a user runs it (``--ram``, prefetch,
   O_DIRECT, routing history read-only), with each MoE layer's router replaced by the
   trace (the trace's ids and weights for the step's rows), and the look-ahead's router
   by the trace's recorded predictions: what the store is asked for is what the trained
   model routed and predicted; the experts' computation is real. The prompt is the
   trace's first ``--prompt-tokens`` tokens (one batch, as a user's prompt), then
   ``--tokens`` decode steps follow the trace one token each;
3. colibri on the same checkpoint with its synthetic router's own routing (no trace):
   ``colibri bench``'s seeded random prompt, temperature 1, as streaming_table.py;
4. llama.cpp on the checkpoint's GGUF (``--gguf``) with **its own (synthetic) routing**:
   it cannot follow a trace. ``streaming_table.run_llama``'s child, mmap, repacking off.

All colibri runs use a scratch view of the checkpoint (links to its files) without its
``colibri-usage.json``: a history saved by earlier runs of the synthetic router would pin
that router's hot experts, which favours the synthetic row and misleads the trace rows.
So every run is a first session: nothing pinned at load.

    python benchmarks/trace_streaming.py record --out /work/trace-streaming/traces --tokens 512
    python benchmarks/trace_streaming.py replay --model /work/models/olmoe-r75-q4q4 \\
        --traces /work/trace-streaming/traces --domains python,prose --gguf /work/models/olmoe-r75-q4_0.gguf \\
        --llama-python /work/llama-venv/bin/python --cgroup 3G --ram 2.5G --prompt-tokens 32 --tokens 64 \\
        --rounds 2 --out benchmarks/results/2026-12-06-trace-streaming
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from benchmarks.hostinfo import cpu_name  # noqa: E402

DEFAULT_TRAINED = ROOT / "models/colibri-trained/colibri_trained/olmoe-16x64"
HELDOUT_DIR = "heldout"
NO_PREDICTION = -1  # a layer without a predictor (the first MoE layer)


# -- traces ----------------------------------------------------------------------------
def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def moe_blocks(lm) -> list:
    """The model's sparse MoE blocks (``SparseMoE``), in layer order."""
    from colibri_core.nn.layers import SparseMoE

    return [layer.mlp for layer in lm.layers if isinstance(getattr(layer, "mlp", None), SparseMoE)]


class Trace:
    """One domain's routing: per step (token) and MoE layer, the router's top-k expert ids
    and weights, and the look-ahead's predicted experts (surest first; ``NO_PREDICTION``
    where the layer has no predictor)."""

    def __init__(self, tokens, experts, weights, predicted, manifest: dict):
        self.tokens = np.asarray(tokens, np.int32)
        self.experts = np.asarray(experts, np.int16)  # (steps, moe layers, top_k)
        self.weights = np.asarray(weights, np.float16)
        self.predicted = np.asarray(predicted, np.int16)  # (steps, moe layers, slots)
        self.manifest = manifest

    @property
    def steps(self) -> int:
        return len(self.tokens)

    def save(self, path: Path) -> None:
        np.savez_compressed(path, tokens=self.tokens, experts=self.experts, weights=self.weights,
                            predicted=self.predicted, manifest=np.array(json.dumps(self.manifest)))

    @classmethod
    def load(cls, path: Path) -> "Trace":
        with np.load(path) as f:
            return cls(f["tokens"], f["experts"], f["weights"], f["predicted"], json.loads(str(f["manifest"])))


def trace_statistics(experts: np.ndarray, predicted: np.ndarray) -> dict:
    """What the routing itself says, before any store: the look-ahead's precision over the
    layers that have a predictor, the share of a layer's experts it also used at the step
    before (what an LRU of top-k slots keeps), and the distinct experts per layer."""
    steps, layers, k = experts.shape
    used = [[set(map(int, experts[t, layer])) for layer in range(layers)] for t in range(steps)]
    hit = total = 0
    for t in range(steps):
        for layer in range(layers):
            guess = [int(e) for e in predicted[t, layer] if e != NO_PREDICTION]
            if guess:
                hit += len(used[t][layer].intersection(guess))
                total += len(guess)
    reused = sum(len(used[t][layer] & used[t - 1][layer]) for t in range(1, steps) for layer in range(layers))
    distinct = [len(np.unique(experts[:, layer])) for layer in range(layers)]
    return {"lookahead_precision": hit / total if total else None,
            "reuse_from_previous_token": reused / ((steps - 1) * layers * k) if steps > 1 else None,
            "distinct_experts_per_layer_mean": float(np.mean(distinct)),
            "distinct_experts_per_layer_min": min(distinct)}


def record_trace(model, ids: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``ids`` through ``model`` one token per forward pass (a fresh KV cache): per step the
    routers' (ids, weights) and the look-ahead's predictions, as arrays."""
    blocks = moe_blocks(model.lm)
    store = model.store
    layers, k = len(blocks), blocks[0].router.top_k
    slots = model.placement.prefetch_slots
    experts = np.zeros((len(ids), layers, k), np.int16)
    weights = np.zeros((len(ids), layers, k), np.float16)
    predicted = np.full((len(ids), layers, slots), NO_PREDICTION, np.int16)
    step = [0]
    originals = [b.router for b in blocks]

    class Recording:
        def __init__(self, inner, layer):
            self.inner, self.layer = inner, layer

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __call__(self, x, s):
            indices, w = self.inner(x, s)
            experts[step[0], self.layer] = indices[0]
            weights[step[0], self.layer] = w[0]
            return indices, w

    prefetch = store.prefetch

    def recording_prefetch(layer, chosen, *args, **kwargs):
        chosen = [int(e) for e in chosen]
        predicted[step[0], layer, : len(chosen)] = chosen  # the last prediction of a step counts, as in the store
        return prefetch(layer, chosen, *args, **kwargs)

    for i, b in enumerate(blocks):
        b.router = Recording(b.router, i)
    store.prefetch = recording_prefetch
    try:
        cache = model.lm.new_cache(model.backend)
        for t, token in enumerate(ids):
            step[0] = t
            model.lm.forward(np.asarray([token]), cache, model.backend)
            model.store.after_tokens(1)
    finally:
        for b, r in zip(blocks, originals):
            b.router = r
        store.prefetch = prefetch
    return experts, weights, predicted


def cmd_record(a) -> None:
    import colibri_core

    model_dir = a.model.resolve()
    model_sha = sha256_of(model_dir / "model.safetensors")
    training = model_dir / "training.json"
    trained_sha = json.loads(training.read_text()).get("weights_sha256") if training.exists() else None
    a.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/trace_streaming.py record " + " ".join(sys.argv[2:])
    summary = {"command": command, "date": datetime.date.today().isoformat(), "model": str(model_dir),
               "model_sha256": model_sha, "training_weights_sha256": trained_sha, "domains": {}}
    with colibri_core.load(model_dir, prefetch=True, history=False) as model:
        blocks = moe_blocks(model.lm)
        geometry = {"moe_layers": len(blocks), "experts": model.placement.experts_per_layer,
                    "top_k": blocks[0].router.top_k, "prefetch_slots": model.placement.prefetch_slots}
        for domain in a.domains:
            text_path = model_dir / HELDOUT_DIR / f"{domain}.txt"
            ids = model.encode(text_path.read_text(encoding="utf-8"))
            start = len(ids) // 2  # the second half: routing_tables.py's test half
            chosen = ids[start : start + a.tokens]
            if len(chosen) < a.tokens:
                raise SystemExit(f"{domain}: the second half of {text_path} holds {len(ids) - start} tokens, "
                                 f"--tokens {a.tokens}")
            started = time.perf_counter()
            experts, weights, predicted = record_trace(model, chosen)
            manifest = {"model": str(model_dir), "model_sha256": model_sha, "training_weights_sha256": trained_sha,
                        "domain": domain, "tokens": len(chosen), "heldout_file": str(text_path),
                        "heldout_sha256": sha256_of(text_path), "token_offset": start, **geometry,
                        "teacher_forced": "one token per forward pass, a fresh KV cache at the offset",
                        "statistics": trace_statistics(experts, predicted), "command": command}
            path = a.out / f"{domain}.npz"
            Trace(chosen, experts, weights, predicted, manifest).save(path)
            manifest["file"], manifest["file_sha256"] = str(path), sha256_of(path)
            summary["domains"][domain] = manifest
            st = manifest["statistics"]
            print(f"{domain}: {len(chosen)} tokens in {time.perf_counter() - started:.1f} s -> {path} "
                  f"({path.stat().st_size / 1024:.0f} KiB); look-ahead precision {st['lookahead_precision']:.1%}, "
                  f"reuse {st['reuse_from_previous_token']:.1%}, distinct experts/layer "
                  f"{st['distinct_experts_per_layer_mean']:.1f}", flush=True)
    (a.out / "manifest.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {a.out / 'manifest.json'}")


# -- replay ----------------------------------------------------------------------------
class TraceCursor:
    """The trace step the model's next rows are at: the routers of a step read the rows
    from here, and the last MoE layer's router moves it on."""

    def __init__(self, trace: Trace, start: int = 0):
        self.trace, self.position = trace, start

    def rows(self, n: int) -> slice:
        if self.position + n > self.trace.steps:
            raise RuntimeError(f"the trace ends at step {self.trace.steps}; the model asked for rows "
                               f"{self.position}..{self.position + n}")
        return slice(self.position, self.position + n)


class TraceRouter:
    """Stands for a MoE layer's router: the trace's top-k ids and weights for the step's
    rows (the router's own computation is skipped: 64 x hidden per row, next to nothing
    beside the experts')."""

    def __init__(self, inner, cursor: TraceCursor, layer: int, last: bool):
        self.inner, self.cursor, self.layer, self.last = inner, cursor, layer, last

    def __getattr__(self, name):  # top_k and the like, as the router they stand for
        return getattr(self.inner, name)

    def __call__(self, x, step):
        rows = self.cursor.rows(x.shape[0])
        trace = self.cursor.trace
        indices = trace.experts[rows, self.layer].astype(np.int64)
        weights = trace.weights[rows, self.layer].astype(np.float32)
        if self.last:
            self.cursor.position = rows.stop
        return indices, weights


class TraceLookahead:
    """Stands for the router the look-ahead applies to predict a layer: the trained
    model's recorded predictions for the step's rows, ranked as recorded (weights falling
    with rank, so ``prefetch.ranked`` keeps the order of one row)."""

    def __init__(self, cursor: TraceCursor, layer: int):
        self.cursor, self.layer = cursor, layer

    def __call__(self, x, step):
        guess = self.cursor.trace.predicted[self.cursor.rows(x.shape[0]), self.layer].astype(np.int64)
        if (guess == NO_PREDICTION).any():
            raise RuntimeError(f"the trace holds no prediction for MoE layer {self.layer}")
        return guess, np.broadcast_to(1.0 / (1.0 + np.arange(guess.shape[1], dtype=np.float32)), guess.shape)


def install_trace(model, trace: Trace, start: int = 0) -> TraceCursor:
    """Replace the routers of a loaded model (and its look-ahead's) by ``trace`` from step
    ``start``. The trace's geometry must be the model's: same MoE layers, experts, top-k."""
    blocks = moe_blocks(model.lm)
    m = trace.manifest
    have = (len(blocks), model.placement.experts_per_layer, blocks[0].router.top_k)
    want = (m["moe_layers"], m["experts"], m["top_k"])
    if have != want:
        raise SystemExit(f"the trace's geometry (MoE layers, experts, top-k) {want} is not the model's {have}")
    cursor = TraceCursor(trace, start)
    for i, b in enumerate(blocks):
        if b.experts.decl.moe_index != i:
            raise SystemExit(f"MoE block {i} serves store layer {b.experts.decl.moe_index}: not a layout this replays")
        b.router = TraceRouter(b.router, cursor, i, last=i == len(blocks) - 1)
    prefetcher = model.lm.prefetcher
    if prefetcher is not None:
        # the prefetcher keeps the next layer's router per predicting layer (a private
        # table, read here by a benchmark only): each now reads the recorded predictions
        predictors = getattr(prefetcher, "_next", None)
        if not isinstance(predictors, dict) or not all(hasattr(n, "router") and hasattr(n, "moe_index")
                                                       for n in predictors.values()):
            raise SystemExit("colibri's Prefetcher no longer keeps _next[...].router: update install_trace")
        for nxt in predictors.values():
            nxt.router = TraceLookahead(cursor, nxt.moe_index)
    return cursor


def measured_decode(model, prompt: list[int], tokens: int, *, temperature: float, seed: int) -> tuple:
    """Generate ``tokens`` after ``prompt`` (eos ignored) and count what the store did in
    the decode alone (after the first token): hits, prefetch precision / recall, and per
    MoE layer the experts touched (``colibri_core.cli.bench.measured_generation``'s
    measures, with the hit rate of the decode added)."""
    store, history = model.store, model.store.history
    generation = model.stream(token_ids=prompt, max_tokens=tokens, ignore_eos=True, temperature=temperature, seed=seed)
    at_first = session_first = None
    for _ in generation:
        if at_first is None:
            at_first = store.stats.snapshot()
            session_first = history.session.copy() if history is not None else None
    result = generation.result()
    end = store.stats.snapshot()
    d = {k: end[k] - at_first[k] for k in end if isinstance(end[k], int)}
    hits = d["hits_device"] + d["hits_pinned"] + d["hits_lru"]
    lookups = hits + d["hits_prefetched"] + d["misses"]
    measures = {"decode_lookups": lookups, "decode_hit_rate": hits / lookups if lookups else None,
                "decode_prefetched_share": d["hits_prefetched"] / lookups if lookups else None,
                "decode_miss_share": d["misses"] / lookups if lookups else None,
                "decode_prefetch_precision": d["predicted_used"] / d["predicted"] if d["predicted"] else None,
                "decode_prefetch_recall": d["predicted_used"] / d["used"] if d["used"] else None,
                "decode_prefetch_issued": d["prefetch_issued"], "decode_prefetch_unused": d["prefetch_unused"],
                "decode_steps_without_reads_ahead": d["prefetch_steps_off"],
                "distinct_tokens": len(set(result.token_ids)), "expert_coverage_mean": None}
    if history is not None and session_first is not None and len(result.token_ids) > 1:
        coverage = ((history.session - session_first) > 0).sum(axis=1) / history.session.shape[1]
        measures["expert_coverage_mean"] = float(coverage.mean())
        measures["expert_coverage_min"] = float(coverage.min())
    return result, measures


def child(spec: dict) -> dict:
    """One colibri run, measured from inside (in the replay's child process)."""
    import colibri_core
    from colibri_core.cli.bench import _io_read_bytes, _peak_rss, prompt_ids

    started = time.perf_counter()
    with colibri_core.load(spec["model"], **spec["options"]) as model:
        load_s = time.perf_counter() - started
        cursor = None
        if spec.get("trace"):
            trace = Trace.load(Path(spec["trace"]))
            cursor = install_trace(model, trace)
            prompt = trace.tokens[: spec["prompt_tokens"]].tolist()
        else:
            prompt = prompt_ids(model.lm.vocab_size, spec["prompt_tokens"], spec["seed"])
        before = _io_read_bytes()
        result, measures = measured_decode(model, prompt, spec["tokens"], temperature=1.0, seed=spec["seed"])
        disk = _io_read_bytes() - before
        s = result.stats
        out = {"engine": "colibri", "routing": "trace" if cursor else "synthetic router", "load_s": load_s,
               "prefill_s": s.prefill_s, "decode_tok_s": s.decode_tok_s, "generated": s.generated_tokens,
               "decode_bytes_per_token": s.decode_bytes_per_token, "decode_bytes_read": s.decode_bytes_read,
               "disk_read_bytes": disk, "peak_rss_bytes": _peak_rss(), "hit_rate_whole_run": s.hit_rate,
               "decode_read_wait_share": s.decode_read_wait_s / s.decode_s if s.decode_s > 0 else None,
               "pinned_experts": s.pinned_experts, **measures}
        if cursor is not None:
            # every row the model ran followed the trace: the prompt, then one step per decode token
            out["trace_steps_replayed"] = cursor.position
            if cursor.position != spec["prompt_tokens"] + s.generated_tokens - 1:
                raise RuntimeError(f"replayed {cursor.position} trace steps for {spec['prompt_tokens']} prompt "
                                   f"tokens and {s.generated_tokens} generated")
        return out


def scratch_view(model: Path, into: Path) -> Path:
    """Links to a checkpoint's files, without its routing history (and its lock) or its
    read-only marker: every run starts as a first session."""
    from colibri_core.experts.history import FILENAME as HISTORY_FILE, READ_ONLY_MARKER

    into.mkdir(parents=True)
    for f in model.iterdir():
        if f.is_file() and not f.name.startswith(".") and f.name not in (HISTORY_FILE, READ_ONLY_MARKER):
            (into / f.name).symlink_to(f.resolve())
    return into


def run_colibri(view: Path, *, trace: Path | None, a, seed: int, cgroup: int | None) -> dict:
    from colibri_core.cli.bench import run_json_child

    options = {"history": "read", "prefetch": True, "direct_io": True, "backend": "cpu", "ram": a.ram}
    spec = {"model": str(view), "options": options, "tokens": a.tokens, "prompt_tokens": a.prompt_tokens,
            "seed": seed, "trace": str(trace) if trace else None}
    return run_json_child([sys.executable, str(Path(__file__).resolve()), "child", json.dumps(spec)], cgroup=cgroup)


def derived(run: dict, bound_bytes_per_s: float) -> dict:
    """A run's figures beside the disk bound of its round."""
    per_token = run.get("decode_bytes_per_token")
    if run.get("engine") == "llama.cpp" and "disk_read_bytes" in run:
        per_token = run["disk_read_bytes"] / max(run.get("tokens_asked", 1), 1)
    bound_tok_s = bound_bytes_per_s / per_token if per_token else None
    tok_s = run.get("decode_tok_s")
    return {"tok_s": tok_s, "bytes_per_token": per_token, "bound_tok_s": bound_tok_s,
            "share_of_bound": tok_s / bound_tok_s if tok_s and bound_tok_s else None,
            "hit_rate": run.get("decode_hit_rate"), "prefetched": run.get("decode_prefetched_share"),
            "precision": run.get("decode_prefetch_precision"), "recall": run.get("decode_prefetch_recall"),
            "coverage": run.get("expert_coverage_mean"), "read_wait": run.get("decode_read_wait_share"),
            "peak_mib": (run.get("cgroup_peak_bytes") or 0) / 2**20 or None}


def cmd_replay(a) -> None:
    from benchmarks.streaming_table import children_import_this_tree, disk_bound, llama_available, run_llama
    from colibri_core.cli.bench import drop_page_cache
    from colibri_core.units import parse_size

    children_import_this_tree()
    command = "python benchmarks/trace_streaming.py replay " + " ".join(sys.argv[2:])
    print(command, flush=True)
    limit = parse_size(a.cgroup) if a.cgroup else None
    traces = {d: a.traces / f"{d}.npz" for d in a.domains}
    manifests = {}
    for d, path in traces.items():
        if not path.exists():
            raise SystemExit(f"{path}: no trace (run `record` first)")
        t = Trace.load(path)
        if t.steps < a.prompt_tokens + a.tokens - 1:
            raise SystemExit(f"{path}: {t.steps} steps; the replay needs {a.prompt_tokens + a.tokens - 1}")
        decode = slice(a.prompt_tokens, a.prompt_tokens + a.tokens - 1)  # the prompt's rows run as one batch
        manifests[d] = {**t.manifest, "file": str(path), "file_sha256": sha256_of(path),
                        "decode_statistics": trace_statistics(t.experts[decode], t.predicted[decode])}
    why_no_llama = llama_available(a.llama_python, a.gguf)
    if why_no_llama:
        print(f"llama.cpp is not available ({why_no_llama}); running colibri's part only", file=sys.stderr, flush=True)
    workloads = [f"trace {d}" for d in a.domains] + (["synthetic"] if a.synthetic else [])
    workloads += [] if why_no_llama else ["llama.cpp"]
    runs, started = [], time.time()
    with tempfile.TemporaryDirectory(prefix="colibri-trace-") as work:
        view = scratch_view(a.model.resolve(), Path(work) / "model")
        for r in range(a.rounds):
            order = workloads[r % len(workloads):] + workloads[: r % len(workloads)]  # rotated per round
            row = {"round": r + 1, "order": order, "load_before_bound": os.getloadavg()[0],
                   "bound": disk_bound(view, budget=int(a.bound_gb * 1e9), threads=a.io_threads, seed=r)}
            row["runs"] = {}
            for w in order:
                load = os.getloadavg()[0]
                if w == "llama.cpp":
                    cache = drop_page_cache(a.gguf.parent)
                    run = run_llama(a.llama_python, a.gguf, tokens=a.tokens, prompt_tokens=a.prompt_tokens, seed=r,
                                    threads=a.threads, cgroup=limit, repack=False)
                    run["tokens_asked"] = a.tokens
                    run["routing"] = "its own (synthetic router)"
                else:
                    cache = drop_page_cache(view)
                    trace = traces[w.removeprefix("trace ")] if w.startswith("trace ") else None
                    run = run_colibri(view, trace=trace, a=a, seed=r, cgroup=limit)
                run.update({"load_before": load, "cache": cache, "at": time.strftime("%H:%M:%S", time.gmtime())})
                row["runs"][w] = run
                print(summary_line(r + 1, w, run, row["bound"]["bytes_per_s"]), flush=True)
            runs.append(row)
    report = {"command": command, "machine": machine(), "date": datetime.date.today().isoformat(),
              "started_utc": time.strftime("%H:%M", time.gmtime(started)),
              "ended_utc": time.strftime("%H:%M", time.gmtime()), "code": git_head(),
              "checkpoint": str(a.model.resolve()), "gguf": str(a.gguf) if a.gguf else None,
              "llama_unavailable": why_no_llama, "cgroup_bytes": limit, "ram": a.ram, "tokens": a.tokens,
              "prompt_tokens": a.prompt_tokens, "rounds": a.rounds, "bound_gb": a.bound_gb, "io_threads": a.io_threads,
              "llama_threads": a.threads, "traces": manifests, "workloads": workloads, "runs": runs,
              "medians": medians(workloads, runs)}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(report, indent=1) + "\n"), (".md", markdown(report))):
        a.out.with_name(a.out.name + suffix).write_text(text)
        print(f"wrote {a.out.with_name(a.out.name + suffix)}")


def medians(workloads: list[str], runs: list[dict]) -> dict:
    out = {}
    for w in workloads:
        rows = [derived(r["runs"][w], r["bound"]["bytes_per_s"]) for r in runs if "error" not in r["runs"][w]]
        out[w] = {k: statistics.median(v) if (v := [x[k] for x in rows if x[k] is not None]) else None
                  for k in (rows[0] if rows else {})}
        out[w]["runs"] = len(rows)
        out[w]["bound_bytes_per_s"] = statistics.median(r["bound"]["bytes_per_s"] for r in runs)
    return out


COLUMNS = [("tok_s", "decode tok/s", "tok"), ("bytes_per_token", "disk / token", "mb"),
           ("bound_tok_s", "disk bound tok/s", "tok"), ("share_of_bound", "share of bound", "pct"),
           ("hit_rate", "expert hit rate (RAM)", "pct"), ("prefetched", "served by reads ahead", "pct"),
           ("precision", "prefetch precision", "pct"), ("recall", "recall", "pct"),
           ("coverage", "expert coverage", "pct"), ("read_wait", "decode waiting on reads", "pct"),
           ("peak_mib", "cgroup peak", "mib")]


def fmt(v, kind) -> str:
    if v is None:
        return "-"
    return {"pct": f"{v:.0%}", "tok": f"{v:.2f}", "mb": f"{v / 2**20:.1f} MiB", "mib": f"{v:.0f} MiB"}[kind]


def summary_line(r: int, w: str, run: dict, bound: float) -> str:
    if "error" in run:
        return f"round {r} {w}: failed: {run['error']}"
    d = derived(run, bound)
    return f"round {r} {w}: " + ", ".join(f"{t} {fmt(d[k], kind)}" for k, t, kind in COLUMNS)


def markdown(report: dict) -> str:
    lines = [f"# Trace-driven streaming at full size ({report['date']})", "",
             f"- command: `{report['command']}`", f"- machine: {report['machine']}",
             f"- date {report['date']}, {report['started_utc']}-{report['ended_utc']} UTC, code {report['code']}",
             f"- checkpoint {report['checkpoint']}; llama.cpp GGUF {report['gguf']}"
             + (f" (not run: {report['llama_unavailable']})" if report["llama_unavailable"] else ""),
             f"- every run cold (page cache dropped before it), each engine in a fresh process in a "
             f"{fmt(report['cgroup_bytes'], 'mb') if report['cgroup_bytes'] else 'no'} memory cgroup; colibri "
             f"--ram {report['ram']}, prefetch, O_DIRECT, history read-only from a view without a saved history; "
             f"{report['prompt_tokens']}-token prompt then {report['tokens']} decode tokens; rounds rotate the order",
             "- `trace DOMAIN`: the store driven by the trace (routers and look-ahead replaced, expert compute real); "
             "`synthetic`: the checkpoint's own router (seeded random prompt, temperature 1); `llama.cpp`: **its own "
             "routing** (it cannot follow a trace), mmap, repacking off, its disk / token = its process's disk reads "
             "over prefill and decode / decode tokens (an mmap's faults cannot be split); colibri's = expert bytes "
             "read after the first token / decode steps",
             "- disk bound tok/s = the round's O_DIRECT bound (bytes/s) / the run's disk bytes per token; hit rate, "
             "precision, recall and coverage over the decode only", "",
             "Traces (the trained OLMoE-geometry model, teacher-forced one token per step): the whole trace, and "
             "the decode steps replayed:", "",
             "| domain | steps | look-ahead precision (trained model) | reuse from previous token | distinct experts / layer "
             "| model sha256 |", "|---|---|---|---|---|---|"]
    for d, m in report["traces"].items():
        for label, st, steps in (("all", m["statistics"], m["tokens"]),
                                 ("decode replayed", m["decode_statistics"], report["tokens"] - 1)):
            lines.append(f"| {d} ({label}) | {steps} | {fmt(st['lookahead_precision'], 'pct')} | "
                         f"{fmt(st['reuse_from_previous_token'], 'pct')} | {st['distinct_experts_per_layer_mean']:.1f} | "
                         f"{m['model_sha256'][:12]} |")
    head = "| round | workload | routing | " + " | ".join(t for _, t, _ in COLUMNS) + " | disk bound GB/s | load |"
    lines += ["", head, "|" + "---|" * (head.count("|") - 1)]
    for row in report["runs"]:
        bound = row["bound"]["bytes_per_s"]
        for w in row["order"]:
            run = row["runs"][w]
            if "error" in run:
                lines.append(f"| {row['round']} | {w} | failed: {run['error']} |" + " |" * len(COLUMNS)
                             + f" {bound / 1e9:.2f} | {run['load_before']:.2f} |")
                continue
            d = derived(run, bound)
            lines.append(f"| {row['round']} | {w} | {run.get('routing', '-')} | "
                         + " | ".join(fmt(d[k], kind) for k, _, kind in COLUMNS)
                         + f" | {bound / 1e9:.2f} | {run['load_before']:.2f} |")
    lines += ["", "Medians over the rounds:", "", "| workload | runs | " + " | ".join(t for _, t, _ in COLUMNS)
              + " | disk bound GB/s |", "|" + "---|" * (len(COLUMNS) + 3)]
    for w, m in report["medians"].items():
        lines.append(f"| {w} | {m['runs']} | " + " | ".join(fmt(m.get(k), kind) for k, _, kind in COLUMNS)
                     + f" | {m['bound_bytes_per_s'] / 1e9:.2f} |")
    return "\n".join(lines) + "\n"


def machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"


def git_head() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def main(argv=None) -> None:
    from benchmarks.streaming_table import add_round_options

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record the trained model's routing on held-out text")
    r.add_argument("--model", type=Path, default=DEFAULT_TRAINED)
    r.add_argument("--domains", type=lambda s: s.split(","), default=["python", "c", "prose", "data"])
    r.add_argument("--tokens", type=int, default=512, help="steps (tokens) per domain")
    r.add_argument("--out", type=Path, required=True, help="directory for NAME.npz and manifest.json")
    p2 = sub.add_parser("replay", help="drive a full-size checkpoint's store with the traces")
    p2.add_argument("--model", type=Path, required=True, help="the full-size checkpoint (colibri reads it)")
    p2.add_argument("--traces", type=Path, required=True, help="the directory `record` wrote")
    p2.add_argument("--domains", type=lambda s: s.split(","), default=["python", "prose"])
    p2.add_argument("--synthetic", action=argparse.BooleanOptionalAction, default=True,
                    help="also run colibri with the checkpoint's own (synthetic) routing")
    p2.add_argument("--gguf", type=Path, default=None, help="llama.cpp's GGUF of the same checkpoint")
    p2.add_argument("--llama-python", default=None, help="python of an environment with llama-cpp-python")
    add_round_options(p2, cgroup_example="3G", tokens=64, rounds=2, bound_gb=1.0)
    p2.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    c = sub.add_parser("child", help=argparse.SUPPRESS)
    c.add_argument("spec")
    a = p.parse_args(argv)
    if a.cmd == "child":
        print(json.dumps(child(json.loads(a.spec))))
    elif a.cmd == "record":
        if a.tokens < 2:
            p.error("--tokens must be at least 2")
        cmd_record(a)
    else:
        for name in ("tokens", "prompt_tokens", "rounds", "threads", "io_threads"):
            if getattr(a, name) < 1:
                p.error(f"--{name.replace('_', '-')} must be at least 1")
        if not (a.model / "config.json").exists():
            p.error(f"--model {a.model}: no config.json")
        cmd_replay(a)


if __name__ == "__main__":
    main()
