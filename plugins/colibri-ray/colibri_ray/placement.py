"""Which worker owns which expert: weighted rendezvous hashing of (layer, expert) over
the workers, weighted by each worker's RAM budget. Deterministic (the same workers and
budgets give the same shards on every run), each worker gets a share of the experts
proportional to its RAM, and a worker joining or leaving moves only its own share."""

from __future__ import annotations

import hashlib
import math


def owner(layer: int, expert: int, workers: list[tuple[str, float]]) -> int:
    """The index in ``workers`` ((name, weight) pairs) of the worker owning the expert."""
    best, best_score = 0, -math.inf
    for i, (name, weight) in enumerate(workers):
        digest = hashlib.blake2b(f"{name}\0{layer}:{expert}".encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "big") + 0.5) / 2**64  # uniform in (0, 1)
        score = max(float(weight), 1.0) / -math.log(u)
        if score > best_score:
            best, best_score = i, score
    return best


def assign(experts_per_layer: list[int], workers: list[tuple[str, float]]) -> list[list[int]]:
    """owners[layer][expert] -> worker index, for every MoE layer's experts."""
    return [[owner(layer, e, workers) for e in range(n)] for layer, n in enumerate(experts_per_layer)]
