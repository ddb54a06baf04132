"""``colibri bench``: speed and memory of colibri on a model, beside its peers.

Every engine runs in its own process (so its peak memory and disk reads are its own),
optionally inside a memory cgroup (so the page cache counts against the budget, as it
does on a machine that is really that small) and after dropping the page cache. The
same prompt (seeded random token ids) is fed to every engine; decode speed is
(tokens - 1) / (time of the last token - time of the first), prefill is timed apart from
loading, disk bytes come from /proc/<pid>/io, peak memory from VmHWM (and the cgroup's
high-water mark when there is one).

Engines: ``colibri`` (always), ``transformers`` (resident), ``accelerate-offload``
(transformers with accelerate's disk offload under --ram).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from colibri_core.errors import ColibriError, UsageError
from colibri_core.units import parse_size

ENGINES = ("colibri", "transformers", "accelerate-offload")
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")
# the console width for a table that is not on a terminal: wider than any table, so rich
# neither folds nor cuts a cell (a pipe has no width to fit)
UNBOUNDED_WIDTH = 10_000


def prompt_ids(vocab: int, n: int, seed: int = 0) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


# -- running one engine in a child process -------------------------------------------------
@dataclass
class Cgroup:
    path: Path
    version: int

    @classmethod
    def create(cls, limit: int) -> "Cgroup":
        name = f"colibri-bench-{os.getpid()}-{time.monotonic_ns()}"
        if (CGROUP_V1 / "memory.limit_in_bytes").exists():
            path = CGROUP_V1 / name
            path.mkdir()
            (path / "memory.limit_in_bytes").write_text(str(limit))
            return cls(path, 1)
        if (CGROUP_V2 / "cgroup.controllers").exists() and "memory" in (CGROUP_V2 / "cgroup.controllers").read_text():
            path = CGROUP_V2 / name
            path.mkdir()
            (path / "memory.max").write_text(str(limit))
            return cls(path, 2)
        raise UsageError("--cgroup needs a writable memory cgroup (v1 at /sys/fs/cgroup/memory or v2); run as root")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def peak(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def drop_page_cache(model_dir: Path) -> str:
    """Cold cache: drop the page cache when root, else posix_fadvise DONTNEED every shard."""
    try:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "dropped (drop_caches)"
    except OSError:
        from colibri_core.io.pagecache import drop_page_cache as forget_file

        for shard in model_dir.glob("*.safetensors"):
            forget_file(str(shard))
        return "model files forgotten (fadvise DONTNEED)"


def run_json_child(cmd: list[str], *, cgroup: int | None = None, timeout: float = 3600,
                   env: dict | None = None) -> dict:
    """Run ``cmd`` in a fresh process, optionally in a memory cgroup of ``cgroup`` bytes;
    its last stdout line is its JSON result (with ``cgroup_peak_bytes`` added), or
    ``{"error": one line}`` when it failed."""
    group = Cgroup.create(cgroup) if cgroup else None
    try:
        # the child joins the cgroup before anything is allocated (pages cached before
        # joining would not be charged)
        preexec = (lambda: group.add(os.getpid())) if group else None
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:g} s", "returncode": None}
        if out.returncode != 0:
            if out.returncode in (-9, 137):
                return {"error": "killed (out of memory in the cgroup?)", "returncode": out.returncode}
            lines = out.stderr.strip().splitlines() or [f"exit {out.returncode}"]
            return {"error": lines[-1].removeprefix("error: "), "stderr_tail": lines[-30:],
                    "returncode": out.returncode}
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if group:
            result["cgroup_peak_bytes"] = group.peak()
        return result
    finally:
        if group:
            group.remove()


def run_engine(engine: str, spec: dict, *, cgroup: int | None = None, timeout: float = 3600) -> dict:
    """Run one engine on ``spec`` in a child process; returns its JSON result."""
    result = run_json_child([sys.executable, "-m", "colibri_core.cli.bench", engine, json.dumps(spec)],
                            cgroup=cgroup, timeout=timeout)
    return {"engine": engine, **result} if "error" in result else result


class RunFailed(ColibriError):
    """A run inside ``colibri bench`` failed; exits as its child did (3 when it was killed
    or timed out: the machine's limits, not the input)."""

    def __init__(self, message: str, exit_code: int | None):
        super().__init__(message)
        self.exit_code = exit_code if exit_code is not None and 0 < exit_code < 126 else 3


def failed_run(data: dict) -> RunFailed | None:
    """The error of the first failed run in ``bench``'s result, or None when all ran."""
    failed = [(engine, r, x) for engine, results in data["runs"].items() for r, x in enumerate(results) if "error" in x]
    if not failed:
        return None
    engine, r, first = failed[0]
    more = f" ({len(failed) - 1} more runs failed)" if len(failed) > 1 else ""
    return RunFailed(f"bench: run {r + 1} of {engine} failed: {first['error']}{more}", first.get("returncode"))


# -- the child: one engine, measured from inside ------------------------------------------
def _io_read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def measured_generation(model, ids: list[int], tokens: int, *, temperature: float = 0.0, seed: int = 0):
    """Generate ``tokens`` after ``ids`` (eos ignored) and measure what the decode alone did:
    (result, measures). The store's counters and the routing history are read when the
    first token is sampled and at the end, so the prompt's prefill (one batch, whose
    prediction the ``slots`` bound cuts short) is left out of

    - ``decode_prefetch_precision`` / ``decode_prefetch_recall``: predicted experts that
      the next layer used / predicted, used experts that were predicted (None without
      prefetch or without a decode step);
    - ``expert_coverage``: per MoE layer, distinct experts the generated tokens were routed
      to / experts (None without a routing history), with its mean and minimum: a workload
      that loops over a few tokens touches few experts and flatters every cache;
    - ``distinct_tokens``: distinct token ids generated."""
    store = model.store
    history = store.history if store is not None else None
    generation = model.stream(token_ids=ids, max_tokens=tokens, ignore_eos=True, temperature=temperature, seed=seed)
    at_first = session_first = None
    for _ in generation:
        if at_first is None:
            at_first = store.stats.snapshot() if store is not None else {}
            session_first = history.session.copy() if history is not None else None
    result = generation.result()
    measures = {"distinct_tokens": len(set(result.token_ids)), "decode_prefetch_precision": None,
                "decode_prefetch_recall": None, "expert_coverage": None, "expert_coverage_mean": None,
                "expert_coverage_min": None}
    if store is not None and at_first is not None:
        end = store.stats.snapshot()
        predicted = end["predicted"] - at_first["predicted"]
        used = end["used"] - at_first["used"]
        hit = end["predicted_used"] - at_first["predicted_used"]
        if predicted:
            measures["decode_prefetch_precision"] = hit / predicted
        if used:
            measures["decode_prefetch_recall"] = hit / used
    if history is not None and session_first is not None and len(result.token_ids) > 1:
        touched = (history.session - session_first) > 0  # the last token is sampled, never run
        coverage = touched.sum(axis=1) / touched.shape[1]
        measures["expert_coverage"] = [round(float(c), 4) for c in coverage]
        measures["expert_coverage_mean"] = float(coverage.mean())
        measures["expert_coverage_min"] = float(coverage.min())
    return result, measures


def _child_colibri(spec: dict) -> dict:
    import colibri_core

    started = time.perf_counter()
    options = spec.get("options", {})
    with colibri_core.load(spec["model"], **options) as model:
        load_s = time.perf_counter() - started
        ids = prompt_ids(model.lm.vocab_size, spec["prompt_tokens"], spec.get("seed", 0))
        before = _io_read_bytes()
        result, measures = measured_generation(model, ids, spec["tokens"], temperature=spec.get("temperature", 0.0),
                                               seed=spec.get("seed", 0))
        disk = _io_read_bytes() - before
        s = result.stats
        return {"engine": "colibri", "load_s": load_s, "prefill_s": s.prefill_s, "ttft_s": s.ttft_s,
                "decode_tok_s": s.decode_tok_s, "generated": s.generated_tokens, "hit_rate": s.hit_rate,
                "disk_read_bytes": disk, "bytes_read": s.bytes_read, "peak_rss_bytes": _peak_rss(),
                "decode_bytes_per_token": s.decode_bytes_read / max(s.generated_tokens - 1, 1),
                # over the whole generation, prefill included (as colibri run reports them)
                "prefetch_precision": s.prefetch_precision if options.get("prefetch") else None,
                "prefetch_recall": s.prefetch_recall if options.get("prefetch") else None,
                "prefetch_issued": s.prefetch_issued, "prefetch_unused": s.prefetch_unused,
                "prefetch_skipped": s.prefetch_skipped, "prefetch_steps_off": s.prefetch_steps_off,
                # the share of decode the computation spent blocked on expert reads
                "decode_read_wait_share": s.decode_read_wait_s / s.decode_s if s.decode_s > 0 else None, **measures,
                "token_ids": result.token_ids, "compute": s.compute}


def _child_transformers(spec: dict, offload: bool) -> dict:
    import shutil

    folder = tempfile.mkdtemp(prefix="colibri-bench-offload-") if offload else None
    try:  # accelerate writes several GB of merged expert tensors there: never leave them behind
        return _run_transformers(spec, folder)
    finally:
        if folder:
            shutil.rmtree(folder, ignore_errors=True)


def _run_transformers(spec: dict, offload_folder: str | None) -> dict:
    import torch
    import transformers

    torch.set_num_threads(spec.get("threads") or os.cpu_count() or 1)
    started = time.perf_counter()
    kwargs = {"dtype": "auto"}
    offload = offload_folder is not None
    if offload:
        kwargs.update(device_map="auto", max_memory={"cpu": spec["ram"]}, offload_folder=offload_folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], **kwargs).eval()
    load_s = time.perf_counter() - started
    ids = prompt_ids(model.config.get_text_config().vocab_size, spec["prompt_tokens"], spec.get("seed", 0))
    generator = torch.Generator().manual_seed(spec.get("seed", 0))
    temperature = spec.get("temperature", 0.0)

    def choose(logits):
        if temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    before = _io_read_bytes()
    tokens, times = [], []
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(torch.tensor([ids]), use_cache=True)
        prefill_s = time.perf_counter() - t0
        for _ in range(spec["tokens"]):
            tokens.append(choose(out.logits[0, -1]))
            times.append(time.perf_counter())
            if len(tokens) == spec["tokens"]:
                break
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    decode = (len(tokens) - 1) / (times[-1] - times[0]) if len(tokens) > 1 else 0.0
    return {"engine": "accelerate-offload" if offload else "transformers", "load_s": load_s, "prefill_s": prefill_s,
            "ttft_s": times[0] - t0, "decode_tok_s": decode, "generated": len(tokens),
            "disk_read_bytes": _io_read_bytes() - before, "peak_rss_bytes": _peak_rss(),
            "distinct_tokens": len(set(tokens)), "token_ids": tokens}


def _child(engine: str, spec: dict) -> None:
    if engine == "colibri":
        result = _child_colibri(spec)
    elif engine in ("transformers", "accelerate-offload"):
        result = _child_transformers(spec, offload=engine == "accelerate-offload")
    else:
        raise SystemExit(f"unknown engine {engine!r}")
    print(json.dumps(result))


# -- the comparison ---------------------------------------------------------------------------
def bench(model: str | Path, *, tokens: int = 32, prompt_tokens: int = 32, repeats: int = 3, cold: bool = False,
          vs: tuple[str, ...] = (), ram: str | None = None, cgroup: str | None = None, temperature: float = 0.0,
          options: dict | None = None, report=None, peer_model: str | Path | None = None) -> dict:
    model = Path(model)
    if not (model / "config.json").exists():
        raise ColibriError(f"{model}: no config.json (not a model directory)")
    for engine in vs:
        if engine not in ENGINES[1:]:
            raise UsageError(f"--vs {engine!r}: choose transformers or accelerate-offload")
    if "accelerate-offload" in vs and ram is None:
        raise UsageError("--vs accelerate-offload needs --ram (its CPU memory budget)")
    limit = parse_size(cgroup) if cgroup else None
    options = dict(options or {})
    if ram is not None:
        options.setdefault("ram", ram)
    spec = {"model": str(model), "tokens": tokens, "prompt_tokens": prompt_tokens, "temperature": temperature,
            "options": options, "ram": ram}
    engines = ("colibri", *vs)
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    cache_state = "warm"
    for r in range(repeats):
        for engine in engines:  # interleaved, so drift on a shared machine hits every engine alike
            if cold:
                cache_state = drop_page_cache(model)
            engine_spec = {**spec, "seed": r}
            if engine != "colibri" and peer_model is not None:  # e.g. the bf16 source of a colibri container
                engine_spec["model"] = str(peer_model)
            result = run_engine(engine, engine_spec, cgroup=limit)
            runs[engine].append(result)
            if report:
                report(engine, r, result)
    summary = {}
    for engine, results in runs.items():
        ok = [x for x in results if "error" not in x]
        if not ok:
            summary[engine] = {"error": results[0].get("error")}
            continue
        med = lambda k: statistics.median(x[k] for x in ok if x.get(k) is not None)  # noqa: E731
        summary[engine] = {k: med(k) for k in ("load_s", "prefill_s", "ttft_s", "decode_tok_s", "disk_read_bytes",
                                                "peak_rss_bytes") if any(x.get(k) is not None for x in ok)}
        summary[engine]["decode_spread"] = max(x["decode_tok_s"] for x in ok) - min(x["decode_tok_s"] for x in ok)
        summary[engine]["disk_bytes_per_token"] = summary[engine]["disk_read_bytes"] / max(tokens, 1)
        summary[engine]["runs"] = len(ok)
        if any(x.get("cgroup_peak_bytes") for x in ok):
            summary[engine]["cgroup_peak_bytes"] = med("cgroup_peak_bytes")
        if any(x.get("distinct_tokens") is not None for x in ok):
            summary[engine]["distinct_tokens"] = med("distinct_tokens")
        if engine == "colibri":
            summary[engine]["hit_rate"] = med("hit_rate")
            summary[engine]["decode_bytes_per_token"] = med("decode_bytes_per_token")
            if any(x.get("compute") for x in ok):  # a compute tier's counters (e.g. per Ray worker): the last run's
                summary[engine]["compute"] = ok[-1]["compute"]
            for k in ("prefetch_precision", "prefetch_recall", "decode_prefetch_precision", "decode_prefetch_recall",
                      "expert_coverage_mean", "expert_coverage_min"):
                if any(x.get(k) is not None for x in ok):
                    summary[engine][k] = med(k)
    ratios = {}
    base = summary.get("colibri", {})
    for engine in vs:
        other = summary.get(engine, {})
        if "decode_tok_s" in base and other.get("decode_tok_s"):
            ratios[engine] = {"decode": base["decode_tok_s"] / other["decode_tok_s"],
                              "prefill": other["prefill_s"] / base["prefill_s"] if base.get("prefill_s") else None}
    return {"model": str(model), "peer_model": str(peer_model or model), "tokens": tokens, "prompt_tokens": prompt_tokens, "repeats": repeats,
            "cache": cache_state if cold else "warm", "cgroup_bytes": limit, "summary": summary, "ratios": ratios,
            "runs": runs}


def _child_main(engine: str, spec: dict) -> None:
    """Run the child; its errors end it as the command line's do, one ``error:`` line and
    the error's exit status, which the parent passes on."""
    from colibri_core.errors import cli_spelling, out_of_memory

    with cli_spelling():  # bench's options are flags: name them so
        try:
            _child(engine, spec)
        except Exception as exc:
            error = exc if isinstance(exc, ColibriError) else out_of_memory(exc)
            if error is None:
                raise
            print(f"error: {error}", file=sys.stderr)
            sys.exit(error.exit_code)


if __name__ == "__main__":
    _child_main(sys.argv[1], json.loads(sys.argv[2]))
