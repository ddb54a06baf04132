"""Settings the families' oracle cases (``colibri_core.testing.oracle``) share."""

from __future__ import annotations


def yarn(**changes) -> dict:
    """transformers' ``rope_parameters`` for YaRN at the tiny models' scale: 4x beyond 32
    original positions (prompt and generation run past 32), theta 10000; ``changes`` adds
    or replaces keys (``mscale``, ``mscale_all_dim``, ``beta_fast``, ...)."""
    return {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
            **changes}


def prompt(n: int, step: int = 7, start: int = 3, vocab: int = 128) -> tuple[int, ...]:
    """``n`` token ids stepping by ``step`` through the tiny models' vocabulary: a prompt
    as long as a case needs (past a chunk size, a sliding window) that never repeats an
    id within ``vocab`` positions when ``step`` is odd."""
    return tuple((start + step * i) % vocab for i in range(n))
