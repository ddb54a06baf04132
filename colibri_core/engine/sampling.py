"""Choosing the next token: greedy, or temperature with top-k and top-p, seeded.

The filters run in the order transformers applies them (temperature, top-k, top-p), so a
setting means the same thing in both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_core.errors import ColibriError, UsageError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise UsageError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise UsageError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        # in place on one float64 copy: every fresh vocabulary-sized temporary (~400 KB)
        # costs page faults, which dominated sampling when each step made a new one
        scores = logits.astype(np.float64)
        scores /= p.temperature
        if p.top_k and p.top_k < scores.size:
            kth = np.partition(scores, -p.top_k)[-p.top_k]
            scores[scores < kth] = -np.inf
        scores -= scores.max()
        probs = np.exp(scores, out=scores)
        if p.top_p < 1.0:
            probs /= probs.sum()
            order = np.argsort(-probs, kind="stable")
            cumulative = np.cumsum(probs[order])
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = cumulative - probs[order] < p.top_p
            mask = np.zeros_like(probs, dtype=bool)
            mask[order[keep]] = True
            probs = np.where(mask, probs, 0.0)
        return draw(probs, self.rng.random())


BLOCK = 1024  # inverse-CDF draws sum blocks of this many probabilities first


def draw(weights: np.ndarray, u: float) -> int:
    """The first index whose running sum of ``weights`` (non-negative, not necessarily
    normalised) exceeds u (in [0, 1)) times their total: inverse-CDF sampling, as numpy's
    ``Generator.choice`` does, but with the running sum taken over block totals and then
    inside one block: a cumulative sum over a whole 50k-150k vocabulary cost more than the
    rest of sampling together."""
    full = weights.size // BLOCK * BLOCK
    totals = weights[:full].reshape(-1, BLOCK).sum(axis=1)
    if full < weights.size:
        totals = np.append(totals, weights[full:].sum())
    running = np.cumsum(totals)
    if not (np.isfinite(running[-1]) and running[-1] > 0):
        raise ColibriError(f"cannot sample: the next-token scores sum to {running[-1]} (NaN or infinite logits?)")
    target = u * running[-1]
    b = int(np.searchsorted(running, target, side="right"))
    if b >= running.size:  # u * total rounded up to the total: the last block that can be drawn
        b = int(np.flatnonzero(totals)[-1])
    block = weights[b * BLOCK : (b + 1) * BLOCK]
    inside = np.cumsum(block) + (running[b - 1] if b else 0.0)
    i = int(np.searchsorted(inside, target, side="right"))
    if i >= block.size or block[i] == 0:  # rounding put target at the block's end: its last token that can be drawn
        i = int(np.flatnonzero(block)[-1])
    return b * BLOCK + i
