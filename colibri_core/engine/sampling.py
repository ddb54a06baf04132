"""Choosing the next token: greedy, or temperature with top-k and top-p, seeded; with
OpenAI's logit bias and frequency / presence penalties, and log-probabilities.

The filters run in the order transformers applies them (temperature, top-k, top-p), so a
setting means the same thing in both. Before them, the logits are adjusted as OpenAI
documents: ``logit_bias`` is added by token id, and every token already generated in this
completion loses ``frequency_penalty * count + presence_penalty``.

Log-probabilities are the log-softmax of those adjusted logits, before temperature, top-k
and top-p: the model's distribution as the bias and penalties left it, so that a
temperature (or greedy decoding) does not change them. OpenAI's logprobs behave so: they
do not move with the temperature, and the logit-bias attacks on its API (Carlini et al.,
2024) relied on a bias moving them. vLLM offers either side of this: ``raw_logprobs`` (its
default, before the bias and penalties too) and ``processed_logprobs`` (after the
temperature too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from colibri_core.errors import ColibriError, UsageError, option

MAX_SEED = 2**64 - 1
MAX_LOGPROBS = 20  # most likely alternatives reported per token, as OpenAI's top_logprobs
MAX_PENALTY = 2.0  # OpenAI's range for frequency_penalty and presence_penalty: [-2, 2]
MAX_BIAS = 100.0  # OpenAI's range for a logit bias: [-100, 100]


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the ``logprobs`` most likely tokens' (token
    id, log-probability), most likely first (ties: lower id first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no limit
    seed: int | None = None
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated
    presence_penalty: float = 0.0  # subtracted from every token generated at least once
    logit_bias: Mapping[int, float] | None = field(default=None, hash=False)  # token id -> added to its logit
    logprobs: int | None = None  # None: none; N: each token's log-probability and the N most likely

    def __post_init__(self):
        if not _is_number(self.temperature) or not 0 <= self.temperature < float("inf"):
            raise UsageError(f"{option('temperature')} must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise UsageError(f"{option('top_p')} must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise UsageError(f"{option('top_k')} must be an integer >= 0 (0 = no limit), got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise UsageError(f"{option('seed')} must be an integer from 0 to 2**64 - 1, got {self.seed!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise UsageError(f"{option(name)} must be a number from -2 to 2, got {value!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise UsageError(f"{option('logprobs')} must be an integer from 0 to {MAX_LOGPROBS} (the most likely tokens "
                             f"reported besides the chosen one) or None, got {self.logprobs!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise UsageError(f"{option('logit_bias')} must map token ids to biases, got {self.logit_bias!r}")
            bias = {}
            for token, value in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise UsageError(f"{option('logit_bias')}: token ids are integers >= 0, got {token!r}")
                if not _is_number(value) or not -MAX_BIAS <= value <= MAX_BIAS:
                    raise UsageError(f"{option('logit_bias')}: the bias of token {token} must be a number from -100 "
                                     f"to 100, got {value!r}")
                bias[int(token)] = float(value)
            object.__setattr__(self, "logit_bias", bias or None)  # a copy: the caller's dict may change

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else asked: the token is the logits' argmax."""
        return self.greedy and self.logprobs is None and not self.adjusts_logits

    @property
    def adjusts_logits(self) -> bool:
        """Whether a bias or a penalty changes the logits before they are sampled from."""
        return bool(self.logit_bias) or self.frequency_penalty != 0 or self.presence_penalty != 0

    def as_dict(self) -> dict:
        """The parameters as JSON (``from_dict`` reads them back, checked)."""
        bias = sorted((self.logit_bias or {}).items())
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "frequency_penalty": self.frequency_penalty, "presence_penalty": self.presence_penalty,
                "logit_bias": [[t, b] for t, b in bias] or None, "logprobs": self.logprobs}

    @classmethod
    def from_dict(cls, d: dict, **overrides) -> "SamplingParams":
        """Parameters from ``as_dict``, with ``overrides`` (keyword: value) replacing some;
        a UsageError (as the keywords' checks) or ValueError (a malformed dict)."""
        keys = set(cls().as_dict())
        if not isinstance(d, dict) or set(d) != keys:
            raise ValueError(f"the sampling parameters must hold exactly {sorted(keys)}")
        bias = d["logit_bias"]
        if bias is not None and not (isinstance(bias, list) and all(isinstance(p, list) and len(p) == 2 for p in bias)):
            raise ValueError("logit_bias must be [token id, bias] pairs")
        values = {**d, "logit_bias": None if bias is None else {t: b for t, b in bias}}
        unknown = set(overrides) - keys
        if unknown:
            raise TypeError(f"unknown sampling parameters {sorted(unknown)}")
        return cls(**{**values, **overrides})

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse a logit bias for a token the model does not have."""
        outside = [t for t in (self.logit_bias or ()) if t >= vocab_size]
        if outside:
            raise UsageError(f"{option('logit_bias')}: token id {outside[0]} is outside the vocabulary "
                             f"(0..{vocab_size - 1})")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def check_max_tokens(max_tokens) -> None:
    if not _is_int(max_tokens) or max_tokens < 0:
        raise UsageError(f"{option('max_tokens')} must be an integer >= 0, got {max_tokens!r}")


class Sampler:
    """One completion's sampler: it remembers the tokens it chose, for the penalties, so
    each sequence needs its own."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.counts: dict[int, int] = {}  # token id -> times chosen in this completion
        bias = params.logit_bias or {}
        self._bias_ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        self._bias = np.fromiter(bias.values(), dtype=np.float64, count=len(bias))
        self._penalised = params.frequency_penalty != 0 or params.presence_penalty != 0

    def __call__(self, logits: np.ndarray) -> int:
        return self.sample(logits)[0]

    @property
    def plain_greedy(self) -> bool:
        return self.params.plain_greedy

    # -- a saved sequence (colibri_core.engine.state) ----------------------------------
    def state(self) -> dict:
        """What the next draw depends on besides the parameters, as JSON: the random
        generator's state (PCG64's 128-bit integers as hex strings) and the counts the
        penalties use."""
        st = self.rng.bit_generator.state
        if st.get("bit_generator") != "PCG64":
            raise ColibriError(f"cannot save a sampler drawing with {st.get('bit_generator')!r} (only PCG64)")
        return {"rng": {"bit_generator": "PCG64", "state": f"{st['state']['state']:x}", "inc": f"{st['state']['inc']:x}",
                        "has_uint32": int(st["has_uint32"]), "uinteger": int(st["uinteger"])},
                "counts": [[int(t), int(n)] for t, n in sorted(self.counts.items())]}

    def restore(self, state: dict, *, rng: bool = True) -> None:
        """Continue from ``state()`` (the generator's too unless ``rng`` is False); a
        ValueError says what is malformed."""
        if not isinstance(state, dict) or set(state) != {"rng", "counts"}:
            raise ValueError("the sampler state must hold exactly 'rng' and 'counts'")
        counts = state["counts"]
        if not isinstance(counts, list) or not all(
                isinstance(c, list) and len(c) == 2 and all(_is_int(x) and x >= 0 for x in c) for c in counts):
            raise ValueError("the sampler's counts must be [token id, count] pairs of integers >= 0")
        r = state["rng"]
        keys = {"bit_generator", "state", "inc", "has_uint32", "uinteger"}
        if not isinstance(r, dict) or set(r) != keys or r["bit_generator"] != "PCG64":
            raise ValueError(f"the random generator state must be PCG64's {sorted(keys)}")
        try:
            value = {"bit_generator": "PCG64", "state": {"state": int(r["state"], 16), "inc": int(r["inc"], 16)},
                     "has_uint32": int(r["has_uint32"]), "uinteger": int(r["uinteger"])}
            if not (0 <= value["state"]["state"] < 2**128 and 0 <= value["state"]["inc"] < 2**128
                    and value["has_uint32"] in (0, 1) and 0 <= value["uinteger"] < 2**32):
                raise ValueError("out of range")
            generator = np.random.default_rng()
            if rng:
                generator.bit_generator.state = value
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the random generator state is malformed ({exc})") from None
        self.counts = {int(t): int(n) for t, n in counts}
        if rng:
            self.rng = generator

    def sample(self, logits: np.ndarray) -> tuple[int, TokenLogprob | None]:
        """The next token, and its log-probability (with the most likely tokens') when
        the parameters ask for them."""
        p = self.params
        if p.plain_greedy:
            return int(np.argmax(logits)), None
        # in place on one float64 copy: every fresh vocabulary-sized temporary (~400 KB)
        # costs page faults, which dominated sampling when each step made a new one
        scores = logits.astype(np.float64)
        if self._bias.size:
            if self._bias_ids.max() >= scores.size:
                p.check_vocab(scores.size)
            scores[self._bias_ids] += self._bias
        if self._penalised and self.counts:
            ids = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
            seen = np.fromiter(self.counts.values(), dtype=np.float64, count=len(self.counts))
            scores[ids] -= p.frequency_penalty * seen + p.presence_penalty
        logprobs = _log_softmax(scores) if p.logprobs is not None else None
        token = int(np.argmax(scores)) if p.greedy else self._draw(scores)
        if self._penalised:
            self.counts[token] = self.counts.get(token, 0) + 1
        if logprobs is None:
            return token, None
        return token, TokenLogprob(token, float(logprobs[token]), _most_likely(logprobs, p.logprobs))

    def _draw(self, scores: np.ndarray) -> int:
        """Temperature, top-k, top-p and a seeded draw; overwrites ``scores``."""
        p = self.params
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


def _log_softmax(scores: np.ndarray) -> np.ndarray:
    shifted = scores - scores.max()
    return shifted - math.log(np.exp(shifted).sum())


def _most_likely(logprobs: np.ndarray, n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` most likely (token id, log-probability), most likely first, ties by id."""
    n = min(n, logprobs.size)
    if n == 0:
        return ()
    ids = np.argpartition(-logprobs, n - 1)[:n] if n < logprobs.size else np.arange(logprobs.size)
    ids = ids[np.lexsort((ids, -logprobs[ids]))]
    return tuple((int(i), float(logprobs[i])) for i in ids)


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
