"""The issue #18 benchmark: colibri with its routed experts on 1, 2 and 3 Ray expert
workers beside the local run, each worker in its own memory cgroup.

Two ways to give the workers RAM (``--share``):

- a number F (default 1/3): every worker's RAM tier holds F of the model's routed-expert
  bytes, whatever the worker count (three workers hold every expert once, one worker a
  third); the local run's holds the same F. The cluster's expert RAM grows with the
  workers.
- ``split``: each of N workers holds 1/N of the expert bytes (its share, no more), so
  every configuration holds all the experts once, as does the local run; from cold
  caches each configuration reads the experts it needs once, the workers side by side.

Each worker's memory cgroup is its RAM tier plus ``--overhead`` (its Python, numpy,
Ray), so the page cache cannot hold more of the checkpoint than its budget either; the
local run's cgroup is the dense weights plus its RAM tier plus the overhead. Each
worker's misses are its own disk reads (a request's misses together, on its I/O pool).

For each round, in an order rotated per round, each configuration runs in a fresh
process after the page cache is dropped (cold): load, then the seeded prompt and
``--tokens`` tokens at ``--temperature`` (1: routing like a sampled decode). Recorded:
decode tok/s, the disk bytes each worker read (its counters, prefill included) and the
device's own read bytes (/proc/diskstats) over the decode alone, giving the aggregate
disk bandwidth; the network bytes per token each way; the 1-minute load. Once per round, the
disk bound for 1, 2 and 3 concurrent readers (``streaming_table.disk_bound``: cold
O_DIRECT reads of whole experts) says what the disk could give that many readers.

Writes OUT.json (every run) and OUT.md (runs, then medians per configuration).

    python benchmarks/ray_bench.py --model /data/olmoe-full-int4 --workers 1,2,3 --rounds 3 \\
        --tokens 32 --out /data/ray-18
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run as a script from anywhere
sys.path.insert(0, str(HERE))


def model_sizes(model: Path) -> dict:
    """The routed experts' bytes (as the RAM tier counts them) and the dense weights'."""
    from colibri_core.model.blueprint import inspect_model
    from colibri_core.plugins.discovery import create_backend, get_registry

    bp = inspect_model(model, create_backend(get_registry(), "cpu"))
    try:
        experts = bp.expert_ram_bytes * bp.experts_per_layer * len(bp.moe)
        total = sum(info.nbytes for sf in {id(s): s for s in bp.checkpoint.files.values()}.values()
                    for info in sf.tensors.values())
        return {"expert_bytes": int(experts), "expert_ram_bytes": int(bp.expert_ram_bytes),
                "dense_bytes": int(max(0, total - experts)), "moe_layers": len(bp.moe),
                "experts_per_layer": bp.experts_per_layer}
    finally:
        bp.close()


def device_read_bytes(path: Path) -> int:
    """Bytes read from the block device holding ``path`` (all partitions' parent), from
    /proc/diskstats: every process's reads, page cache misses and O_DIRECT alike."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    with open("/proc/diskstats") as f:
        for line in f:
            parts = line.split()
            if int(parts[0]) == major and int(parts[1]) == minor:
                return int(parts[5]) * 512
    return 0


def load1() -> float:
    return os.getloadavg()[0]


# -- one configuration, in a fresh process ----------------------------------------------------
def child(spec: dict) -> dict:
    import colibri_core
    from colibri_core.cli.bench import Cgroup, drop_page_cache, prompt_ids

    model = Path(spec["model"])
    workers = spec["workers"]
    options = {"history": False, "ram": spec["coordinator_ram"]}
    groups = []
    if workers:
        import ray

        # one logical CPU per worker; a small object store: the payloads are activations
        ray.init(num_cpus=workers + 1, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 namespace=f"colibri-ray-bench-{os.getpid()}", object_store_memory=256 << 20)
        options.update(compute="ray", compute_options={"workers": workers, "worker_ram": spec["worker_ram"]})
    started = time.perf_counter()
    try:
        with colibri_core.load(model, **options) as m:
            load_s = time.perf_counter() - started
            if workers:
                tier = m.store.compute
                infos = ray.get([w.actor.info.remote(tier._token) for w in tier.workers])
                for info in infos:  # each worker process into its own cgroup before any expert is read
                    group = Cgroup.create(spec["worker_cgroup"])
                    group.add(info["pid"])
                    groups.append(group)
            cache = drop_page_cache(model)
            ids = prompt_ids(m.lm.vocab_size, spec["prompt_tokens"], spec["seed"])
            # the device's reads from the first sampled token to the end: the decode's alone
            first = []
            before, t_start = device_read_bytes(model), time.perf_counter()
            generation = m.stream(token_ids=ids, max_tokens=spec["tokens"], ignore_eos=True,
                                  temperature=spec["temperature"], seed=spec["seed"])
            for _ in generation:
                if not first:
                    first = [device_read_bytes(model), time.perf_counter()]
            disk, wall = device_read_bytes(model) - first[0], time.perf_counter() - first[1]
            result = generation.result()
            s = result.stats
            steps = max(s.generated_tokens - 1, 1)  # decode steps after the first token
            out = {"workers": workers, "load_s": load_s, "cache": cache, "prefill_s": s.prefill_s,
                   "decode_tok_s": s.decode_tok_s, "generated": s.generated_tokens, "decode_wall_s": wall,
                   "device_read_bytes": disk, "device_read_bytes_per_s": disk / wall if wall > 0 else 0.0,
                   # the cold prompt's reads: most experts' first reads, the workers' side by side
                   "prefill_device_bytes": first[0] - before,
                   "prefill_device_bytes_per_s": (first[0] - before) / max(first[1] - t_start, 1e-9),
                   "device_bytes_per_token": disk / steps,
                   "distinct_tokens": len(set(result.token_ids)), "token_ids": result.token_ids,
                   "compute": s.compute, "cgroup_peaks": [g.peak() for g in groups]}
            if workers:
                per = s.compute.get("workers", {})
                out["worker_bytes_read"] = {name: w.get("bytes_read", 0) for name, w in per.items()}
                out["network_bytes_per_token"] = ((s.compute.get("network_bytes_sent", 0)
                                                   + s.compute.get("network_bytes_received", 0))
                                                  / max(s.generated_tokens, 1))  # prefill's included
                out["fallback_requests"] = s.compute.get("fallback_requests", 0)
            return out
    finally:
        if workers:
            ray.shutdown()
        for g in groups:
            for _ in range(50):  # the worker processes leave the cgroup as they exit
                try:
                    g.path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def run_child(spec: dict, cgroup: int | None) -> dict:
    from colibri_core.cli.bench import run_json_child

    result = run_json_child([sys.executable, __file__, "--child", json.dumps(spec)], cgroup=cgroup)
    return {"workers": spec["workers"], **result} if "error" in result else result


# -- the table --------------------------------------------------------------------------------
def main() -> None:
    from colibri_core.units import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path)
    p.add_argument("--workers", default="1,2,3", help="worker counts to run beside the local run")
    p.add_argument("--share", default="1/3",
                   help="each worker's RAM tier: this part of the expert bytes (a number or a fraction like 1/3), or "
                        "'split': 1/N of them for N workers")
    p.add_argument("--overhead", default="1G", help="each cgroup's room beyond its expert budget (Python, Ray)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.model is None or args.out is None:
        p.error("--model and --out are required")
    from streaming_table import disk_bound

    sizes = model_sizes(args.model)
    split = args.share == "split"
    try:
        part = 1.0 if split else float(Fraction(args.share))
    except (ValueError, ZeroDivisionError):
        p.error(f"--share: a number, a fraction (1/3) or 'split', got {args.share!r}")
    if not 0 < part <= 1:
        p.error(f"--share must be in (0, 1], got {args.share}")
    overhead = parse_size(args.overhead)
    counts = [int(n) for n in args.workers.split(",") if n.strip()]
    base = {"model": str(args.model), "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
            "temperature": args.temperature, "seed": args.seed}
    configs = [0] + counts
    runs, bounds = [], []

    def ram_of(n: int) -> int:
        """the expert bytes the RAM tier of one worker of ``n`` (0: the local run) holds"""
        return int(sizes["expert_bytes"] * (part if not split else 1.0 / max(n, 1)))

    print(f"experts {sizes['expert_bytes'] / 2**30:.2f} GiB, dense {sizes['dense_bytes'] / 2**30:.2f} GiB; RAM per "
          "worker " + ", ".join(f"{n} workers: {ram_of(n) / 2**30:.2f} GiB" for n in counts), file=sys.stderr)
    for r in range(args.rounds):
        for threads in (1, 2, 3):
            b = disk_bound(args.model, budget=1 << 30, threads=threads, seed=args.seed + r)
            b.update(round=r, load1=load1())
            bounds.append(b)
            print(f"round {r}: disk bound {threads} reader(s) {b['bytes_per_s'] / 1e6:.0f} MB/s", file=sys.stderr)
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for n in order:
            # the local run: the coordinator's own RAM tier holds the experts; for the ray runs
            # it holds the dense weights only (its store serves fallbacks alone)
            share = ram_of(n)
            spec = dict(base, workers=n, worker_ram=share, worker_cgroup=share + overhead,
                        coordinator_ram=sizes["dense_bytes"] + (share if n == 0 else 0) + (64 << 20))
            cg = sizes["dense_bytes"] + share + overhead if n == 0 else None
            before = load1()
            res = run_child(spec, cg)
            res.update(round=r, load1=before)
            runs.append(res)
            label = "local" if n == 0 else f"{n} worker(s)"
            if "error" in res:
                print(f"round {r}: {label}: {res['error']}", file=sys.stderr)
            else:
                print(f"round {r}: {label}: {res['decode_tok_s']:.2f} tok/s, disk "
                      f"{res['device_read_bytes_per_s'] / 1e6:.0f} MB/s, {res['device_bytes_per_token'] / 1e6:.1f} "
                      f"MB/token", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"sizes": sizes, "share": args.share, "worker_ram": {n: ram_of(n) for n in configs}, "overhead_bytes": overhead, "spec": base, "runs": runs,
              "disk_bounds": bounds, "cpus": os.cpu_count()}
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(args.out.with_suffix(".json"))
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = ["| round | config | load1 | prefill s | prefill disk MB/s | decode tok/s | decode disk MB/s | MB read / token "
             "| network KiB / token | fallbacks | tokens = local |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    local = {r["round"]: r.get("token_ids") for r in report["runs"] if r["workers"] == 0}
    for r in report["runs"]:
        label = "local" if r["workers"] == 0 else f"{r['workers']} workers"
        if "error" in r:
            lines.append(f"| {r['round']} | {label} | {r['load1']:.2f} | {r['error']} | | | | | | | |")
            continue
        net = f"{r['network_bytes_per_token'] / 1024:.0f}" if r["workers"] else "-"
        same = "-" if r["workers"] == 0 else ("yes" if r.get("token_ids") == local.get(r["round"]) else "NO")
        lines.append(f"| {r['round']} | {label} | {r['load1']:.2f} | {r['prefill_s']:.2f} | "
                     f"{r['prefill_device_bytes_per_s'] / 1e6:.0f} | {r['decode_tok_s']:.2f} | "
                     f"{r['device_read_bytes_per_s'] / 1e6:.0f} | {r['device_bytes_per_token'] / 1e6:.1f} | {net} | "
                     f"{r.get('fallback_requests', '-')} | {same} |")
    lines += ["", "| config | median prefill disk MB/s | median decode tok/s | median decode disk MB/s | decode x local |",
              "|---|---|---|---|---|"]
    med = {}
    for n in sorted({r["workers"] for r in report["runs"]}):
        ok = [r for r in report["runs"] if r["workers"] == n and "error" not in r]
        if ok:
            med[n] = (statistics.median(r["prefill_device_bytes_per_s"] for r in ok),
                      statistics.median(r["decode_tok_s"] for r in ok),
                      statistics.median(r["device_read_bytes_per_s"] for r in ok))
    for n, (pre, tok, disk) in med.items():
        ratio = f"{tok / med[0][1]:.2f}" if 0 in med and med[0][1] else "-"
        lines.append(f"| {'local' if n == 0 else f'{n} workers'} | {pre / 1e6:.0f} | {tok:.2f} | {disk / 1e6:.0f} | {ratio} |")
    lines += ["", "| readers | median disk bound MB/s (O_DIRECT, whole experts) |", "|---|---|"]
    for t in sorted({b["threads"] for b in report["disk_bounds"]}):
        lines.append(f"| {t} | {statistics.median(b['bytes_per_s'] for b in report['disk_bounds'] if b['threads'] == t) / 1e6:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
