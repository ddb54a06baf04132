"""Teacher-forced scoring of text: perplexity, and how far one model's predictions are
from another's (KL divergence, top-1 agreement), e.g. a converted model against its source.

The text's token ids are cut into windows of ``window`` tokens, each scored from an
empty cache (the first token of a window is context only); ``batch`` windows go through
the model in one batched forward, so each routed expert is read once for all of them.
Placement (budget, cache caps, tiers, prefetch) changes the speed, never the numbers:
sums run in float64 in a fixed order. The batch size is part of the measurement: the
dense matrix products are blocked by their row count, which moves the last digits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from colibri_core.errors import UsageError, option

DEFAULT_WINDOW = 256
DEFAULT_BATCH = 8
HELDOUT_DIR = "heldout"  # held-out text a model directory may carry, one file per domain


@dataclass
class Score:
    """Summed negative log-likelihood (nats) over the predicted tokens."""

    tokens: int = 0
    nll: float = 0.0
    windows: int = 0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")

    def as_dict(self) -> dict:
        return {"perplexity": self.perplexity, "tokens": self.tokens, "nll": self.nll, "windows": self.windows}


@dataclass
class Comparison:
    """A model scored against a reference on the same windows."""

    model: Score = field(default_factory=Score)
    reference: Score = field(default_factory=Score)
    kl_sum: float = 0.0  # sum over tokens of KL(reference || model), nats
    top1_same: int = 0  # tokens whose most likely next token is the same in both

    @property
    def kl(self) -> float:
        return self.kl_sum / self.model.tokens if self.model.tokens else float("nan")

    @property
    def top1_agreement(self) -> float:
        return self.top1_same / self.model.tokens if self.model.tokens else float("nan")

    def as_dict(self) -> dict:
        return {"perplexity": self.model.perplexity, "reference_perplexity": self.reference.perplexity,
                "perplexity_delta": self.model.perplexity - self.reference.perplexity, "kl": self.kl,
                "top1_agreement": self.top1_agreement, "tokens": self.model.tokens, "windows": self.model.windows}


def windows(token_ids, window: int, max_tokens: int | None = None) -> list[np.ndarray]:
    """``token_ids`` (at most ``max_tokens`` of them) in windows of ``window`` tokens;
    a last window of a single token predicts nothing and is dropped."""
    if not isinstance(window, int) or window < 2:
        raise UsageError(f"{option('window')} must be an integer >= 2, got {window!r}")
    ids = np.asarray(token_ids, dtype=np.int64)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    cut = [ids[i:i + window] for i in range(0, len(ids), window)]
    return [w for w in cut if len(w) >= 2]


def check_windows(lm, wins: list[np.ndarray]) -> None:
    """Every window fits the context and holds only tokens the model takes."""
    for w in wins:
        if len(w) > lm.max_context:
            raise UsageError(f"a window of {len(w)} tokens does not fit the context of {lm.max_context}: "
                             f"use a smaller {option('window')}")
        lm.check_prompt(w.tolist())


def window_logits(model, wins: list[np.ndarray], batch: int = DEFAULT_BATCH,
                  progress: Callable[[int], None] | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(window, its (len, vocab) float32 logits) for every window, ``batch`` windows per
    batched forward; ``progress(n)`` is told of every n tokens done."""
    if not isinstance(batch, int) or batch < 1:
        raise UsageError(f"{option('batch')} must be an integer >= 1, got {batch!r}")
    lm, backend = model.lm, model.backend
    check_windows(lm, wins)
    for start in range(0, len(wins), batch):
        group = wins[start:start + batch]
        logits = lm.forward_batch([(w, lm.new_cache(backend)) for w in group], backend, all_logits=True)
        if model.store is not None:
            model.store.after_tokens(sum(len(w) for w in group))
        row = 0
        for w in group:
            yield w, logits[row:row + len(w)]
            row += len(w)
        if progress is not None:
            progress(sum(len(w) for w in group))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def _add(score: Score, logp: np.ndarray, w: np.ndarray) -> None:
    targets = w[1:]
    score.nll -= float(logp[np.arange(len(targets)), targets].sum())
    score.tokens += len(targets)
    score.windows += 1


def score(model, wins: list[np.ndarray], batch: int = DEFAULT_BATCH, progress=None) -> Score:
    """The model's teacher-forced score on the windows."""
    result = Score()
    for w, logits in window_logits(model, wins, batch, progress):
        _add(result, log_softmax(logits[:-1]), w)
    return result


def compare(model, reference, wins: list[np.ndarray], batch: int = DEFAULT_BATCH, progress=None) -> Comparison:
    """``model`` against ``reference`` on the same windows: both scores, the mean
    KL(reference || model) per token and how often their top-1 predictions agree."""
    if model.lm.vocab_size != reference.lm.vocab_size:
        raise UsageError(f"the models' vocabularies differ ({model.lm.vocab_size} vs {reference.lm.vocab_size} tokens)")
    result = Comparison()
    ours = window_logits(model, wins, batch, progress)
    theirs = window_logits(reference, wins, batch)
    for (w, a), (_, b) in zip(ours, theirs):
        logp, logq = log_softmax(a[:-1]), log_softmax(b[:-1])
        _add(result.model, logp, w)
        _add(result.reference, logq, w)
        result.kl_sum += float((np.exp(logq) * (logq - logp)).sum())
        result.top1_same += int((a[:-1].argmax(-1) == b[:-1].argmax(-1)).sum())
    return result
