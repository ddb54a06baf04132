"""The issue #20 streaming table: colibri streaming experts under a memory cgroup, per
routing predictability, beside the disk's bound and llama.cpp.

For each round and each checkpoint (one per predictability setting, e.g. ~95%, ~75%
and ~50% prefetch precision; see ``prefetch_calibrate.py``), in this order and each in a
fresh process after the page cache is dropped:

1. the disk bound: cold O_DIRECT reads of the checkpoint's experts with the request sizes
   colibri uses (one request per expert: its matrices and scales lie together), by as many
   threads as colibri's I/O pool, in this run (a bound measured another day is another
   disk);
2. colibri (``colibri bench``'s child: the seeded prompt, temperature 1, decode timed apart
   from prefill) in the memory cgroup, with ``--prefetch`` and ``--direct-io`` by default:
   decode tok/s, disk bytes per token, prefetch precision / recall over the decode,
   distinct tokens generated and expert coverage (a looping generation touches few
   experts and flatters every cache);
3. llama.cpp on the checkpoint's GGUF (``--gguf LABEL=PATH``), through
   ``llama_cpp_bench.py run``'s child in the same cgroup, with llama-cpp-python from
   ``--llama-python``, its weights in the mmap (repacking off unless ``--llama-repack``:
   repacked Q4_0 does not load in a small cgroup). Without it (or without a GGUF) the script says llama.cpp is not
   available and runs colibri's part.

``--also-without-prefetch`` runs colibri a second time per row without ``--prefetch``
(after dropping the cache again): what prefetch gains, or costs when routing is hard to
predict. The two runs swap places every other round (``first`` in the JSON), so neither
always runs right after the bound's reads: with prefetch always first, its gain at the
frontier shape measured 0.87-1.04x; alternated, without the bound between, 0.90-1.11x
(docs/benchmarks.md).

Rounds interleave the settings and engines, so drift on a shared machine hits all alike;
the 1-minute load average is recorded before every run. Writes ``OUT.json`` (every run)
and ``OUT.md`` (a row per run, then medians per setting).

    python benchmarks/streaming_table.py --model p95=/data/fr-0.02 --model p75=/data/fr-0.5 \\
        --model p50=/data/fr-1.2 --gguf p95=/data/fr-0.02.gguf ... --llama-python /work/llvenv/bin/python \\
        --cgroup 16G --ram 12G --tokens 32 --rounds 3 --out /data/streaming-20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from benchmarks.prefetch_calibrate import knobs  # noqa: E402

EXPERT = re.compile(r"\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
ALIGN = 4096


# -- the disk bound ---------------------------------------------------------------------------
def expert_requests(model: Path) -> list[tuple[str, int, int]]:
    """(shard path, offset, size) of each read colibri makes for the routed experts: an
    expert's tensors grouped as its reader groups them (one request per run of tensors in
    one file, ``merge_ranges``), so an expert whose tensors straddle two shards is two
    requests, not one span from the first shard's offset to the second's end."""
    from colibri_core.io.checkpoint import merge_ranges
    from colibri_core.io.safetensors import SafetensorsFile

    by_expert: dict[tuple[int, int], list] = {}
    for shard in sorted(model.glob("*.safetensors")):
        f = SafetensorsFile(shard)
        try:
            for info in f.tensors.values():
                m = EXPERT.search(info.name)
                if m is not None:
                    by_expert.setdefault((int(m.group(1)), int(m.group(2))), []).append(info)
        finally:
            f.close()
    requests = []
    for infos in by_expert.values():
        for group in merge_ranges(infos):
            start = min(t.offset for t in group)
            requests.append((group[0].path, start, max(t.offset + t.nbytes for t in group) - start))
    return requests


def disk_bound(model: Path, *, budget: int, threads: int, seed: int) -> dict:
    """Cold O_DIRECT reads of randomly chosen experts' spans (aligned out to 4 KiB), ``threads``
    at a time, until ``budget`` bytes: bytes/s."""
    from colibri_core.cli.bench import drop_page_cache
    from colibri_core.io.drives import aligned_empty

    requests = expert_requests(model)
    if not requests:
        raise SystemExit(f"{model}: no routed expert tensors (model.layers.N.mlp.experts.E.*) found")
    random.Random(seed).shuffle(requests)
    chosen, total = [], 0
    for r in requests:
        if total >= budget:
            break
        chosen.append(r)
        total += r[2]
    drop_page_cache(model)
    try:
        fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in {r[0] for r in chosen}}
    except (OSError, AttributeError) as exc:  # the bound is uncached reads, or nothing
        raise SystemExit(f"{model}: cannot open the shards with O_DIRECT ({exc}); the disk bound needs it") from None
    biggest = max(r[2] for r in chosen) + 2 * ALIGN
    local = threading.local()  # one aligned buffer per thread, as each colibri I/O thread reads into its own

    def read(request):
        path, offset, size = request
        if not hasattr(local, "buffer"):
            local.buffer = aligned_empty(biggest)
        start = offset // ALIGN * ALIGN
        length = -(-(offset + size - start) // ALIGN) * ALIGN
        return os.preadv(fds[path], [memoryview(local.buffer)[:length]], start)

    try:
        started = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            done = sum(pool.map(read, chosen))
        seconds = time.perf_counter() - started
    finally:
        for fd in fds.values():
            os.close(fd)
    sizes = sorted(r[2] for r in chosen)
    return {"bytes_per_s": done / seconds, "bytes": done, "requests": len(chosen), "threads": threads,
            "request_bytes_median": sizes[len(sizes) // 2]}


# -- llama.cpp --------------------------------------------------------------------------------
def llama_available(python: str | None, gguf: Path | None) -> str | None:
    """None when llama.cpp can run, else why not (one line)."""
    if gguf is None:
        return "no GGUF given for this checkpoint (--gguf LABEL=PATH)"
    if not gguf.exists():
        return f"{gguf} does not exist"
    if not python:
        return "no llama-cpp-python environment given (--llama-python)"
    try:
        done = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python}: {exc}"
    if done.returncode != 0:
        return f"{python} cannot import llama_cpp ({(done.stderr.strip().splitlines() or ['?'])[-1]})"
    return None


def run_llama(python: str, gguf: Path, *, tokens: int, prompt_tokens: int, seed: int, threads: int,
              cgroup: int | None, repack: bool = True) -> dict:
    """One llama.cpp run in a fresh process (llama_cpp_bench.py's child), optionally in a cgroup."""
    from colibri_core.cli.bench import run_json_child

    cmd = [python, str(HERE / "llama_cpp_bench.py"), "run", "--gguf", str(gguf), "--tokens", str(tokens),
           "--prompt-tokens", str(prompt_tokens), "--seed", str(seed), "--threads", str(threads), "--child"]
    cmd += [] if repack else ["--no-repack"]
    result = run_json_child(cmd, cgroup=cgroup)
    return {"engine": "llama.cpp", **result} if "error" in result else result


# -- the table --------------------------------------------------------------------------------
def run_table(a) -> dict:
    from colibri_core.cli.bench import drop_page_cache, run_engine
    from colibri_core.units import parse_size

    limit = parse_size(a.cgroup) if a.cgroup else None
    settings = []
    for label, path in a.model:
        config = json.loads((path / "config.json").read_text())
        gguf = a.gguf.get(label)
        why = llama_available(a.llama_python, gguf)
        if why:
            print(f"{label}: llama.cpp is not available ({why}); running colibri's part only", file=sys.stderr, flush=True)
        settings.append({"label": label, "model": str(path), "synthetic": config.get("colibri_synthetic"),
                         "gguf": str(gguf) if gguf else None, "llama": why is None, "llama_unavailable": why})
    options = {"history": "read", "prefetch": a.prefetch, "direct_io": a.direct_io, "backend": a.backend}
    if a.ram:
        options["ram"] = a.ram
    if a.prefetch_window:
        options["prefetch_window"] = a.prefetch_window
    runs = []
    for r in range(a.rounds):
        for s in settings:
            model = Path(s["model"])
            row = {"round": r + 1, "label": s["label"]}
            row["load_before_bound"] = os.getloadavg()[0]
            row["bound"] = disk_bound(model, budget=int(a.bound_gb * 1e9), threads=a.io_threads, seed=r)
            spec = {"model": str(model), "tokens": a.tokens, "prompt_tokens": a.prompt_tokens, "temperature": 1.0,
                    "options": options, "ram": a.ram, "seed": r}
            runs_here = [("colibri", spec)]
            if a.also_without_prefetch and a.prefetch:  # what prefetch gains (or costs) on this setting
                runs_here.append(("no_prefetch", {**spec, "options": {**options, "prefetch": False}}))
                # alternate which of the pair runs right after the disk bound's reads, so that
                # whatever those reads leave behind (a virtual disk's throttle) hits both alike
                if r % 2 == 1:
                    runs_here.reverse()
                row["first"] = runs_here[0][0]
            for key, run_spec in runs_here:
                row[f"load_before_{key}"] = os.getloadavg()[0]
                row[f"cache_{key}"] = drop_page_cache(model)
                row[key] = run_engine("colibri", run_spec, cgroup=limit)
                row[key].pop("token_ids", None)
            if s["llama"]:
                row["load_before_llama"] = os.getloadavg()[0]
                row["cache_llama"] = drop_page_cache(Path(s["gguf"]).parent)
                row["llama"] = run_llama(a.llama_python, Path(s["gguf"]), tokens=a.tokens, prompt_tokens=a.prompt_tokens,
                                         seed=r, threads=a.threads, cgroup=limit, repack=a.llama_repack)
            runs.append(row)
            print(_summary_line(row), file=sys.stderr, flush=True)
    return {"tokens": a.tokens, "prompt_tokens": a.prompt_tokens, "rounds": a.rounds, "cgroup_bytes": limit,
            "llama_repack": a.llama_repack,
            "ram": a.ram, "options": options, "temperature": 1.0, "settings": settings, "runs": runs,
            "medians": medians(settings, runs)}


def _derived(row: dict) -> dict:
    c, bound = row["colibri"], row["bound"]["bytes_per_s"]
    d = {"precision": c.get("decode_prefetch_precision"), "recall": c.get("decode_prefetch_recall"),
         "coverage": c.get("expert_coverage_mean"), "distinct": c.get("distinct_tokens"),
         "colibri_tok_s": c.get("decode_tok_s"), "colibri_disk_per_token": c.get("decode_bytes_per_token"),
         "read_wait": c.get("decode_read_wait_share"), "hit_rate": c.get("hit_rate")}
    per_token = d["colibri_disk_per_token"]
    d["bound_tok_s"] = bound / per_token if per_token else None
    d["share_of_bound"] = d["colibri_tok_s"] / d["bound_tok_s"] if d["bound_tok_s"] and d["colibri_tok_s"] else None
    without = row.get("no_prefetch") or {}
    d["no_prefetch_tok_s"] = without.get("decode_tok_s")
    d["prefetch_gain"] = (d["colibri_tok_s"] / d["no_prefetch_tok_s"]
                          if d["no_prefetch_tok_s"] and d["colibri_tok_s"] else None)
    llama = row.get("llama") or {}
    d["llama_tok_s"] = llama.get("decode_tok_s")
    d["llama_disk_per_token"] = llama["disk_read_bytes"] / row_tokens(row) if "disk_read_bytes" in llama else None
    d["ratio"] = d["colibri_tok_s"] / d["llama_tok_s"] if d["llama_tok_s"] and d["colibri_tok_s"] else None
    return d


def row_tokens(row: dict) -> int:
    return max(row["colibri"].get("generated") or 1, 1)


def medians(settings, runs) -> dict:
    out = {}
    for s in settings:
        rows = [_derived(r) for r in runs if r["label"] == s["label"] and "error" not in r["colibri"]]
        out[s["label"]] = {k: statistics.median(v) if (v := [x[k] for x in rows if x[k] is not None]) else None
                           for k in (rows[0] if rows else {})}
    return out


def _fmt(v, kind):
    if v is None:
        return "-"
    return {"pct": f"{v:.0%}", "tok": f"{v:.2f}", "mb": f"{v / 2**20:.1f} MiB", "n": f"{v:g}", "x": f"{v:.2f}x"}[kind]


COLUMNS = [("precision", "prefetch precision", "pct"), ("recall", "recall", "pct"), ("coverage", "expert coverage", "pct"),
           ("distinct", "distinct tokens", "n"), ("colibri_tok_s", "colibri tok/s", "tok"),
           ("colibri_disk_per_token", "colibri disk / token", "mb"), ("bound_tok_s", "disk bound tok/s", "tok"),
           ("share_of_bound", "share of bound", "pct"), ("read_wait", "decode waiting on reads", "pct"),
           ("hit_rate", "expert hit rate", "pct"), ("no_prefetch_tok_s", "colibri tok/s without prefetch", "tok"),
           ("prefetch_gain", "with / without prefetch", "x"), ("llama_tok_s", "llama.cpp tok/s", "tok"),
           ("llama_disk_per_token", "llama.cpp disk / token", "mb"), ("ratio", "colibri / llama.cpp", "x")]


def _summary_line(row: dict) -> str:
    if "error" in row["colibri"]:
        return f"round {row['round']} {row['label']}: colibri failed: {row['colibri']['error']}"
    d = _derived(row)
    return f"round {row['round']} {row['label']}: " + ", ".join(f"{title} {_fmt(d[k], kind)}" for k, title, kind in COLUMNS)


def markdown(data: dict) -> str:
    head = "| round | setting | generator | " + " | ".join(t for _, t, _ in COLUMNS) + " | load (bound / colibri / without prefetch / llama) |"
    lines = [f"{data['tokens']} tokens after a {data['prompt_tokens']}-token prompt, temperature 1; cgroup "
             f"{_fmt(data['cgroup_bytes'], 'mb') if data['cgroup_bytes'] else 'none'}, colibri options "
             f"{json.dumps(data['options'])}; llama.cpp mmap, repacking {'on' if data.get('llama_repack') else 'off'}", ""]
    for s in data["settings"]:
        if not s["llama"]:
            lines.append(f"- {s['label']}: llama.cpp not available ({s['llama_unavailable']})")
    lines += ["", head, "|" + "---|" * (head.count("|") - 1)]
    mix = {s["label"]: knobs(s["synthetic"]) for s in data["settings"]}
    for row in data["runs"]:
        loads = " / ".join(f"{row[k]:.2f}" if k in row else "-" for k in
                           ("load_before_bound", "load_before_colibri", "load_before_no_prefetch", "load_before_llama"))
        if "error" in row["colibri"]:
            lines.append(f"| {row['round']} | {row['label']} | {mix[row['label']]} | colibri failed: "
                         f"{row['colibri']['error']} |" + " |" * (len(COLUMNS) - 1) + f" {loads} |")
            continue
        d = _derived(row)
        lines.append(f"| {row['round']} | {row['label']} | {mix[row['label']]} | "
                     + " | ".join(_fmt(d[k], kind) for k, _, kind in COLUMNS) + f" | {loads} |")
    lines += ["", "Medians over the rounds:", "", "| setting | generator | " + " | ".join(t for _, t, _ in COLUMNS) + " |",
              "|" + "---|" * (len(COLUMNS) + 2)]
    for label, m in data["medians"].items():
        lines.append(f"| {label} | {mix[label]} | " + " | ".join(_fmt(m.get(k), kind) for k, _, kind in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def _labelled(text: str) -> tuple[str, Path]:
    label, sep, path = text.partition("=")
    if not sep or not label or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL=PATH")
    return label, Path(path)


def children_import_this_tree() -> None:
    """The engines' child processes (``colibri_core.cli.bench``, llama_cpp_bench.py) import
    this tree's colibri_core, not the one an editable install points at: A/B runs of two
    checkouts (git worktrees) then compare the two, not one with itself. PYTHONSAFEPATH
    too: ``python -m`` puts the working directory first on the path, so a run started from
    inside another checkout imported that one's (the 2026-12-04 gate A/B, run from /work/main,
    compared the new tree with itself)."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.environ["PYTHONSAFEPATH"] = "1"


def add_round_options(p: argparse.ArgumentParser, *, cgroup_example: str, tokens: int, rounds: int,
                      bound_gb: float) -> None:
    """The options of rounds of colibri and llama.cpp beside the disk bound (this table's,
    trace_streaming.py's replay's): the engines' cgroup and colibri's RAM, the workload,
    the rounds, llama.cpp's threads and the bound's threads and bytes."""
    p.add_argument("--cgroup", default=None, help=f"memory cgroup size for every engine (e.g. {cgroup_example}; needs root)")
    p.add_argument("--ram", default=None, help="colibri's --ram")
    p.add_argument("--tokens", type=int, default=tokens)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads")
    p.add_argument("--io-threads", type=int, default=3, help="threads of the O_DIRECT bound (colibri's I/O pool)")
    p.add_argument("--bound-gb", type=float, default=bound_gb, help="bytes read for the disk bound per round")


def main(argv=None):
    children_import_this_tree()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=_labelled, action="append", required=True, help="LABEL=checkpoint dir (repeatable)")
    p.add_argument("--gguf", type=_labelled, action="append", default=[], help="LABEL=GGUF of that checkpoint")
    p.add_argument("--llama-python", default=None, help="python of an environment with llama-cpp-python")
    p.add_argument("--llama-repack", action=argparse.BooleanOptionalAction, default=False,
                   help="llama.cpp's weight repacking (off by default: repacked Q4_0 does not load in a small cgroup)")
    add_round_options(p, cgroup_example="16G", tokens=32, rounds=3, bound_gb=2.0)
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--prefetch-window", default=None, help="colibri's --prefetch-window (default: top-k experts)")
    p.add_argument("--also-without-prefetch", action="store_true",
                   help="each round also runs colibri without --prefetch (what prefetch gains or costs)")
    p.add_argument("--direct-io", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    a = p.parse_args(argv)
    labels = [label for label, _ in a.model]
    if len(set(labels)) != len(labels):
        p.error("--model labels must differ")
    for label, path in a.model:
        if not (path / "config.json").exists():
            p.error(f"--model {label}={path}: no config.json (not a model directory)")
    a.gguf = dict(a.gguf)
    for label in a.gguf:
        if label not in labels:
            p.error(f"--gguf {label}=...: no --model {label}")
    for name in ("tokens", "prompt_tokens", "rounds", "threads", "io_threads"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    from colibri_core.errors import ColibriError

    try:
        data = run_table(a)
    except ColibriError as exc:  # e.g. no writable memory cgroup for --cgroup
        raise SystemExit(f"error: {exc}") from None
    for suffix, text in ((".json", json.dumps(data, indent=1)), (".md", markdown(data))):
        target = a.out.with_name(a.out.name + suffix)
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, target)
        print(f"wrote {target}", file=sys.stderr)


if __name__ == "__main__":
    main()
