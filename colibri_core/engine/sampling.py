"""Choosing the next token: greedy, or temperature with top-k and top-p, seeded.

The filters run in the order transformers applies them (temperature, top-k, top-p), so a
setting means the same thing in both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_core.errors import ColibriError, UsageError, option

MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None

    def __post_init__(self):
        if not _is_number(self.temperature) or not 0 <= self.temperature < float("inf"):
            raise UsageError(f"{option('temperature')} must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise UsageError(f"{option('top_p')} must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise UsageError(f"{option('top_k')} must be an integer >= 0 (0 = no limit), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise UsageError(f"{option('seed')} must be an integer from 0 to 2**64 - 1, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_max_tokens(max_tokens) -> None:
    if not _is_int(max_tokens) or max_tokens < 0:
        raise UsageError(f"{option('max_tokens')} must be an integer >= 0, got {max_tokens!r}")


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
        # the maximum goes first: divided by a tiny temperature (5e-324 is a valid one)
        # the scores would overflow to +inf, and inf - inf is NaN
        scores -= scores.max()
        with np.errstate(over="ignore"):  # -inf is the intended result of such a division
            scores /= p.temperature
        if p.top_k and p.top_k < scores.size:
            kth = np.partition(scores, -p.top_k)[-p.top_k]
            scores[scores < kth] = -np.inf
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
