"""Drafts for tests of speculative decoding: a draft source that knows the
continuations and gets some of each wrong on purpose, so a test sees drafts accepted,
rejected and the cache going back, whatever the model's weights (random weights make
prompt lookup draft rarely)."""

from __future__ import annotations

from typing import Sequence


class ScriptedSource:
    """Drafts from ``scripts``: (prompt, continuation) pairs, the continuation from a run
    without drafts. The token at every ``wrong_every``-th generated position is replaced
    by another; a sequence off every script, or past its end, gets no drafts."""

    name = "scripted"

    def __init__(self, scripts: Sequence[tuple[Sequence[int], Sequence[int]]], vocab_size: int, wrong_every: int = 3):
        self.scripts = [([*prompt, *continuation], len(prompt)) for prompt, continuation in scripts]
        self.vocab_size, self.wrong_every = vocab_size, wrong_every

    def new_drafter(self) -> "ScriptedSource":
        return self  # keeps no per-sequence state

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        n = len(tokens)
        for script, start in self.scripts:
            if n >= start and list(tokens) == script[:n]:
                return [self._garble(script[at], at - start) for at in range(n, min(n + k, len(script)))]
        return []

    def _garble(self, token: int, position: int) -> int:
        wrong = position % self.wrong_every == self.wrong_every - 1
        return (token + 1) % self.vocab_size if wrong else token
