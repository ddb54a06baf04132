"""GET /metrics in the Prometheus text format: the server's own counts (requests by
route and status, time to first token, generations failed by unreadable weight files)
and, read at each scrape, the scheduler's (queue depth, active slots, tokens/s, prefix
reuse, expert hits per tier, bytes read)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# scheduler stats exported as they are: (name, kind, help)
STATS = [
    ("queue_depth", "gauge", "Requests waiting for a slot"),
    ("active", "gauge", "Requests holding a slot"),
    ("slots", "gauge", "Slots (requests decoded together)"),
    ("max_queue", "gauge", "Requests that may wait before 429"),
    ("decode_tok_s", "gauge", "Aggregate decode tokens per second, recent"),
    ("ttft_s", "gauge", "Median time to first token of recent requests, seconds"),
    ("kv_budget_bytes", "gauge", "KV cache budget"),
    ("kv_reserved_bytes", "gauge", "KV cache reserved by admitted requests"),
    ("kv_bytes", "gauge", "KV cache allocated (active requests and retained prefixes)"),
    ("prefixes_retained", "gauge", "Finished prompts kept for prefix reuse"),
    ("requests_total", "counter", "Requests submitted to the engine"),
    ("tokens_total", "counter", "Tokens generated"),
    ("steps", "counter", "Engine steps"),
    ("prefix_hits_tokens", "counter", "Prompt tokens whose prefill prefix reuse skipped"),
    ("prefill_tokens", "counter", "Prompt tokens prefilled"),
    ("kv_disk_bytes", "gauge", "Bytes of prompt prefixes kept on disk (serve --kv-disk)"),
    ("kv_disk_files", "gauge", "Prompt prefixes kept on disk"),
    ("kv_disk_hit_tokens", "counter", "Prompt tokens whose prefill a prefix read from disk skipped"),
    ("kv_disk_writes", "counter", "Prompt prefixes written to disk"),
    ("kv_disk_evictions", "counter", "Prompt prefixes removed from disk for room"),
    ("kv_disk_errors", "counter", "Prefix files that could not be written or read (a damaged file is removed)"),
    ("reads", "counter", "Expert reads from disk"),
    ("prefetch_issued", "counter", "Experts read ahead"),
    ("prefetch_unused", "counter", "Experts read ahead and not used"),
    ("prefetch_skipped", "counter", "Predicted expert reads not issued (recent ones did not pay, or the step ran without)"),
    ("prefetch_steps_off", "counter", "Steps the measured prefetch gate ran without reading ahead"),
]
# expert lookups by where they were served from
LOOKUPS = [("hits_device", "device"), ("hits_pinned", "ram_pinned"), ("hits_lru", "ram_lru"),
           ("hits_prefetched", "prefetched"), ("misses", "disk")]


class Metrics:
    def __init__(self, service_stats):
        self.registry = CollectorRegistry()
        self.requests = Counter("colibri_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.read_errors = Counter("colibri_weight_read_errors", "Generations failed because a weight file could not be read",
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
        for key, kind, text in STATS:
            value = stats.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                name = f"colibri_{key.removesuffix('_total')}"
                yield (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, text, value=value)
        lookups = CounterMetricFamily("colibri_expert_lookups", "Routed-expert lookups by the tier that served them", labels=["tier"])
        for key, tier in LOOKUPS:
            lookups.add_metric([tier], stats.get(key, 0))
        yield lookups
        read = CounterMetricFamily("colibri_expert_bytes_read", "Expert bytes read from disk, by drive", labels=["drive"])
        for drive, n in sorted((stats.get("bytes_by_drive") or {}).items()):
            read.add_metric([str(drive)], n)
        yield read
        if isinstance(stats.get("read_wait_ns"), int):
            yield CounterMetricFamily("colibri_expert_read_wait_seconds",
                                      "Time the engine's computation spent blocked on expert reads",
                                      value=stats["read_wait_ns"] / 1e9)
