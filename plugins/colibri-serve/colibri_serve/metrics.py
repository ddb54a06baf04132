"""GET /metrics in the Prometheus text format: the server's own counts (requests by
route and status, time to first token) and, read at each scrape, the scheduler's
(queue depth, active slots, tokens/s, prefix reuse, expert hits per tier, bytes read)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# scheduler stats that only grow (counters); every other number is a gauge
COUNTERS = {"requests_total", "tokens_total", "prefix_hits_tokens", "hits_device", "hits_pinned", "hits_lru", "hits_ram",
            "hits_prefetched", "misses", "reads", "prefetch_issued", "prefetch_unused", "host_syncs", "repins"}


class Metrics:
    def __init__(self, service_stats):
        self.registry = CollectorRegistry()
        self.requests = Counter("colibri_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.ttft = Histogram("colibri_time_to_first_token_seconds", "From queueing a request to its first token",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=self.registry)
        self.registry.register(_SchedulerCollector(service_stats))


class _SchedulerCollector:
    def __init__(self, stats):
        self.stats = stats  # () -> dict or None while loading

    def collect(self):
        stats = self.stats()
        ready = GaugeMetricFamily("colibri_model_ready", "1 once the model is loaded")
        ready.add_metric([], 0 if stats is None else 1)
        yield ready
        if stats is None:
            return
        for key, value in sorted(stats.items()):
            if key == "bytes_by_drive" and isinstance(value, dict):
                family = CounterMetricFamily("colibri_expert_bytes_read", "Expert bytes read from disk, by drive", labels=["drive"])
                for drive, n in sorted(value.items()):
                    family.add_metric([str(drive)], n)
                yield family
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            elif key in COUNTERS or key.endswith("_total"):
                yield CounterMetricFamily(f"colibri_{key.removesuffix('_total')}", f"scheduler {key}", value=value)
            else:
                yield GaugeMetricFamily(f"colibri_{key}", f"scheduler {key}", value=value)
