"""Multi-token-prediction (MTP) layers: the extra layers DeepSeek-V3, Kimi K2 and
GLM-4.5+ checkpoints carry past their decoder layers (``num_nextn_predict_layers``),
trained to predict the token after the next one. colibri runs them as a draft source
(``colibri_core.engine.speculative``), never as part of the model's own logits.

Layout (DeepSeek-V3's, which vLLM's and SGLang's loaders read): layer N =
``num_hidden_layers`` holds ``enorm``, ``hnorm``, ``eh_proj`` (hidden x 2 hidden), a
decoder layer under the usual names (``input_layernorm``, ``self_attn``,
``post_attention_layernorm``, ``mlp``) and ``shared_head.norm``. Its ``embed_tokens``
and ``shared_head.head`` are copies of the model's embedding and LM head (shared in
training): the model's own are used and the copies are not read.

At position i the layer reads the main model's final-normed hidden state h_i and the
embedding of token i + 1:
``x = block(eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)]))``, and
``logits = head(shared_head.norm(x))`` guess token i + 2. Chained for deeper drafts, the
layer's own ``shared_head.norm(x)`` stands in for the hidden state the main model has not
computed yet.
"""

from __future__ import annotations

import numpy as np

from colibri_core.nn.cache import Cache
from colibri_core.nn.layers import DecoderLayer, Embedding, Linear, RMSNorm, Step


class MTPLayer:
    """One MTP layer; ``index`` is its layer number (its block's cache slot and its
    weight names' ``model.layers.{index}``)."""

    def __init__(self, index: int, embed: Embedding, enorm: RMSNorm, hnorm: RMSNorm, eh_proj: Linear,
                 block: DecoderLayer, head_norm: RMSNorm, head: Linear):
        self.index, self.embed, self.enorm, self.hnorm, self.eh_proj = index, embed, enorm, hnorm, eh_proj
        self.block, self.head_norm, self.head = block, head_norm, head

    def new_cache(self, backend, max_len: int) -> Cache:
        """The layer's own sequence state (its attention's cache), in a ``Cache`` whose
        slot ``index`` its block reads."""
        return Cache([None] * self.index + [self.block.new_state(backend, max_len)])

    def __call__(self, hidden, next_ids: np.ndarray, cache: Cache, ops):
        """Rows of main-model hidden states ``hidden`` (positions ``cache.length`` on) and
        the tokens after each (``next_ids``) through the layer, extending ``cache``.
        Returns (host float32 logits of the last row, its normed output: the stand-in
        hidden state for a chained step)."""
        ids = np.asarray(next_ids, dtype=np.int64)
        positions = np.arange(cache.length, cache.length + len(ids), dtype=np.int64)
        step = Step(ops, positions, cache, ids=ids)
        mixed = ops.concat([self.enorm(self.embed(ids, step), step), self.hnorm(hidden, step)], 1)
        x = self.block(self.eh_proj(mixed, step), step)
        cache.length += len(ids)
        out = self.head_norm(x[-1:], step)
        return ops.to_host(self.head(out, step))[0], out
