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

``--throttle MB/s`` (issue #44, SIMULATED scale-out on one machine): each worker process
also joins its own cgroup v1 ``blkio`` group whose reads from the checkpoint's disk the
kernel limits to that rate (``blkio.throttle.read_bps_device``, real throttling of the
real disk), standing for a machine of its own with a drive of that speed. The workers
own disjoint experts and every read is a disk read (the disk tier drops what it read
from the page cache), so N workers are N throttled read paths side by side. The local
run stays unthrottled (the token reference, and the whole disk's figure); it joins an
unlimited blkio group so its reads are counted the same way. Recorded per run: each
group's read bytes over the decode (the kernel's count), their sum per second (the
aggregate read rate) and its efficiency against N x the throttle; the disk bound is
measured for 1..max(3, N) readers. Beside it, a model of what a synchronous fan-out
allows: each layer waits for its busiest worker, experts drawn uniformly (top-k of the
layer's experts, the real placement), efficiency = (top-k / N) / E[busiest worker's experts]. What is simulated: the machines (the workers share
two cores, one disk and one kernel) and their drives (a rate limit, not a device).

Writes OUT.json (every run) and OUT.md (runs, then medians per configuration).

    python benchmarks/ray_bench.py --model /data/olmoe-full-int4 --workers 1,2,3 --rounds 3 \\
        --tokens 32 --out /data/ray-18
    python benchmarks/ray_bench.py --model /data/olmoe-full --workers 1,2,3,4 --share 1/64 --throttle 200 \\
        --rounds 3 --tokens 8 --prompt-tokens 2 --out /data/scaleout
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

from hostinfo import cpu_name  # noqa: E402


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
                "experts_per_layer": bp.experts_per_layer, "top_k": int(bp.top_k)}
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


BLKIO_V1 = Path("/sys/fs/cgroup/blkio")


def whole_disk(path: Path) -> tuple[int, int]:
    """(major, minor) of the disk holding ``path``: blk-throttle limits whole disks, not partitions."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    node = Path(f"/sys/dev/block/{major}:{minor}")
    if (node / "partition").exists():
        major, minor = (int(v) for v in (node.resolve().parent / "dev").read_text().split(":"))
    return major, minor


class ReadThrottle:
    """A cgroup v1 blkio group: the kernel limits its processes' reads from one disk to
    ``bytes_per_s`` (None: no limit, the group only counts) and counts the bytes read."""

    def __init__(self, path: Path, device: tuple[int, int], bytes_per_s: int | None):
        self.path, self.device, self.bytes_per_s = path, device, bytes_per_s

    @staticmethod
    def unavailable() -> str | None:
        """None when throttles can be made here, else why not (one line)."""
        if not (BLKIO_V1 / "blkio.throttle.read_bps_device").exists():
            return ("--throttle needs cgroup v1 blkio throttling (/sys/fs/cgroup/blkio/blkio.throttle.read_bps_device); "
                    "cgroup v2's io.max is not supported by this script")
        if not os.access(BLKIO_V1, os.W_OK):
            return "--throttle needs write access to /sys/fs/cgroup/blkio (root)"
        return None

    @classmethod
    def create(cls, on: Path, bytes_per_s: int | None) -> "ReadThrottle":
        device = whole_disk(on)
        path = BLKIO_V1 / f"colibri-bench-{os.getpid()}-{time.monotonic_ns()}"
        path.mkdir()
        if bytes_per_s is not None:
            (path / "blkio.throttle.read_bps_device").write_text(f"{device[0]}:{device[1]} {int(bytes_per_s)}")
        return cls(path, device, bytes_per_s)

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))  # the whole process, every thread

    def bytes_read(self) -> int:
        """Bytes this group's processes read from the disk, as the kernel's throttle counted them."""
        want = f"{self.device[0]}:{self.device[1]}"
        for line in (self.path / "blkio.throttle.io_service_bytes").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == want and parts[1] == "Read":
                return int(parts[2])
        return 0

    def remove(self, wait_s: float = 5.0) -> None:
        """Remove the group once its processes have left or exited (this process is moved out)."""
        try:
            if str(os.getpid()) in (self.path / "cgroup.procs").read_text().split():
                (BLKIO_V1 / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            pass
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.1)


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
    throttled = "throttle_bps" in spec  # --throttle: every process's disk reads in a blkio group of its own
    reads: list[ReadThrottle] = []
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
                    if throttled:  # its own read path at the throttle's rate
                        reads.append(ReadThrottle.create(model, spec["throttle_bps"]))
                        reads[-1].add(info["pid"])
            elif throttled:  # the local run: the whole disk, its reads counted alike
                reads.append(ReadThrottle.create(model, None))
                reads[-1].add(os.getpid())
            cache = drop_page_cache(model)
            ids = prompt_ids(m.lm.vocab_size, spec["prompt_tokens"], spec["seed"])
            # the device's reads from the first sampled token to the end: the decode's alone
            first = []
            before, t_start = device_read_bytes(model), time.perf_counter()
            generation = m.stream(token_ids=ids, max_tokens=spec["tokens"], ignore_eos=True,
                                  temperature=spec["temperature"], seed=spec["seed"])
            for _ in generation:
                if not first:
                    first = [device_read_bytes(model), time.perf_counter(), [g.bytes_read() for g in reads]]
            disk, wall = device_read_bytes(model) - first[0], time.perf_counter() - first[1]
            group_reads = [g.bytes_read() - b for g, b in zip(reads, first[2])]
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
            if throttled:  # the kernel's count of each process's reads over the decode
                out["group_read_bytes"] = group_reads
                out["aggregate_read_bytes_per_s"] = sum(group_reads) / wall if wall > 0 else 0.0
                out["group_read_bytes_per_token"] = sum(group_reads) / steps
                out["throttle_bps"] = spec["throttle_bps"] if workers else None
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
            for _ in range(300):  # the worker processes leave the cgroup as they exit (seconds, under load)
                try:
                    g.path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        for r in reads:  # the same processes: a worker may take seconds to exit
            r.remove(wait_s=30.0)


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
    p.add_argument("--throttle", type=float, default=None, metavar="MB/s",
                   help="SIMULATED scale-out: each worker's disk reads limited by the kernel to this many MB/s "
                        "(10^6 bytes; its own cgroup v1 blkio group), as if on a machine of its own")
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
    throttle = None
    if args.throttle is not None:
        if args.throttle <= 0:
            p.error(f"--throttle must be more than 0 MB/s, got {args.throttle:g}")
        why = ReadThrottle.unavailable()
        if why:
            p.error(why)
        throttle = int(args.throttle * 1e6)
        base["throttle_bps"] = throttle
    command = " ".join(["python", "benchmarks/ray_bench.py", *sys.argv[1:]])
    print(f"measuring: {command}", file=sys.stderr)
    started_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    configs = [0] + counts
    runs, bounds = [], []

    def ram_of(n: int) -> int:
        """the expert bytes the RAM tier of one worker of ``n`` (0: the local run) holds"""
        return int(sizes["expert_bytes"] * (part if not split else 1.0 / max(n, 1)))

    print(f"experts {sizes['expert_bytes'] / 2**30:.2f} GiB, dense {sizes['dense_bytes'] / 2**30:.2f} GiB; RAM per "
          "worker " + ", ".join(f"{n} workers: {ram_of(n) / 2**30:.2f} GiB" for n in counts), file=sys.stderr)
    for r in range(args.rounds):
        for threads in range(1, max([3, *counts]) + 1):
            b = disk_bound(args.model, budget=1 << 30, threads=threads, seed=args.seed + r)
            b.update(round=r, load1=load1())
            bounds.append(b)
            print(f"round {r}: disk bound {threads} reader(s) {b['bytes_per_s'] / 1e6:.0f} MB/s", file=sys.stderr)
            if throttle and threads in counts and threads * throttle >= b["bytes_per_s"]:
                print(f"round {r}: WARNING {threads} x --throttle is not below the disk bound for {threads} readers: "
                      "the disk, not the throttle, limits that configuration", file=sys.stderr)
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for n in order:
            # the local run: the coordinator's own RAM tier holds the experts; for the ray runs
            # it holds the dense weights only (its store serves fallbacks alone)
            share = ram_of(n)
            # the coordinator's plan needs room for one layer's experts being read (its fallback's)
            reading = max(64 << 20, sizes["top_k"] * sizes["expert_ram_bytes"] + (16 << 20))
            spec = dict(base, workers=n, worker_ram=share, worker_cgroup=share + overhead,
                        coordinator_ram=sizes["dense_bytes"] + (share if n == 0 else 0) + reading)
            cg = sizes["dense_bytes"] + share + overhead if n == 0 else None
            before = load1()
            res = run_child(spec, cg)
            res.update(round=r, load1=before)
            runs.append(res)
            label = "local" if n == 0 else f"{n} worker(s)"
            if "error" in res:
                print(f"round {r}: {label}: {res['error']}", file=sys.stderr)
            else:
                agg = (f", processes' reads {res['aggregate_read_bytes_per_s'] / 1e6:.0f} MB/s"
                       if "aggregate_read_bytes_per_s" in res else "")
                print(f"round {r}: {label}: {res['decode_tok_s']:.2f} tok/s, disk "
                      f"{res['device_read_bytes_per_s'] / 1e6:.0f} MB/s, {res['device_bytes_per_token'] / 1e6:.1f} "
                      f"MB/token{agg}", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"command": command, "started": started_at, "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "cpu": cpu_name(), "sizes": sizes, "share": args.share, "worker_ram": {n: ram_of(n) for n in configs},
              "overhead_bytes": overhead, "spec": base, "runs": runs, "disk_bounds": bounds, "cpus": os.cpu_count()}
    if throttle:
        report["throttle_bytes_per_s"] = throttle
        report["simulation"] = SIMULATION
        report["busiest_worker_model"] = {n: busiest_worker_efficiency(n, sizes, seed=args.seed) for n in counts}
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(args.out.with_suffix(".json"))
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


SIMULATION = ("SIMULATION: the workers are processes on one machine (shared cores, one disk, one kernel) standing "
              "for machines of their own; each one's drive is simulated by a kernel read limit (cgroup v1 blkio "
              "throttle on the real disk) of the throttle's rate. The reads are real disk reads; the machines and their "
              "drives are not.")


def busiest_worker_efficiency(workers: int, sizes: dict, *, samples: int = 20000, seed: int = 0) -> float:
    """A model, not a measurement: the share of N x throttle that N workers can read when
    each MoE layer waits for its busiest worker (a layer's requests go out together and the
    next layer needs all answers), each token's top-k experts drawn uniformly from the
    layer's, owned as colibri-ray places them (equal budgets). 1.0 for one worker."""
    import random

    from colibri_ray.placement import assign

    owners = assign([sizes["experts_per_layer"]] * sizes["moe_layers"],
                    [(f"worker-{i}", 1.0) for i in range(workers)])
    rng, busiest = random.Random(seed), 0
    for _ in range(samples):
        layer = rng.randrange(sizes["moe_layers"])
        loads = [0] * workers
        for e in rng.sample(range(sizes["experts_per_layer"]), sizes["top_k"]):
            loads[owners[layer][e]] += 1
        busiest += max(loads)
    return sizes["top_k"] / workers / (busiest / samples)


def completed_runs(report: dict) -> dict[int, list[dict]]:
    """The runs that did not fail, by worker count (0: the local run), fewest workers
    first; a count none of whose runs completed is left out."""
    by_workers: dict[int, list[dict]] = {}
    for r in sorted(report["runs"], key=lambda r: r["workers"]):
        if "error" not in r:
            by_workers.setdefault(r["workers"], []).append(r)
    return by_workers


def markdown(report: dict) -> str:
    head = []
    if "command" in report:
        head = [f"`{report['command']}`", "",
                f"{report['started']} - {report['finished']}, {report['cpu']}, {report['cpus']} CPUs, page cache "
                "dropped before each run's prompt (cold).", ""]
    if "throttle_bytes_per_s" in report:
        head += [f"**{report['simulation']}**", "", throttle_table(report), ""]
    lines = head + ["| round | config | load1 | prefill s | prefill disk MB/s | decode tok/s | decode disk MB/s | MB read / token "
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
    med = {n: (statistics.median(r["prefill_device_bytes_per_s"] for r in ok),
               statistics.median(r["decode_tok_s"] for r in ok),
               statistics.median(r["device_read_bytes_per_s"] for r in ok))
           for n, ok in completed_runs(report).items()}
    for n, (pre, tok, disk) in med.items():
        ratio = f"{tok / med[0][1]:.2f}" if 0 in med and med[0][1] else "-"
        lines.append(f"| {'local' if n == 0 else f'{n} workers'} | {pre / 1e6:.0f} | {tok:.2f} | {disk / 1e6:.0f} | {ratio} |")
    lines += ["", "| readers | median disk bound MB/s (O_DIRECT, whole experts) |", "|---|---|"]
    for t in sorted({b["threads"] for b in report["disk_bounds"]}):
        lines.append(f"| {t} | {statistics.median(b['bytes_per_s'] for b in report['disk_bounds'] if b['threads'] == t) / 1e6:.0f} |")
    return "\n".join(lines) + "\n"


def throttle_table(report: dict) -> str:
    """--throttle: per configuration, medians of the aggregate read rate (the kernel's count of
    every process's reads over the decode) against N x the throttle and the disk's bound."""
    rate = report["throttle_bytes_per_s"]
    bound = {t: statistics.median(b["bytes_per_s"] for b in report["disk_bounds"] if b["threads"] == t)
             for t in {b["threads"] for b in report["disk_bounds"]}}
    local = {r["round"]: r.get("token_ids") for r in report["runs"] if r["workers"] == 0}
    lines = ["| config | throttle / worker MB/s | N x throttle MB/s | disk bound, N readers MB/s | median decode tok/s "
             "| x 1 worker | median aggregate read MB/s | efficiency vs N x throttle | model: busiest worker per layer "
             "| each worker MB/s (min-max, all runs) | MB read / token | runs | tokens = local |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    model = {int(n): e for n, e in report.get("busiest_worker_model", {}).items()}
    med = {n: (statistics.median(r["decode_tok_s"] for r in ok),
               statistics.median(r["aggregate_read_bytes_per_s"] for r in ok),
               statistics.median(r["group_read_bytes_per_token"] for r in ok), len(ok),
               all(r.get("token_ids") == local.get(r["round"]) for r in ok),
               [b / r["decode_wall_s"] for r in ok for b in r["group_read_bytes"]])
           for n, ok in completed_runs(report).items()}
    for n, (tok, agg, per_token, count, same, each) in med.items():
        if n == 0:
            lines.append(f"| local (whole disk) | - | - | {bound[1] / 1e6:.0f} | {tok:.2f} | - | {agg / 1e6:.0f} | - | - | "
                         f"- | {per_token / 1e6:.1f} | {count} | - |")
            continue
        one = f"{tok / med[1][0]:.2f}" if 1 in med and med[1][0] else "-"
        lines.append(f"| {n} workers | {rate / 1e6:.0f} | {n * rate / 1e6:.0f} | "
                     f"{bound[n] / 1e6:.0f} | {tok:.2f} | {one} | {agg / 1e6:.0f} | {agg / (n * rate):.0%} | "
                     f"{f'{model[n]:.0%}' if n in model else '-'} | {min(each) / 1e6:.0f}-{max(each) / 1e6:.0f} | "
                     f"{per_token / 1e6:.1f} | {count} | {'yes' if same else 'NO'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
