"""``colibri plan --ray ...``: the experts of each worker, the network bytes per token
and the projected bottleneck (network, disk or compute), before anything is started.

Each worker's RAM budget is ``--ray-worker-ram`` when given, else 80% of the memory
available on the nodes of the cluster (``--ray ADDRESS``: asked of Ray, workers spread
over the nodes) or of this machine (``--ray local``), shared by the workers placed
there. Per decoded token and MoE layer the coordinator sends each worker owning one of
the token's top-k experts its activations (hidden x 4 bytes, plus the expert ids and
row indices) and gets back one output row per expert (hidden x 4 bytes); all workers
are asked at once, so a layer costs one round trip. Disk: a worker whose budget holds
its whole shard reads nothing once warm; otherwise its per-layer LRU misses (Che's
approximation, uniform routing: an estimate). Network bandwidth and round-trip time are
assumptions (``NETWORK_BW``, ``ROUND_TRIP_S``); the run measures the real bytes
(``GenerationStats.compute``)."""

from __future__ import annotations

NETWORK_BW = 1.25e9  # bytes/s: 10 Gbit/s Ethernet (assumed, not measured)
ROUND_TRIP_S = 2e-4  # seconds per request round trip within a rack, Ray's overhead included (assumed)
INDEX_BYTES = 8


def _budgets(options: dict) -> list[tuple[str, int]]:
    """(host, RAM budget) of each worker."""
    from colibri_core.model.placement import available_memory

    n = options["workers"]
    if options.get("worker_ram") is not None:
        return [("?", int(options["worker_ram"]))] * n
    if options["address"] == "local":
        return [("this machine", int(0.8 * available_memory() / n))] * n
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(address=options["address"], include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        nodes = [node for node in ray.nodes() if node.get("Alive")]
    finally:
        if started:
            ray.shutdown()
    if not nodes:
        return [("?", int(0.8 * available_memory() / n))] * n
    hosts = [nodes[i % len(nodes)] for i in range(n)]  # SPREAD scheduling: round robin over the nodes
    share = {id(node): hosts.count(node) for node in hosts}
    return [(node.get("NodeManagerAddress", "?"), int(0.8 * node.get("Resources", {}).get("memory", 0) / share[id(node)]))
            for node in hosts]


def ray_plan(bp, report: dict, options: dict) -> list[tuple[str, str]]:
    from colibri_core.cli.plan import lru_hit_rate
    from colibri_core.units import format_bytes

    import numpy as np

    from colibri_ray.placement import assign

    budgets = _budgets(options)
    names = [(f"worker-{i}", float(b)) for i, (_, b) in enumerate(budgets)]
    moe, k = bp.moe, max(1, bp.top_k)
    owners = assign([d.count for d in moe], names)
    hidden = int(bp.lm.embed.weight.shape[-1])
    expert_bytes, disk_bytes = bp.expert_ram_bytes, bp.expert_disk_bytes
    layers = len(moe)
    workers = []
    sent = received = 0.0
    disk_s = 0.0
    disk_bw = report.get("disk_bandwidth") or 1e9
    for i, (host, budget) in enumerate(budgets):
        owned = [sum(1 for o in row if o == i) for row in owners]
        total = sum(owned)
        slots = budget // max(1, expert_bytes * max(1, layers))
        per_token_experts = per_token_requests = misses = 0.0
        for layer, n in enumerate(owned):
            count = moe[layer].count
            share = n / count if count else 0.0
            per_token_experts += k * share
            per_token_requests += 1 - (1 - share) ** min(k, count)
            if n and slots < n:  # the LRU of its own experts of this layer, uniform routing
                misses += k * share * (1 - lru_hit_rate(np.full(n, 1.0 / n), int(slots)))
        worker_sent = per_token_requests * (hidden * 4 + 3 * INDEX_BYTES) + per_token_experts * INDEX_BYTES
        worker_received = per_token_experts * hidden * 4
        sent, received = sent + worker_sent, received + worker_received
        disk_s = max(disk_s, misses * disk_bytes / disk_bw)  # the workers read in parallel
        workers.append({"name": f"worker-{i}", "host": host, "ram_budget": budget, "experts": total,
                        "experts_by_layer": owned, "shard_bytes": total * expert_bytes,
                        "holds_shard": budget >= total * expert_bytes, "requests_per_token": per_token_requests,
                        "network_bytes_per_token": worker_sent + worker_received, "disk_misses_per_token": misses})
    network_s = layers * ROUND_TRIP_S + (sent + received) / NETWORK_BW
    local = report.get("seconds_per_token", {}).get("compute", 0.0)
    experts_s = layers * (report.get("top_k_experts_seconds") or 0.0)
    # the experts' work spread over the workers; the dense layers stay on the coordinator
    compute_s = max(0.0, local - experts_s) + experts_s / max(1, len(budgets))
    costs = {"network": network_s, "disk": disk_s, "compute": compute_s}
    bottleneck = max(costs, key=costs.get)
    report["ray"] = {"workers": workers, "network_bytes_per_token": sent + received, "network_bandwidth": NETWORK_BW,
                     "round_trip_s": ROUND_TRIP_S, "seconds_per_token": costs, "bottleneck": bottleneck,
                     "projected_decode_tok_s": 1 / sum(costs.values()) if sum(costs.values()) > 0 else None}
    rows = [("ray workers", f"{len(budgets)}, experts by weighted rendezvous hashing over their RAM budgets")]
    for w in workers:
        rows.append((f"  {w['name']}", f"{w['host']}: {w['experts']} experts ({format_bytes(w['shard_bytes'])}), budget "
                                       f"{format_bytes(w['ram_budget'])} ({'holds its shard' if w['holds_shard'] else 'LRU'}"
                                       f"), {w['requests_per_token']:.1f} requests and "
                                       f"{format_bytes(w['network_bytes_per_token'])} per token"))
    rows += [("ray network per token", f"{format_bytes(sent + received)} ({format_bytes(sent)} out, {format_bytes(received)} "
                                       f"back) at an assumed {format_bytes(NETWORK_BW)}/s, {layers} round trips"),
             ("ray seconds per token", ", ".join(f"{key} {v:.4f}" for key, v in costs.items())),
             ("ray bottleneck", bottleneck)]
    return rows
