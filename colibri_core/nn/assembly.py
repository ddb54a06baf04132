"""Assembling a decoder-only model: the one way every family builds its ``CausalLM``.

A family gives its typed args, where its tensors live (``Names``) and two per-layer
callables, ``mixer(i, prefix)`` (the token mixer of layer i: attention, MLA, Gated
DeltaNet...) and ``mlp(i, prefix)`` (a dense SwiGLU, a MoE...), each called with the
layer's tensor prefix (``model.layers.3``) and declaring its own weights under it.
``build_decoder`` adds the rest, the same for every family: token embeddings,
pre-norm decoder layers, the final norm and the LM head (tied to the embeddings or not).
Layers of index ``num_hidden_layers`` and beyond (multi-token prediction) are never
declared, so their tensors are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

from colibri_core.errors import UnsupportedModelError
from colibri_core.nn.hyper import HeadNorm, HyperDecoderLayer, HyperHead, StreamEmbedding
from colibri_core.nn.layers import (CausalLM, DecoderLayer, DividedInput, Embedding, Linear, NormedEmbedding,
                                    ParallelDecoderLayer, ScaledEmbedding, Unnormed)
from colibri_core.nn.mtp import DEEPSEEK_MTP, MTPLayer

if TYPE_CHECKING:
    from colibri_core.nn.weights import Weights

# (layer index, layer prefix) -> the block of that layer, its weights declared
LayerBlock = Callable[[int, str], Any]


class DecoderArgs(Protocol):
    """The config fields ``build_decoder`` reads (every family's ``ModelArgs`` has them)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool


@dataclass(frozen=True)
class Names:
    """Where the text model's tensors live: most checkpoints use the defaults; wrappers
    (Kimi K2.5: ``language_model.model.``, Qwen3.5: ``model.language_model.``) prefix them;
    ``norm``: the final norm's name under ``model`` (LFM2's ``embedding_norm``); ``embed``:
    the token embeddings' (Nemotron-H's ``embeddings``)."""

    model: str = "model."
    layers: str = "layers"
    lm_head: str = "lm_head"
    norm: str = "norm"
    embed: str = "embed_tokens"

    def layer(self, i: int) -> str:
        return f"{self.model}{self.layers}.{i}"


def build_decoder(a: DecoderArgs, w: Weights, mixer: LayerBlock, mlp: LayerBlock, names: Names = Names(), *,
                  offset_norms: bool = False, refused_tokens: dict[int, str] | None = None,
                  embedded_as: dict[int, int] | None = None, post: Callable[[int, str], tuple] | None = None,
                  embed_norm: bool = False, head_divisor: float = 1.0, head_rows: int | None = None,
                  hyper: Callable[[int, str], tuple] | None = None, hyper_head: HyperHead | None = None,
                  embed_scale: float = 1.0, head_bias: bool = False, pre_norms: bool = True, parallel: bool = False,
                  make_norm: Callable[[str], Any] | None = None,
                  norm_names: tuple[str, str] = ("input_layernorm", "post_attention_layernorm"),
                  mtp: Callable[[CausalLM], list] | None = None) -> CausalLM:
    """Embeddings, ``a.num_hidden_layers`` layers x + mixer(norm(x)), h + mlp(norm(h)),
    the final norm and the LM head (``lm_head``, or the embeddings when
    ``a.tie_word_embeddings``). ``offset_norms``: the RMSNorms scale by (1 + w).
    ``refused_tokens`` goes to ``CausalLM``, ``embedded_as`` to the ``Embedding``.
    ``post(i, prefix)``: (attn_post, mlp_post) of layer i (see ``DecoderLayer``);
    ``embed_norm``: the embeddings RMS-normalised by ``embed_tokens.embed_norm``;
    ``head_divisor``: the LM head sees the final hidden states divided by it (muP);
    ``head_rows``: only the LM head's first rows give logits (a head padded beyond the
    vocabulary); ``hyper(i, prefix)``: (attn_hc, ffn_hc), the ``nn.hyper.HyperConnection``
    sites of layer i, whose residual is then ``hyper_head.n`` streams (``HyperDecoderLayer``,
    embeddings entering as N copies, ``hyper_head`` collapsing them before the final norm);
    ``embed_scale``: the embeddings times it (Granite's embedding_multiplier; the table a
    tied head shares stays as stored); ``head_bias``: the LM head (tied or not) adds
    ``lm_head.bias`` (ERNIE 4.5's use_bias); ``pre_norms=False``: the layers have no
    input norms (no ``input_layernorm`` / ``post_attention_layernorm`` declared), x +
    mixer(x) and h + mlp(h), the branches normalised only by what ``post`` gives
    (OLMo 2's and FlexOlmo's norms of the branch outputs); ``parallel``: each layer is
    x + mixer(norm(x)) + mlp(norm(x)) with one norm, ``input_layernorm`` (Cohere's,
    ``nn.layers.ParallelDecoderLayer``); ``make_norm(prefix)``: the decoder's norms (the
    layers' and the final one) instead of RMSNorms at ``prefix.weight`` (Cohere's and
    Phi-MoE's LayerNorms); ``norm_names``: the
    tensor names of each layer's two pre-norms (AFMoE's MLP one is ``pre_mlp_layernorm``,
    its ``post_attention_layernorm`` a ``post`` norm). In plain pre-norm layers ``mixer`` or
    ``mlp`` may return None: the layer lacks that branch and its norm (Nemotron-H's layers,
    a mixer or an MLP each, their one norm named by both ``norm_names``). ``mtp(lm)``: the
    multi-token-prediction layers asked for (``w.mtp_layers``), built by the family from
    the assembled model (DeepSeek-V4's, on hyper-connection streams); without it they are
    built here, on plain decoder layers."""
    if (hyper is None) != (hyper_head is None):
        raise ValueError("build_decoder takes hyper and hyper_head together")
    if not pre_norms and hyper is not None:
        raise ValueError("build_decoder: hyper-connections need the layers' pre-norms")
    if parallel and (hyper is not None or post is not None or not pre_norms):
        raise ValueError("build_decoder: parallel layers do not combine with hyper, post or pre_norms=False")
    if make_norm is not None and offset_norms:
        raise ValueError("build_decoder takes make_norm or offset_norms, not both")
    if hyper is not None and (post is not None or embed_norm or embed_scale != 1.0):
        raise ValueError("build_decoder: hyper-connections do not combine with post, embed_norm or embed_scale")
    if embed_norm and embed_scale != 1.0:
        raise ValueError("build_decoder takes embed_norm or embed_scale, not both")
    hidden = a.hidden_size

    def norm(prefix: str):
        if make_norm is not None:
            return make_norm(prefix)
        return w.rms_norm(prefix, hidden, a.rms_norm_eps, offset=offset_norms)

    layers = []
    for i in range(a.num_hidden_layers):
        p = names.layer(i)
        if hyper is not None:
            attn_hc, ffn_hc = hyper(i, p)
            layers.append(HyperDecoderLayer(attn_hc, norm(f"{p}.input_layernorm"), mixer(i, p), ffn_hc,
                                            norm(f"{p}.post_attention_layernorm"), mlp(i, p)))
            continue
        if parallel:
            layers.append(ParallelDecoderLayer(norm(f"{p}.input_layernorm"), mixer(i, p), mlp(i, p)))
            continue
        block = mixer(i, p)
        # a branch the layer lacks (None) has no norm to declare
        attn_norm = None if block is None else norm(f"{p}.{norm_names[0]}") if pre_norms else Unnormed()
        ffn = mlp(i, p)
        mlp_norm = None if ffn is None else norm(f"{p}.{norm_names[1]}") if pre_norms else Unnormed()
        layers.append(DecoderLayer(attn_norm, block, mlp_norm, ffn, *(post(i, p) if post is not None else ())))
    table = w.param(f"{names.model}{names.embed}.weight", (a.vocab_size, hidden))
    if hyper_head is not None:
        embed = StreamEmbedding(table, hyper_head.n, embedded_as)
    elif embed_norm:
        embed = NormedEmbedding(table, norm(f"{names.model}embed_tokens.embed_norm"), embedded_as)
    elif embed_scale != 1.0:
        embed = ScaledEmbedding(table, embed_scale, embedded_as)
    else:
        embed = Embedding(table, embedded_as)
    vocab = a.vocab_size
    if head_bias and head_rows is not None:
        raise ValueError("build_decoder takes head_rows or head_bias, not both")
    if a.tie_word_embeddings:
        lm_head = Linear(embed.weight, w.param(f"{names.lm_head}.bias", (vocab,)) if head_bias else None)
    elif head_rows is not None and head_rows < vocab:
        lm_head, vocab = Linear(w.param(f"{names.lm_head}.weight", (vocab, hidden), _first_rows(head_rows))), head_rows
    else:
        lm_head = w.linear(names.lm_head, vocab, hidden, bias=head_bias)
    if head_divisor != 1.0:
        lm_head = DividedInput(lm_head, head_divisor)
    final = norm(f"{names.model}{names.norm}")
    if hyper_head is not None:
        final = HeadNorm(hyper_head, final)
    lm = CausalLM(embed=embed, layers=layers, norm=final, lm_head=lm_head,
                  vocab_size=vocab, max_context=a.max_position_embeddings, refused_tokens=refused_tokens)
    if w.mtp_layers and mtp is not None:
        lm.mtp.extend(mtp(lm))
    elif w.mtp_layers:
        if hyper is not None or post is not None or embed_norm or head_divisor != 1.0 or not pre_norms or parallel:
            raise UnsupportedModelError(f"{w.config_source}: multi-token-prediction layers are read on plain decoder "
                                        "layers; this model's layers are not plain")
        layout = w.mtp_layout or DEEPSEEK_MTP
        for j in range(w.mtp_layers):
            i = a.num_hidden_layers + j
            own, p = layout.prefixes(names.layer(i), j)
            attn_norm, mlp_norm = layout.block_norms
            block = DecoderLayer(norm(f"{p}.{attn_norm}"), mixer(i, p), norm(f"{p}.{mlp_norm}"), mlp(i, p))
            lm.mtp.append(MTPLayer(i, embed, norm(f"{own}.{layout.embed_norm}"), norm(f"{own}.{layout.hidden_norm}"),
                                   w.linear(f"{own}.{layout.projection}", hidden, 2 * hidden), block,
                                   norm(f"{own}.{layout.head_norm}"), lm_head, prefixes=tuple(dict.fromkeys((f"{own}.", f"{p}."))),
                                   chains_normed=layout.chains_normed))
    return lm


def _first_rows(n: int):
    """Load transform: a matrix's first ``n`` rows."""
    import numpy as np

    def first(m):
        return np.ascontiguousarray(m[:n])

    return first
