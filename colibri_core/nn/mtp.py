"""Multi-token-prediction (MTP) layers: the extra layers DeepSeek-V3, Kimi K2, GLM-4.5+,
Qwen3-Next, Qwen3.5, MiMo-V2-Flash and DeepSeek-V4 checkpoints carry past their decoder layers,
trained to predict the token after the next one. colibri runs them as a draft source
(``colibri_core.engine.speculative``), never as part of the model's own logits.

Four published layouts (``MTPLayout``), the ones vLLM's and SGLang's loaders read:

- DeepSeek-V3's (also Kimi K2's and GLM's; ``num_nextn_predict_layers``): layer N =
  ``num_hidden_layers`` holds ``enorm``, ``hnorm``, ``eh_proj`` (hidden x 2 hidden), a
  decoder layer under the usual names (``input_layernorm``, ``self_attn``,
  ``post_attention_layernorm``, ``mlp``) and ``shared_head.norm``. Its ``embed_tokens``
  and ``shared_head.head`` are copies of the model's embedding and LM head (shared in
  training): the model's own are used and the copies are not read.
- Qwen3-Next's and Qwen3.5's (``mtp_num_hidden_layers``): ``mtp.pre_fc_norm_embedding``,
  ``mtp.pre_fc_norm_hidden``, ``mtp.fc`` and ``mtp.norm`` around a full-attention decoder
  layer ``mtp.layers.0``, whose MoE-or-dense choice follows its own index 0 (as vLLM's
  ``qwen3_next_mtp`` builds it); embeddings and LM head are the model's.
- MiMo-V2-Flash's (``model.mtp.layers.{j}``): DeepSeek-V3's names, its block's MLP norm
  ``pre_mlp_layernorm``, its output norm ``final_layernorm``.
- DeepSeek-V4's (``mtp.{j}.``, DeepSeek's own spelling; transformers drops them on load):
  ``enorm``, ``hnorm``, separate ``e_proj`` and ``h_proj`` (hidden x hidden), a V4 block
  on hyper-connection streams (``attn_norm``, ``attn.*``, ``ffn_norm``, ``ffn.*``,
  ``hc_attn_*``, ``hc_ffn_*``), its own ``hc_head_{fn,base,scale}`` and ``norm``. It reads
  the main model's streams before their final collapse (``StreamMTPLayer``; the model
  hands them on with ``CausalLM.hidden_before_norm``).

At position i the layer reads the main model's final-normed hidden state h_i and the
embedding of token i + 1:
``x = block(eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)]))``, and
``logits = head(shared_head.norm(x))`` guess token i + 2. Chained for deeper drafts, the
layer's own ``shared_head.norm(x)`` (or its block's output: ``chains_normed``) stands in
for the hidden state the main model has not computed yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_core.nn.cache import Cache
from colibri_core.nn.layers import DecoderLayer, Embedding, Linear, RMSNorm, Step


@dataclass(frozen=True)
class MTPLayout:
    """Where a checkpoint keeps its MTP layers: ``count`` the config field saying how
    many; the names, under the layer's own prefix, of the embedding's norm, the hidden
    state's norm, the projection of their concatenation and the output norm;
    ``block_norms`` the names of its decoder layer's two pre-norms; ``model_types``: the
    layout is only that of these model types (else of any that declares ``count``)."""

    name: str
    count: str
    embed_norm: str
    hidden_norm: str
    projection: str
    head_norm: str
    own: str | None = None  # the own tensors' prefix ({j}: the layer's index); None: ``model.layers.{N + j}``
    blocks: str | None = None  # the decoder layers' prefix, ``{blocks}.{j}``
    block_norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm")
    model_types: tuple[str, ...] = ()
    # what a chained draft reads as its position's hidden state: the layer's normed output
    # (vLLM's qwen3_next_mtp and mimo_v2_mtp return it), or its block's output before that
    # norm (deepseek_mtp returns residual + hidden; the head's norm comes in compute_logits)
    chains_normed: bool = True
    # the projection of the hidden state, apart from ``projection`` (then the embedding's
    # alone): DeepSeek-V4's ``h_proj``, whose layer reads hyper-connection streams
    hidden_projection: str | None = None

    def prefixes(self, layer_prefix: str, j: int) -> tuple[str, str]:
        """(own tensors' prefix, decoder layer's prefix) of MTP layer j, whose layer
        number's usual prefix is ``layer_prefix``."""
        if self.own is None:
            return layer_prefix, layer_prefix
        return self.own.format(j=j), f"{self.blocks}.{j}"


DEEPSEEK_MTP = MTPLayout("deepseek", "num_nextn_predict_layers", "enorm", "hnorm", "eh_proj", "shared_head.norm",
                         chains_normed=False)
QWEN_MTP = MTPLayout("qwen3-next", "mtp_num_hidden_layers", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm",
                     own="mtp", blocks="mtp.layers")
MIMO_MTP = MTPLayout("mimo-v2-flash", "num_nextn_predict_layers", "enorm", "hnorm", "eh_proj", "final_layernorm",
                     own="model.mtp.layers.{j}", blocks="model.mtp.layers",
                     block_norms=("input_layernorm", "pre_mlp_layernorm"), model_types=("mimo_v2_flash",))
# vLLM's deepseek_v4_mtp and DeepSeek's inference/model.py (MTPBlock): the block's output
# streams chain, before the layer's hc_head and norm
DEEPSEEK_V4_MTP = MTPLayout("deepseek-v4", "num_nextn_predict_layers", "enorm", "hnorm", "e_proj", "norm",
                            own="mtp.{j}", blocks="mtp", block_norms=("attn_norm", "ffn_norm"),
                            model_types=("deepseek_v4",), chains_normed=False, hidden_projection="h_proj")


def mtp_layout(config: dict) -> tuple[MTPLayout, int, str]:
    """The layout of a config.json's MTP layers, how many it declares (0: none) and
    where it says so (a text model's fields may sit under ``text_config``)."""
    for where, fields in (("", config), ("text_config.", config.get("text_config"))):
        if not isinstance(fields, dict):
            continue
        model_type = fields.get("model_type", config.get("model_type"))
        for layout in (MIMO_MTP, DEEPSEEK_V4_MTP, QWEN_MTP, DEEPSEEK_MTP):
            if layout.model_types and model_type not in layout.model_types:
                continue
            if fields.get(layout.count) is not None:
                return layout, fields[layout.count], where + layout.count
    return DEEPSEEK_MTP, 0, DEEPSEEK_MTP.count


class MTPLayer:
    """One MTP layer; ``index`` is its layer number (its block's cache slot);
    ``prefixes`` where its tensors live (with the trailing dot)."""

    def __init__(self, index: int, embed: Embedding, enorm: RMSNorm, hnorm: RMSNorm, eh_proj: Linear,
                 block: DecoderLayer, head_norm: RMSNorm, head: Linear, prefixes: tuple[str, ...] = (),
                 chains_normed: bool = True):
        self.index, self.embed, self.enorm, self.hnorm, self.eh_proj = index, embed, enorm, hnorm, eh_proj
        self.block, self.head_norm, self.head = block, head_norm, head
        self.prefixes = prefixes or (f"model.layers.{index}.",)
        self.chains_normed = chains_normed  # ``MTPLayout.chains_normed``

    def new_cache(self, backend, max_len: int) -> Cache:
        """The layer's own sequence state (its attention's cache), in a ``Cache`` whose
        slot ``index`` its block reads."""
        return Cache([None] * self.index + [self.block.new_state(backend, max_len)])

    def __call__(self, hidden, next_ids: np.ndarray, cache: Cache, ops):
        """Rows of main-model hidden states ``hidden`` (positions ``cache.length`` on) and
        the tokens after each (``next_ids``) through the layer, extending ``cache``.
        Returns (host float32 logits of the last row, the stand-in hidden state for a
        chained step: its normed output, or its block's output (``chains_normed``))."""
        ids = np.asarray(next_ids, dtype=np.int64)
        positions = np.arange(cache.length, cache.length + len(ids), dtype=np.int64)
        step = Step(ops, positions, cache, ids=ids)
        x = self.block(self.project(hidden, ids, step), step)
        cache.length += len(ids)
        out = self.head_norm(x[-1:], step)
        return ops.to_host(self.head(out, step))[0], out if self.chains_normed else x[-1:]

    def project(self, hidden, ids: np.ndarray, step: Step):
        """The block's input: eh_proj([enorm(embed(ids)), hnorm(hidden)])."""
        mixed = step.ops.concat([self.enorm(self.embed(ids, step), step), self.hnorm(hidden, step)], 1)
        return self.eh_proj(mixed, step)


class StreamMTPLayer(MTPLayer):
    """An MTP layer on hyper-connection streams (DeepSeek-V4's): ``hidden`` is the main
    model's N streams before their final collapse, (T, N, D), and the block's input is
    ``e_proj(enorm(embed(t)))`` added to each stream of ``h_proj(hnorm(streams))`` (both
    per stream); ``block`` a ``HyperDecoderLayer``, ``head_norm`` the layer's own collapse
    and norm (a ``HeadNorm``). ``embed`` is the plain embedding (one row per token);
    ``eh_proj`` holds ``e_proj``."""

    def __init__(self, index: int, embed: Embedding, enorm: RMSNorm, hnorm: RMSNorm, e_proj: Linear, h_proj: Linear,
                 block: DecoderLayer, head_norm, head: Linear, prefixes: tuple[str, ...] = ()):
        super().__init__(index, embed, enorm, hnorm, e_proj, block, head_norm, head, prefixes, chains_normed=False)
        self.h_proj = h_proj

    def project(self, hidden, ids: np.ndarray, step: Step):
        t, n, d = hidden.shape
        h = self.h_proj(self.hnorm(hidden.reshape(t * n, d), step), step)
        e = self.eh_proj(self.enorm(self.embed(ids, step), step), step)
        return e.reshape(t, 1, d) + h.reshape(t, n, d)
