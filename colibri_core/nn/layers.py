"""Shared building blocks of decoder-only MoE transformers.

Blocks hold their weights (``Param``) and do array work through ``step.ops``, the
compute backend, so one family definition runs on every backend. Families compose
these; what is truly family-specific stays in the family's own file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from colibri_core.compute.backend import UngatedActivation
from colibri_core.compute.composites import ungated_activation
from colibri_core.nn.cache import Cache, KVCache, LayerStates, SlidingKVCache, attention_cache
from colibri_core.nn.chunked import chunked_attention, query_scales
from colibri_core.nn.rope import RoPE
from colibri_core.nn.zero_experts import split_zero_experts
from colibri_core.nn.stages import (ATTENTION, DENSE_MLP, EMBED, EXPERT_READS, LM_HEAD, OTHER, PREFETCH, ROUTED_EXPERTS,
                                    ROUTERS, SHARED_EXPERTS, StageClock)

if TYPE_CHECKING:  # annotations only: weights.py builds these blocks, so it imports this module
    from colibri_core.nn.weights import ExpertDecl, Param


@dataclass
class Step:
    """One forward pass over ``len(positions)`` new tokens of one sequence, or, with
    ``segments``, of several sequences (a batched step).

    A batched step's rows are the sequences' tokens one after another: ``segments[i]``
    is a one-sequence Step (its own cache, positions and memo) owning rows
    ``rows[i] = (begin, end)``. Token mixers (attention, MLA, Gated DeltaNet: whatever
    reads or writes per-sequence state) run once per segment on its rows; everything
    else (norms, dense linears, the router and the routed experts) runs on all rows
    together, so a step's routed experts are fetched once for all its tokens."""

    ops: Any  # the Backend
    positions: np.ndarray
    cache: Cache | None
    memo: dict = field(default_factory=dict)
    routing: list | None = None  # when a list, MoE layers append (layer, expert ids)
    prefetcher: Any = None  # told the hidden state after each attention, to read ahead
    segments: list["Step"] | None = None  # batched step: one Step per sequence
    rows: list[tuple[int, int]] | None = None  # the rows of each segment
    # a verification's segments of one sequence merged into one Step each, and their rows:
    # for the mixers whose backend computes such rows exactly as one call (Attention)
    runs: list[tuple["Step", tuple[int, int]]] | None = None
    ids: np.ndarray | None = None  # the step's token ids, one per row (hash-routed MoE layers read them)
    clock: StageClock | None = None  # told each stage's end, to profile where the step's time goes

    @property
    def start(self) -> int:
        return int(self.positions[0])


def _v(p: Param | None):
    return None if p is None else p.value


class Embedding:
    """Rows of ``weight`` by token id. ``embedded_as``: token id -> the id whose row it
    gets instead (a vision-language wrapper's image and video placeholders, which
    transformers embeds as token 0 when no media is given: such an id can still be
    generated, and the next step must embed it as transformers does)."""

    def __init__(self, weight: Param, embedded_as: dict[int, int] | None = None):
        self.weight = weight
        weight.role = "embedding"
        self.embedded_as = dict(embedded_as or {})

    def __call__(self, ids: np.ndarray, step: Step):
        if self.embedded_as:
            ids = np.asarray(ids, dtype=np.int64).copy()
            for token, instead in self.embedded_as.items():
                ids[ids == token] = instead
        return step.ops.embedding(self.weight.value, ids)


class Linear:
    def __init__(self, weight: Param, bias: Param | None = None):
        self.weight, self.bias = weight, bias

    @property
    def out_features(self) -> int:
        return self.weight.info.shape[0]

    def __call__(self, x, step: Step):
        return step.ops.linear(x, self.weight.value, _v(self.bias))


class RMSNorm:
    def __init__(self, weight: Param | None, eps: float):
        self.weight, self.eps = weight, eps

    def __call__(self, x, step: Step):
        return step.ops.rms_norm(x, _v(self.weight), self.eps)


class Unnormed:
    """The place of a norm a layer does not have: x as it is (``build_decoder``'s
    ``pre_norms=False``)."""

    def __call__(self, x, step: Step):
        return x


class SwiGLU:
    """Dense gated MLP: down(silu(gate(x)) * up(x)); with ``activation``, another
    ``GatedActivation`` of gate and up (DeepSeek-V4's clamped SwiGLU)."""

    def __init__(self, gate: Linear, up: Linear, down: Linear, activation=None):
        self.gate, self.up, self.down = gate, up, down
        self.activation = None if activation is None or activation.plain else activation

    def __call__(self, x, step: Step):
        if self.activation is not None:
            return self.down(step.ops.gated_activation(self.gate(x, step), self.up(x, step), self.activation), step)
        return self.down(step.ops.silu_mul(self.gate(x, step), self.up(x, step)), step)


class UngatedMLP:
    """Dense MLP without a gate: down(act(up(x))), ``activation`` an ``UngatedActivation``
    (Nemotron-H's squared ReLU)."""

    def __init__(self, up: Linear, down: Linear, activation: UngatedActivation = UngatedActivation()):
        self.up, self.down, self.activation = up, down, activation

    def __call__(self, x, step: Step):
        return self.down(ungated_activation(step.ops, self.up(x, step), self.activation), step)


class Attention:
    """Multi-head attention with grouped KV heads, RoPE and the common options:
    q/k RMSNorm over the whole projection (OLMoE) or per head (Qwen3; after RoPE with
    ``qk_norm_after_rope``, Hunyuan), clipping, and an
    output gate (Qwen3-Next: q_proj yields per head [query, gate]; the attention output
    is multiplied by sigmoid(gate) before o_proj), a sliding ``window`` (each query sees
    the last ``window`` positions, itself included; the layer's cache keeps only those:
    ``SlidingKVCache``) and learned attention ``sinks`` (one logit per query head that
    joins the softmax, gpt-oss); the last two go through ``ops.windowed_attention``.
    ``gate``: the output gate as a projection of its own of the attention's input (AFMoE's
    ``gate_proj``): the output times sigmoid(gate(x)) before o_proj. ``v_head_dim``: value
    heads narrower (or wider) than the q/k heads (MiMo-V2-Flash's 128 beside 192; the
    output has ``n_heads * v_head_dim`` features); ``value_scale``: the values multiplied
    by a constant before they are cached (MiMo-V2-Flash's ``attention_value_scale``).
    ``chunk``: chunked attention (Llama 4's ``attention_chunk_size``: a query sees the keys
    of its own chunk of ``chunk`` positions up to itself, ``nn.chunked``; the cache keeps
    the last ``chunk`` positions); ``query_scale``: a host function of the positions giving
    each query a factor, applied after RoPE and the q/k norms (Llama 4's attention
    temperature tuning, ``nn.chunked.temperature_tuning``)."""

    def __init__(
        self,
        *,
        layer: int,
        q: Linear,
        k: Linear,
        v: Linear,
        o: Linear,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rope: RoPE | None,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        qk_norm_per_head: bool = False,
        qk_norm_after_rope: bool = False,
        clip_qkv: float | None = None,
        scale: float | None = None,
        output_gate: bool = False,
        window: int | None = None,
        sinks: Param | None = None,
        gate: Linear | None = None,
        v_head_dim: int | None = None,
        value_scale: float = 1.0,
        chunk: int | None = None,
        query_scale: Callable[[np.ndarray], np.ndarray] | None = None,
    ):
        if gate is not None and output_gate:
            raise ValueError("attention takes its output gate from q_proj (output_gate) or from gate, not both")
        self.layer = layer
        self.q, self.k, self.v, self.o = q, k, v, o
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        if self.v_head_dim < 1:
            raise ValueError(f"attention v_head_dim must be >= 1, got {v_head_dim}")
        if output_gate and self.v_head_dim != head_dim:
            raise ValueError("an output gate from q_proj (output_gate) needs v_head_dim == head_dim")
        self.value_scale = float(value_scale)
        self.rope = rope
        self.q_norm, self.k_norm, self.qk_norm_per_head = q_norm, k_norm, qk_norm_per_head
        if qk_norm_after_rope and (q_norm is None or not qk_norm_per_head):
            raise ValueError("qk_norm_after_rope needs per-head q/k norms (qk_norm_per_head)")
        self.qk_norm_after_rope = qk_norm_after_rope
        self.clip_qkv = clip_qkv
        self.scale = head_dim**-0.5 if scale is None else scale
        self.output_gate = output_gate
        if window is not None and window < 1:
            raise ValueError(f"attention window must be >= 1, got {window}")
        self.window, self.sinks = window, sinks
        self.gate = gate
        if chunk is not None and (chunk < 1 or window is not None or sinks is not None):
            raise ValueError(f"attention chunk must be >= 1 and goes without a window or sinks, got {chunk}")
        self.chunk, self.query_scale = chunk, query_scale

    def new_state(self, backend, max_len: int) -> KVCache | SlidingKVCache:
        return attention_cache(backend, self.n_kv_heads, self.head_dim, self.v_head_dim, max_len,
                               self.window if self.chunk is None else self.chunk)

    def _project(self, x, ops) -> list:
        """q, k, v (and the gate's projection, when separate) of rows x."""
        blocks = (self.q, self.k, self.v) if self.gate is None else (self.q, self.k, self.v, self.gate)
        return list(ops.linears(x, [p.weight.value for p in blocks], [_v(p.bias) for p in blocks]))

    def __call__(self, x, step: Step):
        q, k, v, *gate = self._project(x, step.ops)
        return self.o(self._attend(q, k, v, step, *gate), step)

    def batched(self, x, step: Step):
        """A batched step: the projections on all rows, attention per sequence (a
        verification's drafted positions of one sequence in one call, where exact)."""
        ops = step.ops
        q, k, v, *gate = self._project(x, ops)
        parts = zip(step.segments, step.rows)
        if step.runs is not None and self._merges(ops, max(b - a for _, (a, b) in step.runs)):
            parts = step.runs
        outs = [self._attend(q[a:b], k[a:b], v[a:b], seg, *(g[a:b] for g in gate)) for seg, (a, b) in parts]
        return self.o(outs[0] if len(outs) == 1 else ops.concat(outs, 0), step)

    def _merges(self, ops, rows: int) -> bool:
        """Whether ``rows`` consecutive positions of one sequence may go through this
        attention at once and give each row's bits as a step of its own would: plain
        causal attention (no window, sinks or chunks: their caches change in place) on a
        backend whose attention computes the rows independently."""
        return (self.window is None and self.sinks is None and self.chunk is None
                and ops.batch_invariant_rows("attention", []) >= rows)

    def _attend(self, q, k, v, step: Step, gate=None):
        """One sequence's projected rows -> its attention output (before o_proj);
        ``gate``: the rows of the separate gate projection, if any."""
        ops = step.ops
        t = q.shape[0]
        if self.output_gate:
            q = q.reshape(t, self.n_heads, 2 * self.head_dim)
            q, gate = q[..., : self.head_dim], q[..., self.head_dim :].reshape(t, self.n_heads * self.head_dim)
        if self.q_norm is not None and not self.qk_norm_per_head:
            q, k = self.q_norm(q, step), self.k_norm(k, step)
        if self.clip_qkv is not None:
            q, k, v = ops.clip(q, self.clip_qkv), ops.clip(k, self.clip_qkv), ops.clip(v, self.clip_qkv)
        q = q.reshape(t, self.n_heads, self.head_dim)
        k = k.reshape(t, self.n_kv_heads, self.head_dim)
        v = v.reshape(t, self.n_kv_heads, self.v_head_dim)
        if self.value_scale != 1.0:
            v = v * self.value_scale
        if self.q_norm is not None and self.qk_norm_per_head and not self.qk_norm_after_rope:
            q, k = self.q_norm(q, step), self.k_norm(k, step)
        if self.rope is not None:
            cos, sin = rope_tables(self.rope, step)
            q = ops.rope(q, cos, sin, self.rope.rotary_dim)
            k = ops.rope(k, cos, sin, self.rope.rotary_dim)
        if self.qk_norm_after_rope:
            q, k = self.q_norm(q, step), self.k_norm(k, step)
        if self.query_scale is not None:
            q = q * query_scales(self.query_scale, step)
        state = step.cache.layers[self.layer]
        keys, values = state.append(k, v)
        if self.chunk is not None:  # row 0 of a sliding cache's keys is ``offset`` positions before this step
            first = step.start - (state.offset if isinstance(state, SlidingKVCache) else step.start)
            out = chunked_attention(ops, q, keys, values, step.start, first, self.scale, self.chunk)
        elif self.window is None and self.sinks is None:
            out = ops.attention(q, keys, values, step.start, self.scale)
        else:  # a sliding cache holds the last positions only: its offset is where this step starts
            start = state.offset if isinstance(state, SlidingKVCache) else step.start
            out = ops.windowed_attention(q, keys, values, start, self.scale, self.window, _v(self.sinks))
        out = out.reshape(t, self.n_heads * self.v_head_dim)
        if gate is not None:
            out = out * ops.sigmoid(gate)
        return out


def rope_tables(rope: RoPE, step: Step):
    """cos/sin for this step's positions, computed once and shared by all layers."""
    key = ("rope", id(rope))
    tables = step.memo.get(key)
    if tables is None:
        cos, sin = rope.cos_sin(step.positions)
        tables = step.memo[key] = (step.ops.asarray(cos), step.ops.asarray(sin))
    return tables


class SoftmaxTopKRouter:
    """Softmax over expert logits, then the top k (optionally renormalised)."""

    def __init__(self, gate: Linear, top_k: int, norm_topk_prob: bool):
        self.gate, self.top_k, self.norm_topk_prob = gate, top_k, norm_topk_prob
        gate.weight.role = "router"  # routing decisions stay at the stored precision

    def __call__(self, x, step: Step) -> tuple[np.ndarray, np.ndarray]:
        return step.ops.softmax_top_k(x, self.gate.weight.value, self.top_k, self.norm_topk_prob, _v(self.gate.bias))


class RoutedExperts:
    """The routed experts of one MoE layer, served by the expert store: SiLU-SwiGLU
    experts through ``ops.routed_experts``; experts with biases, a fused gate_up or
    another ``GatedActivation`` (``decl.activation``) through
    ``ops.routed_glu_experts``."""

    def __init__(self, decl: ExpertDecl):
        self.decl = decl
        self.store = None  # attached when the model is placed

    def __call__(self, x, indices: np.ndarray, weights: np.ndarray, step: Step, counted: np.ndarray | None = None):
        """``counted``: the routing the statistics see (``Step.routing``, the store's
        counts) when it is not ``indices`` (``SparseMoE``'s zero experts: the real experts
        chosen, without the padding slots)."""
        layer = self.decl.moe_index
        counted = indices if counted is None else counted
        if step.routing is not None:
            step.routing.append((self.decl.layer, counted.copy()))
        store = self.store
        # a token's k experts are distinct: sorting them is enough (np.unique costs more)
        experts = np.sort(indices[0]) if indices.shape[0] == 1 else np.unique(indices)
        if indices.shape[1] == 0:  # no real expert chosen (zero experts only): nothing to read
            store.end_layer(layer, counted, experts)
            return step.ops.zeros(tuple(x.shape), step.ops.activation_dtype)
        clock = step.clock
        if clock is not None:  # since the previous lap: the MLP's norm and the router
            clock.lap(ROUTERS)
            waited = store.stats.read_wait_ns
        if store.compute is not None:  # computed elsewhere (a compute tier), the same sums
            out = store.compute.routed_experts(self.decl, x, indices, weights, step.ops, lambda e: store.get(layer, e))
            store.end_layer(layer, counted, experts)
            if clock is not None:
                self._lap(clock, store.stats.read_wait_ns - waited)
            return out
        at_hand = store.request(layer, experts)  # the misses are read together
        def fetch(e):
            return store.get(layer, e)

        ready = None if at_hand else lambda e: store.ready(layer, e)
        decl = self.decl
        if decl.glu:
            out = step.ops.routed_glu_experts(x, indices, weights, fetch, decl.activation,
                                              window=store.io_window, ready=ready)
        else:
            out = step.ops.routed_experts(x, indices, weights, fetch, store.io_window, ready)
        store.end_layer(layer, counted, experts)
        if clock is not None:
            self._lap(clock, store.stats.read_wait_ns - waited)
        return out

    @staticmethod
    def _lap(clock: StageClock, waited_ns: int) -> None:
        clock.lap(ROUTED_EXPERTS)
        clock.move(waited_ns, ROUTED_EXPERTS, EXPERT_READS)


class SparseMoE:
    """Router + routed experts, with an optional shared expert (optionally gated).
    ``weight_inputs``: each routing weight scales its expert's input instead of its output,
    sum_k expert_k(w_k * x) (Llama 4: the experts are not linear, so this differs from
    sum_k w_k * expert_k(x)); the store then computes each (token, expert) pair as a row
    of its own, weighted 1, whatever tier serves the experts. ``zero_experts``: the
    router's slots from the experts' count on are that many zero-computation experts
    (LongCat-Flash): each adds the token itself times its routing weight, after the real
    experts; they are never read nor given a cache slot, and the routing statistics
    (``Step.routing``, the store's counts and history) count the real experts only,
    ``zero_slots`` the slots that went to zero experts (``nn.zero_experts``)."""

    def __init__(self, router, experts: RoutedExperts, shared=None, shared_gate: Linear | None = None,
                 weight_inputs: bool = False, zero_experts: int = 0):
        self.router, self.experts = router, experts
        self.shared, self.shared_gate = shared, shared_gate
        self.weight_inputs = weight_inputs
        if zero_experts < 0 or (zero_experts and weight_inputs):
            raise ValueError(f"zero_experts must be >= 0 and without weight_inputs, got {zero_experts}")
        self.zero_experts, self.zero_slots = zero_experts, 0

    def _with_zero_experts(self, x, indices: np.ndarray, weights: np.ndarray, step: Step):
        """The real experts' slots through the store, then x times each token's zero slots' weight."""
        real, real_weights, counted, identity = split_zero_experts(indices, weights, self.experts.decl.count)
        out = self.experts(x, real, real_weights, step, counted=counted)
        self.zero_slots += indices.size - counted.size
        if identity.any():
            out = step.ops.add_rows(out, np.arange(identity.shape[0]), x, identity)
        return out

    def _input_weighted(self, x, indices: np.ndarray, weights: np.ndarray, step: Step):
        """sum_k expert_k(w_k * x): rows (token, k) of x scaled by their weight, each routed to
        its one expert with weight 1, then summed over k in rank order."""
        ops = step.ops
        t, k = indices.shape
        if k > 1:
            x = ops.take_rows(x, np.repeat(np.arange(t), k))
        scaled = x * ops.asarray(np.ascontiguousarray(weights.reshape(t * k, 1), dtype=np.float32))
        out = self.experts(scaled, indices.reshape(t * k, 1), np.ones((t * k, 1), np.float32), step)
        if k == 1:
            return out
        out = out.reshape(t, k, out.shape[-1])
        total = out[:, 0]
        for j in range(1, k):
            total = total + out[:, j]
        return total

    def __call__(self, x, step: Step):
        indices, weights = self.router(x, step)
        if self.weight_inputs:
            out = self._input_weighted(x, indices, weights, step)
        elif self.zero_experts:
            out = self._with_zero_experts(x, indices, weights, step)
        else:
            out = self.experts(x, indices, weights, step)
        if self.shared is not None:
            shared = self.shared(x, step)
            if self.shared_gate is not None:
                shared = step.ops.sigmoid(self.shared_gate(x, step)) * shared
            out = out + shared
        return out


class DecoderLayer:
    """Pre-norm residual block: x + attn(norm(x)), then h + mlp(norm(h)). ``attn`` is any
    token mixer with ``new_state`` (attention, a recurrent layer such as GatedDeltaNet).
    ``attn_post`` / ``mlp_post``, when given, transform a branch's output before it joins
    the residual (Inkling's short convolutions). Blocks keeping named parts of the layer's
    state declare them in ``state_slots`` (the mixer then has no ``new_state``): the
    layer's state is one ``LayerStates`` of all their slots. A layer of one branch
    (Nemotron-H's: a mixer or an MLP each) has None for the other and for its norm; without
    a mixer it keeps no state."""

    def __init__(self, attn_norm: RMSNorm, attn: Attention, mlp_norm: RMSNorm, mlp, attn_post=None, mlp_post=None):
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp
        self.attn_post, self.mlp_post = attn_post, mlp_post

    def new_state(self, backend, max_len: int):
        slotted = [b for b in (self.attn, self.attn_post, self.mlp, self.mlp_post) if hasattr(b, "state_slots")]
        if not slotted:
            return None if self.attn is None else self.attn.new_state(backend, max_len)
        slots: dict = {}
        for block in slotted:
            slots.update(block.state_slots(backend, max_len))
        return LayerStates(slots)

    def mix(self, x, step: Step):
        """The token mixer on norm(x) (x: the rows of every sequence of the step)."""
        return self.mix_normed(self.attn_norm(x, step), step)

    def mix_normed(self, normed, step: Step):
        """The token mixer on rows already normalised."""
        if step.segments is None:
            return self.attn(normed, step)
        # each sequence's tokens through the mixer with that sequence's state
        if hasattr(self.attn, "batched"):  # its projections on all rows at once
            return self.attn.batched(normed, step)
        parts = [self.attn(normed[a:b], seg) for seg, (a, b) in zip(step.segments, step.rows)]
        return parts[0] if len(parts) == 1 else step.ops.concat(parts, 0)

    def __call__(self, x, step: Step):
        h, clock = x, step.clock
        if self.attn is not None:
            if clock is not None:
                clock.lap(OTHER)
            mixed = self.mix(x, step)
            h = x + (mixed if self.attn_post is None else self.attn_post(mixed, step))
            if clock is not None:
                clock.lap(ATTENTION)
        if step.prefetcher is not None:
            step.prefetcher.after_attention(self, h, step)
            if clock is not None:
                clock.lap(PREFETCH)
        if self.mlp is None:
            return h
        out = self.mlp(self.mlp_norm(h, step), step)
        if clock is not None:
            self.lap_mlp(clock)
        return h + (out if self.mlp_post is None else self.mlp_post(out, step))

    def lap_mlp(self, clock: StageClock) -> None:
        """The MLP's end: a MoE's time after its routed experts (shared experts, the sum),
        or a dense MLP's whole."""
        clock.lap(SHARED_EXPERTS if isinstance(self.mlp, SparseMoE) else DENSE_MLP)


class ParallelDecoderLayer(DecoderLayer):
    """One norm feeding both branches side by side (Cohere's layers): x + attn(norm(x)) +
    mlp(norm(x)), summed in that order."""

    def __init__(self, norm, attn, mlp):
        super().__init__(norm, attn, norm, mlp)

    def __call__(self, x, step: Step):
        clock = step.clock
        if clock is not None:
            clock.lap(OTHER)
        normed = self.attn_norm(x, step)
        mixed = self.mix_normed(normed, step)
        if clock is not None:
            clock.lap(ATTENTION)
        if step.prefetcher is not None:  # predicts the next MoE layer's experts from the layer's input
            step.prefetcher.after_attention(self, x, step)
            if clock is not None:
                clock.lap(PREFETCH)
        out = self.mlp(normed, step)
        if clock is not None:
            self.lap_mlp(clock)
        return x + mixed + out


class NormedEmbedding(Embedding):
    """Embeddings RMS-normalised (Inkling's ``embed_tokens.embed_norm``)."""

    def __init__(self, weight: Param, norm: RMSNorm, embedded_as: dict[int, int] | None = None):
        super().__init__(weight, embedded_as)
        self.norm = norm

    def __call__(self, ids: np.ndarray, step: Step):
        return self.norm(super().__call__(ids, step), step)


class ScaledEmbedding(Embedding):
    """Embedding rows times a constant (Granite's ``embedding_multiplier``); the table
    itself, which a tied LM head shares, is left as stored."""

    def __init__(self, weight: Param, scale: float, embedded_as: dict[int, int] | None = None):
        super().__init__(weight, embedded_as)
        self.scale = float(scale)

    def __call__(self, ids: np.ndarray, step: Step):
        return super().__call__(ids, step) * self.scale


class DividedInput:
    """``block`` applied to x / divisor (Inkling's muP output: the final hidden states
    divided by ``logits_mup_width_multiplier`` before the LM head)."""

    def __init__(self, block, divisor: float):
        self.block, self.divisor = block, float(divisor)

    def __call__(self, x, step: Step):
        return self.block(x / self.divisor, step)


class CausalLM:
    """Token embeddings, decoder layers, final norm and the LM head."""

    def __init__(self, *, embed: Embedding, layers: list, norm: RMSNorm, lm_head: Linear, vocab_size: int, max_context: int,
                 refused_tokens: dict[int, str] | None = None):
        self.embed, self.layers, self.norm, self.lm_head = embed, layers, norm, lm_head
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.prefetcher = None  # set when the model is placed with prefetch on
        self.mtp: list = []  # multi-token-prediction layers (nn.mtp.MTPLayer), built only when asked
        # what ``hidden`` collects for them: the final-normed rows, or (True) the layers' output
        # before the final norm (DeepSeek-V4's MTP layer reads the hyper-connection streams)
        self.hidden_before_norm = False
        # token id -> why a prompt may not contain it (e.g. the image placeholder of a
        # vision-language checkpoint whose text model is all colibri runs)
        self.refused_tokens = dict(refused_tokens or {})

    def check_prompt(self, ids) -> None:
        """Refuse token ids outside the vocabulary, and prompts this model cannot honour
        (see ``refused_tokens``)."""
        from colibri_core.errors import UsageError

        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if not self.refused_tokens:
            return
        for t in ids:
            reason = self.refused_tokens.get(int(t))
            if reason is not None:
                from colibri_core.errors import UnsupportedModelError

                raise UnsupportedModelError(f"the prompt contains token {int(t)}: {reason}")

    def new_cache(self, backend) -> Cache:
        return Cache([layer.new_state(backend, self.max_context) for layer in self.layers])

    def routed_experts(self) -> list[RoutedExperts]:
        """Every MoE layer's routed experts, the MTP layers' last."""
        layers = self.layers + [m.block for m in self.mtp]
        return [layer.mlp.experts for layer in layers if isinstance(getattr(layer, "mlp", None), SparseMoE)]

    def forward(self, ids: np.ndarray, cache: Cache, ops, *, all_logits: bool = False, routing: list | None = None,
                watch=None, after_layer=None, hidden: list | None = None, clock: StageClock | None = None):
        """Run new tokens ``ids`` through the model, extending ``cache``. Returns float32
        logits on the host: (T, vocab) with ``all_logits``, else (vocab,) of the last.
        ``watch(stage, x)``, when given, sees the activations after every stage;
        ``after_layer(n)``, when given, is told after each layer how many are done;
        ``hidden``, when a list, gets the final-normed hidden states of every new token
        (a backend array, (T, hidden); with ``hidden_before_norm`` the layers' output, for
        hyper-connections (T, streams, hidden)): what multi-token-prediction layers read;
        ``clock``: a ``StageClock`` told where the time goes."""
        ids = np.asarray(ids, dtype=np.int64)
        positions = np.arange(cache.length, cache.length + len(ids), dtype=np.int64)
        step = Step(ops, positions, cache, routing=routing, prefetcher=self.prefetcher, ids=ids, clock=clock)
        x = self._embed(ids, step)
        if watch is not None:
            watch("the token embeddings", x)
        for n, layer in enumerate(self.layers):
            x = layer(x, step)
            if watch is not None:
                watch(f"layer {n} (of {len(self.layers)}, counting from 0 as the weight names do)", x)
            if after_layer is not None:
                after_layer(n + 1)
        self._after_layers(step)
        cache.length += len(ids)
        if hidden is not None:  # normed apart: the logits' rows stay the very computation they are without
            hidden.append(x if self.hidden_before_norm else self.norm(x, step))
        x = x if all_logits else x[-1:]
        x = self.norm(x, step)
        if watch is not None:
            watch("the final norm", x)
        logits = ops.to_host(self.lm_head(x, step))
        if clock is not None:
            clock.lap(LM_HEAD)
        if watch is not None:
            watch("the LM head", logits)
        return logits if all_logits else logits[0]

    def _embed(self, ids: np.ndarray, step: Step):
        clock = step.clock
        if self.prefetcher is not None:
            self.prefetcher.after_embedding(step)
            if clock is not None:
                clock.lap(PREFETCH)
        x = self.embed(ids, step)
        if clock is not None:
            clock.lap(EMBED)
        return x

    def _after_layers(self, step: Step) -> None:
        clock = step.clock
        if clock is not None:
            clock.lap(OTHER)
        if self.prefetcher is not None:
            self.prefetcher.after_layers(step)
            if clock is not None:
                clock.lap(PREFETCH)

    def first_faulty_stage(self, ids: list[int], ops, chunk: int = 256) -> tuple[str, str] | None:
        """Re-run ``ids`` from an empty cache, looking at the activations after every
        stage: (the first stage whose output is non-finite or degenerate, what is wrong
        with it), or None when all stay sound. A diagnosis after bad logits, never on the
        normal path."""
        class Found(Exception):
            pass

        last_chunk = False

        def watch(stage, x):
            fault = activation_fault(x if isinstance(x, np.ndarray) else ops.to_host(x), sampled_row=last_chunk)
            if fault is not None:
                raise Found(stage, fault)

        cache = self.new_cache(ops)
        try:
            for i in range(0, len(ids), chunk):
                last_chunk = i + chunk >= len(ids)
                self.forward(np.asarray(ids[i : i + chunk]), cache, ops, watch=watch)
        except Found as found:
            return found.args[0], found.args[1]
        return None

    def forward_batch(self, seqs: list[tuple[np.ndarray, Cache]], ops, *, routing: list | None = None,
                      all_logits: bool = False, hidden: list | None = None,
                      clock: StageClock | None = None) -> np.ndarray:
        """One batched step: ``seqs`` lists (new token ids, cache) of distinct sequences,
        each at its own position. Entries may share a cache: they are consecutive positions
        of one sequence, each computed as a step of its own in this order (a speculative
        verification: every drafted token exactly as a decode step computes it). Extends
        every cache; returns host float32 logits
        (len(seqs), vocab), the row of each sequence's last new token, or with
        ``all_logits`` every new token's row, sequence after sequence. ``hidden``: as in
        ``forward``, every row's; ``clock``: as in ``forward``."""
        ids = [np.asarray(i, dtype=np.int64) for i, _ in seqs]
        segments, rows, begin = [], [], 0
        fed: dict[int, int] = {}  # tokens of each cache earlier in ``seqs``
        for seq_ids, cache in seqs:
            at = cache.length + fed.get(id(cache), 0)
            fed[id(cache)] = fed.get(id(cache), 0) + len(seq_ids)
            positions = np.arange(at, at + len(seq_ids), dtype=np.int64)
            segments.append(Step(ops, positions, cache))
            rows.append((begin, begin + len(seq_ids)))
            begin += len(seq_ids)
        step = Step(ops, np.concatenate([s.positions for s in segments]), None, routing=routing,
                    prefetcher=self.prefetcher, segments=segments, rows=rows, ids=np.concatenate(ids), clock=clock,
                    runs=_runs(seqs, segments, rows))
        x = self._embed(step.ids, step)
        for layer in self.layers:
            x = layer(x, step)
        self._after_layers(step)
        for seq_ids, (_, cache) in zip(ids, seqs):
            cache.length += len(seq_ids)
        last = np.asarray([b - 1 for _, b in rows], dtype=np.int64)
        if hidden is not None and self.hidden_before_norm:
            hidden.append(x)
        if all_logits or begin == len(seqs):
            x = self.norm(x, step)
            if hidden is not None and not self.hidden_before_norm:
                hidden.append(x)
            logits = ops.to_host(self.lm_head(x, step))
        else:
            if hidden is not None and not self.hidden_before_norm:
                hidden.append(self.norm(x, step))
            x = ops.take_rows(x, last)  # some sequence brought several tokens: keep each one's last
            logits = ops.to_host(self.lm_head(self.norm(x, step), step))
        if clock is not None:
            clock.lap(LM_HEAD)
        return logits


def _runs(seqs, segments: list[Step], rows: list[tuple[int, int]]):
    """The segments of consecutive entries sharing a cache (a verification's positions of
    one sequence) merged into one Step each, with their rows; None when no two share one."""
    if not any(a[1] is b[1] for a, b in zip(seqs, seqs[1:])):  # an ordinary batched step: nothing to merge
        return None
    runs: list[tuple[Step, tuple[int, int]]] = []
    for (_, cache), seg, (a, b) in zip(seqs, segments, rows):
        if runs and runs[-1][0].cache is cache:
            first, (a0, _) = runs[-1]
            runs[-1] = (Step(first.ops, np.concatenate([first.positions, seg.positions]), cache), (a0, b))
        else:
            runs.append((Step(seg.ops, seg.positions, cache), (a, b)))
    return runs


# A row whose sum of squares passes this overflows in float32: the RMS norm that reads it
# divides by infinity and turns it into zeros, so the model goes on silently with nothing.
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def activation_fault(x: np.ndarray, *, sampled_row: bool = True) -> str | None:
    """What is wrong with activations ``x`` (rows of features), or None: NaN or infinity,
    values so large that a norm of them overflows float32, or, when ``sampled_row`` (the
    last row is the one the next token comes from), a last row with the same value in
    every element. Other rows may be constant (say, a zero embedding at position 0)."""
    x = np.asarray(x)
    if not np.isfinite(x).all():
        return "it holds NaN or infinity"
    rows = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    squares = np.square(rows, dtype=np.float64).sum(axis=-1)
    if (squares > _FLOAT32_MAX).any():
        return (f"its values reach {float(np.abs(rows).max()):.3g}, so large that their squares overflow float32 "
                f"and the norm after it collapses them to zero")
    if sampled_row and rows.shape[-1] > 1 and rows[-1].min() == rows[-1].max():
        return f"every element is {float(rows[-1][0]):.3g}"
    return None
