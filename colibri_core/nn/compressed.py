"""DeepSeek-V4 attention: shared-KV multi-query attention over a sliding window, plus
compressed entries (transformers: models/deepseek_v4, ``DeepseekV4Attention``).

Every layer projects one KV head per token (``kv``, RMS-normalised, its rope channels
rotated) that serves as both key and value of all query heads, and attends over the last
``window`` tokens with a learned sink logit per head. Compressed layers add entries that
each summarise ``rate`` consecutive tokens (``WindowCompressor``): the tokens' projected
kv rows weighted by a per-channel softmax over the window of their gate rows plus a
learned bias by slot, RMS-normalised and rotated at the window's first position.

- HCA (heavily compressed attention, rate 128 in V4): windows side by side; a query sees
  every entry whose window it has passed (entry e once position (e + 1) * rate - 1 is
  reached).
- CSA (compressed sparse attention, rate 4): each entry spans two windows (the first
  series of window e - 1 and the second of window e, ``overlap``), and a lightning
  indexer (``CompressedIndexer``, its own compressor at ``index_head_dim``) picks the
  ``index_topk`` entries each query sees.

The value of a key carries its rotation, so the attention output's rope channels are
rotated back by the query's position (the conjugate rotation) before the grouped output
projection (``o_groups`` block-diagonal groups to ``o_lora_rank`` each, then ``o_b``).

Layout: transformers rotates the *last* ``rope_dim`` channels of each head as interleaved
pairs. colibri computes every head in another channel order, fixed at load by permuting
the rows of the projections, the norm weights, the slot biases and the columns of the
output projection (``rope_first``): the rope channels first, de-interleaved (first
members of the pairs, then second members), then the others. Dot products, softmaxes and
RMS norms do not depend on the order, and the usual rotate-half ``ops.rope`` on the first
``rope_dim`` channels is then exactly the pairwise rotation.

The cache (``CompressedAttentionState``) holds what the architecture intends: the
window's rows (one head of ``head_dim``), the compressed entries (one per ``rate``
tokens; CSA also the indexer's, ``index_head_dim`` each), and the tokens of the window
not yet closed (fewer than ``rate``; CSA also the previous window's first series).
"""

from __future__ import annotations

import numpy as np

from colibri_core.compute.backend import ITEMSIZE
from colibri_core.compute.host import top_k_indices
from colibri_core.nn.cache import check_saved_arrays, saved_length, to_backend
from colibri_core.nn.layers import Linear, RMSNorm, Step, rope_tables
from colibri_core.nn.mla import _Rows
from colibri_core.nn.rope import RoPE
from colibri_core.nn.weights import Param


def rope_first(dim: int, rope_dim: int) -> np.ndarray:
    """colibri's channel order of a head whose last ``rope_dim`` channels are interleaved
    rope pairs: those channels de-interleaved (evens, then odds), then the first
    ``dim - rope_dim``. ``head[order]`` is the head in colibri's order."""
    if rope_dim % 2 or not 0 < rope_dim <= dim:
        raise ValueError(f"rope_dim {rope_dim} must be even and within the head's {dim} channels")
    tail = np.arange(dim - rope_dim, dim)
    return np.concatenate([tail[0::2], tail[1::2], np.arange(dim - rope_dim)])


def permute_rows(order: np.ndarray, blocks: int):
    """Load transform: a (blocks * dim, ...) tensor (rows of ``blocks`` heads or series;
    a 1-D norm weight when blocks is 1) with each block's rows in ``order``."""
    dim = len(order)

    def permute(m):
        return np.ascontiguousarray(m.reshape(blocks, dim, *m.shape[1:])[:, order].reshape(m.shape))

    return permute


def permute_columns(order: np.ndarray):
    """Load transform: a (rows, k * dim) tensor whose columns are ``k`` heads (or series),
    each head's columns in ``order``."""
    dim = len(order)

    def permute(m):
        rows, cols = m.shape
        return np.ascontiguousarray(m.reshape(rows, cols // dim, dim)[:, :, order].reshape(rows, cols))

    return permute


class SlidingRows:
    """One stream of (positions, dim) rows of which only the last ``window - 1`` are kept
    between steps (each new position sees itself and those): a K = V sliding-window
    cache. ``append`` returns the kept rows followed by the new ones; ``offset`` is how
    many of them precede the new ones."""

    def __init__(self, backend, dim: int, window: int):
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        self.backend, self.dim, self.window = backend, dim, int(window)
        self.length = self.kept = self.offset = 0
        self._data = None

    def append(self, rows):
        keep = min(self.kept, self.window - 1)
        if keep < self.kept:  # drop what no later query sees
            a = self.kept - keep
            self._data[:keep] = self._data[a : self.kept] * 1.0  # * 1.0: a copy, the ranges may overlap
        t = rows.shape[0]
        end = keep + t
        capacity = 0 if self._data is None else self._data.shape[0]
        if end > capacity:
            data = self.backend.zeros((end, self.dim), self.backend.cache_dtype)
            if keep:
                data[:keep] = self._data[:keep]
            self._data = data
        self._data[keep:end] = rows
        self.offset, self.kept = keep, end
        self.length += t
        return self._data[:end]

    def last(self):
        """The rows a later query may still see (the last ``window - 1``)."""
        n = min(self.kept, self.window - 1)
        return self._data[self.kept - n : self.kept]

    def snapshot(self) -> dict:
        """A copy of what the next step reads, and the length (``restore`` goes back to it)."""
        return {"rows": None if self._data is None else self.last() * 1.0, "length": self.length}

    def restore(self, snapshot: dict) -> None:
        rows = snapshot["rows"]
        self._data = None if rows is None else rows * 1.0
        self.kept = 0 if rows is None else int(rows.shape[0])
        self.offset, self.length = 0, snapshot["length"]

    @property
    def nbytes(self) -> int:
        return 0 if self._data is None else int(self.backend.nbytes(self._data))


class CompressorState:
    """A compressor's per-sequence state: its entries so far, the rows of the window not
    yet closed (``pending``, fewer than ``rate``) and, with ``overlap``, the previous
    window's first series (``prior``)."""

    def __init__(self, backend, dim: int, width: int, rate: int, max_len: int):
        self.backend, self.dim, self.width, self.rate = backend, dim, width, rate
        self.entries = _Rows(backend, dim, max_len // rate + 1)
        self.pending_kv = self.pending_gate = None
        self.prior_kv = self.prior_gate = None

    @property
    def count(self) -> int:
        return self.entries.length

    def all_entries(self):
        """(count, dim) entries, or None before the first window closes."""
        return None if self.count == 0 else self.entries._data[: self.count]

    def arrays(self) -> dict:
        parts = {"entries": self.all_entries(), "pending_kv": self.pending_kv, "pending_gate": self.pending_gate,
                 "prior_kv": self.prior_kv, "prior_gate": self.prior_gate}
        return {name: a for name, a in parts.items() if a is not None}

    @property
    def nbytes(self) -> int:
        held = [a for a in (self.pending_kv, self.pending_gate, self.prior_kv, self.prior_gate) if a is not None]
        return self.entries.nbytes + sum(int(self.backend.nbytes(a)) for a in held)

    def fixed_bytes(self) -> int:
        """The most the pending rows and the prior series take (activation floats)."""
        return 4 * (2 * (self.rate - 1) * self.width + (2 * self.rate * self.dim if self.width != self.dim else 0))

    def entry_bytes(self) -> int:
        return self.dim * ITEMSIZE[self.backend.cache_dtype]

    def snapshot(self) -> dict:
        """The entry count and the pending and prior rows (each step replaces those, so
        references will do): ``restore`` goes back to them; entries are only appended."""
        return {"count": self.count, "pending_kv": self.pending_kv, "pending_gate": self.pending_gate,
                "prior_kv": self.prior_kv, "prior_gate": self.prior_gate}

    def restore(self, snapshot: dict) -> None:
        self.entries.length = snapshot["count"]
        self.pending_kv, self.pending_gate = snapshot["pending_kv"], snapshot["pending_gate"]
        self.prior_kv, self.prior_gate = snapshot["prior_kv"], snapshot["prior_gate"]


class WindowCompressor:
    """Compresses every ``rate`` tokens into one entry of ``dim`` channels (transformers'
    ``DeepseekV4HCACompressor``, and with ``overlap`` the ``DeepseekV4CSACompressor`` /
    the indexer's compressor). ``kv`` and ``gate`` project each token to ``width`` = dim
    (or 2 * dim with ``overlap``: the first series for the next entry, the second for its
    own), ``bias`` (rate, width) is added to the gate by slot; per channel, the entry is
    sum_j softmax_j(gate + bias) * kv over the window's slots (2 * rate with ``overlap``,
    the previous window's first series before this window's second series; none before
    the first window), then ``norm``, then rotated at position entry * rate."""

    def __init__(self, *, kv: Linear, gate: Linear, bias: Param, norm: RMSNorm, dim: int, rate: int, overlap: bool,
                 rope: RoPE):
        self.kv, self.gate, self.bias, self.norm = kv, gate, bias, norm
        self.dim, self.rate, self.overlap, self.rope = dim, rate, overlap, rope
        self.width = 2 * dim if overlap else dim
        if bias.shape != (rate, self.width):
            raise ValueError(f"compressor bias {bias.shape} != {(rate, self.width)}")

    def new_state(self, backend, max_len: int) -> CompressorState:
        return CompressorState(backend, self.dim, self.width, self.rate, max_len)

    def __call__(self, x, state: CompressorState, step: Step):
        """Absorb this step's rows x (T, hidden); returns every entry so far (n, dim) or None."""
        ops = step.ops
        kv, gate = ops.linears(x, [self.kv.weight.value, self.gate.weight.value])
        if state.pending_kv is not None and state.pending_kv.shape[0]:
            kv, gate = ops.concat([state.pending_kv, kv], 0), ops.concat([state.pending_gate, gate], 0)
        m, d = self.rate, self.dim
        n = kv.shape[0] // m
        used = n * m
        state.pending_kv, state.pending_gate = kv[used:] * 1.0, gate[used:] * 1.0  # copies: kv is dropped
        if n == 0:
            return state.all_entries()
        kv = kv[:used].reshape(n, m, self.width)
        gate = gate[:used].reshape(n, m, self.width) + self.bias.value
        if self.overlap:
            first_kv, first_gate = kv[:, :, :d], gate[:, :, :d]
            if state.prior_kv is None:  # before the first window: slots of no weight
                prior_kv = ops.zeros((1, m, d), ops.activation_dtype)
                prior_gate = ops.asarray(np.full((1, m, d), -np.inf, dtype=np.float32), ops.activation_dtype)
            else:
                prior_kv, prior_gate = state.prior_kv.reshape(1, m, d), state.prior_gate.reshape(1, m, d)
            if n > 1:
                prior_kv = ops.concat([prior_kv, first_kv[:-1]], 0)
                prior_gate = ops.concat([prior_gate, first_gate[:-1]], 0)
            state.prior_kv, state.prior_gate = first_kv[-1] * 1.0, first_gate[-1] * 1.0
            kv = ops.concat([prior_kv, kv[:, :, d:]], 1)
            gate = ops.concat([prior_gate, gate[:, :, d:]], 1)
        slots = kv.shape[1]
        weights = ops.softmax(gate.transpose(0, 2, 1)).transpose(0, 2, 1)  # per channel, over the slots
        weighted = kv * weights
        pooled = weighted[:, 0]
        for j in range(1, slots):  # in slot order
            pooled = pooled + weighted[:, j]
        entries = self.norm(pooled, step)
        positions = (state.count + np.arange(n, dtype=np.int64)) * m
        cos, sin = self.rope.cos_sin(positions)
        entries = ops.rope(entries.reshape(n, 1, d), ops.asarray(cos), ops.asarray(sin), self.rope.rotary_dim)
        return state.entries.append(entries.reshape(n, d))


def visible_entries(positions: np.ndarray, count: int, rate: int) -> np.ndarray:
    """(T, count) host bool: the entries a query at each position may see, those of the
    windows it has passed (entry e once (e + 1) * rate - 1 is reached)."""
    return np.arange(count)[None, :] < ((positions + 1) // rate)[:, None]


class CompressedIndexer:
    """The lightning indexer of a CSA layer (``DeepseekV4Indexer``): its own overlapping
    compressor at ``head_dim`` gives one key per entry; each query (``q_b`` of the
    attention's q LoRA activation, ``n_heads`` heads, rotated at its position) scores the
    entries it may see, sum_h w[t, h] * relu(q[t, h] . k[e] / sqrt(head_dim)) with w =
    weights_proj(x) / sqrt(n_heads), and sees only the ``topk`` best."""

    def __init__(self, *, compressor: WindowCompressor, q_b: Linear, weights_proj: Linear, n_heads: int, head_dim: int,
                 topk: int, rope: RoPE):
        self.compressor, self.q_b, self.weights_proj = compressor, q_b, weights_proj
        self.n_heads, self.head_dim, self.topk, self.rope = n_heads, head_dim, topk, rope

    def __call__(self, x, q_resid, state: CompressorState, step: Step) -> np.ndarray:
        """(T, entries) host bool: the entries each query sees."""
        ops = step.ops
        keys = self.compressor(x, state, step)
        t = x.shape[0]
        valid = visible_entries(step.positions, state.count, self.compressor.rate)
        if keys is None or self.topk >= state.count:  # every entry it may see is chosen
            return valid
        cos, sin = rope_tables(self.rope, step)
        q = self.q_b(q_resid, step).reshape(t, self.n_heads, self.head_dim)
        q = ops.rope(q, cos, sin, self.rope.rotary_dim)
        weights = self.weights_proj(x, step) * (self.n_heads**-0.5)
        # every entry "visible" to the op; which a query may see is the window rule above
        scores = ops.to_host(ops.dsa_index_scores(q, keys, weights, self.head_dim**-0.5, state.count))
        scores = np.where(valid, scores, np.float32(-np.inf)).astype(np.float32)
        chosen = top_k_indices(scores, self.topk)  # the scores are on the host already: no round trip
        picked = np.zeros_like(valid)
        np.put_along_axis(picked, chosen, True, axis=-1)
        return picked & valid


class CompressedAttentionState:
    """One V4 attention layer's cache: the K = V rows of the sliding window and, in
    compressed layers, the compressor's state (and the indexer's). ``arrays`` names the
    parts a later step depends on (for comparisons)."""

    def __init__(self, backend, head_dim: int, window: int, max_len: int, compressor: WindowCompressor | None,
                 indexer: CompressedIndexer | None):
        self.backend = backend
        self.rows = SlidingRows(backend, head_dim, window)
        self.compressed = compressor.new_state(backend, max_len) if compressor is not None else None
        self.index = indexer.compressor.new_state(backend, max_len) if indexer is not None else None

    @property
    def length(self) -> int:
        return self.rows.length

    @property
    def arrays(self) -> dict:
        out = {} if self.rows._data is None else {"window": self.rows.last()}
        for prefix, part in (("compressor", self.compressed), ("indexer", self.index)):
            if part is not None:
                out.update({f"{prefix}.{name}": a for name, a in part.arrays().items()})
        return out

    def __getitem__(self, name: str):
        return self.arrays[name]

    def _parts(self):
        return [p for p in (self.compressed, self.index) if p is not None]

    def snapshot(self) -> dict:
        """What ``restore`` needs to go back to this length (a speculative verification's
        rejected drafts); not a prefix for another sequence: no ``copy_prefix``."""
        return {"rows": self.rows.snapshot(), "compressed": self.compressed and self.compressed.snapshot(),
                "index": self.index and self.index.snapshot()}

    def restore(self, n: int, snapshot: dict) -> None:
        if snapshot["rows"]["length"] != n:
            raise ValueError(f"the compressed attention snapshot holds {snapshot['rows']['length']} positions, not {n}")
        self.rows.restore(snapshot["rows"])
        for part, snap in ((self.compressed, snapshot["compressed"]), (self.index, snapshot["index"])):
            if part is not None:
                part.restore(snap)

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + sum(p.nbytes for p in self._parts())

    state_kind = "compressed_attention"

    def _named_parts(self) -> dict:
        return {name: p for name, p in (("compressor", self.compressed), ("indexer", self.index)) if p is not None}

    def export_state(self) -> tuple[dict, dict]:
        """What later steps read: the window's last rows and, per compressor, its entries,
        the rows of the window not closed yet and the previous window's first series."""
        n = self.rows.length
        out = {}
        if self.rows._data is not None and min(self.rows.kept, self.rows.window - 1):
            out["window"] = self.rows.last()
        for prefix, part in self._named_parts().items():
            if part.count:
                out[f"{prefix}.entries"] = part.all_entries()
            for name in ("pending_kv", "pending_gate", "prior_kv", "prior_gate"):
                a = getattr(part, name)
                if a is not None and a.shape[0]:
                    out[f"{prefix}.{name}"] = a
        return {"length": n}, out

    def _saved_shapes(self, n: int) -> dict:
        """The arrays a state of ``n`` positions holds (see ``export_state``)."""
        shapes = {}
        keep = min(n, self.rows.window - 1)
        if keep:
            shapes["window"] = (keep, self.rows.dim)
        for prefix, part in self._named_parts().items():
            count, pending = n // part.rate, n % part.rate
            if count:
                shapes[f"{prefix}.entries"] = (count, part.dim)
            if pending:
                shapes[f"{prefix}.pending_kv"] = shapes[f"{prefix}.pending_gate"] = (pending, part.width)
            if count and part.width != part.dim:  # overlapping windows: the last closed one's first series
                shapes[f"{prefix}.prior_kv"] = shapes[f"{prefix}.prior_gate"] = (part.rate, part.dim)
        return shapes

    def import_state(self, meta: dict, arrays: dict) -> None:
        n = saved_length(meta, 1 << 62)
        check_saved_arrays(arrays, self._saved_shapes(n))
        backend = self.backend
        rows = self.rows
        window = arrays.get("window")
        rows._data = None if window is None else to_backend(backend, window, backend.cache_dtype)
        rows.kept = 0 if window is None else int(window.shape[0])
        rows.offset, rows.length = 0, n
        for prefix, part in self._named_parts().items():
            count = n // part.rate
            if count:
                part.entries._grow(count)
                part.entries._data[:count] = to_backend(backend, arrays[f"{prefix}.entries"], backend.cache_dtype)
            part.entries.length = count
            for name in ("pending_kv", "pending_gate", "prior_kv", "prior_gate"):
                a = arrays.get(f"{prefix}.{name}")
                setattr(part, name, None if a is None else to_backend(backend, a, backend.activation_dtype))

    def bytes_per_token(self) -> int:
        """Per position: a window row (while the sequence is shorter than the window: an
        upper bound) plus the entries' share (entry bytes / rate, rounded up)."""
        row = self.rows.dim * ITEMSIZE[self.backend.cache_dtype]
        return row + sum(-(-p.entry_bytes() // p.rate) for p in self._parts())

    def bytes_for(self, tokens: int) -> int:
        """What the layer holds after ``tokens`` positions: at most the window's rows, one
        entry per ``rate`` tokens, and the bounded pending rows."""
        row = self.rows.dim * ITEMSIZE[self.backend.cache_dtype]
        return min(tokens, self.rows.window) * row + sum(
            (tokens // p.rate) * p.entry_bytes() + p.fixed_bytes() for p in self._parts())


class CompressedAttention:
    """DeepSeek-V4's attention (see the module docstring). q: ``q_a`` -> ``q_a_norm`` ->
    ``q_b`` (n_heads x head_dim), each head RMS-normalised without weight; kv: ``kv`` ->
    ``kv_norm`` (one head). ``rope``: the layer's (V4: the "main" rope in sliding layers,
    the "compress" rope in compressed ones, which their compressors share). ``o_a``
    (o_groups * o_lora_rank, n_heads * head_dim / o_groups) an array weight; ``sinks``
    (n_heads,). ``compressor``: HCA or CSA entries; ``indexer``: CSA's selection."""

    def __init__(self, *, layer: int, q_a: Linear, q_a_norm: RMSNorm, q_b: Linear, kv: Linear, kv_norm: RMSNorm,
                 o_a: Param, o_b: Linear, sinks: Param, n_heads: int, head_dim: int, rope: RoPE, window: int,
                 o_groups: int, eps: float, compressor: WindowCompressor | None = None,
                 indexer: CompressedIndexer | None = None):
        if indexer is not None and compressor is None:
            raise ValueError("a CSA indexer needs the layer's compressor")
        self.layer = layer
        self.q_a, self.q_a_norm, self.q_b, self.kv, self.kv_norm = q_a, q_a_norm, q_b, kv, kv_norm
        self.o_a, self.o_b, self.sinks = o_a, o_b, sinks
        o_a.role = "plain"  # read by grouped_linear as an array
        self.n_heads, self.head_dim, self.rope, self.window = n_heads, head_dim, rope, window
        self.o_groups, self.eps = o_groups, eps
        self.compressor, self.indexer = compressor, indexer
        self.scale = head_dim**-0.5

    def new_state(self, backend, max_len: int) -> CompressedAttentionState:
        return CompressedAttentionState(backend, self.head_dim, self.window, max_len, self.compressor, self.indexer)

    def _project(self, x, step: Step):
        ops = step.ops
        q_resid = self.q_a_norm(self.q_a(x, step), step)
        q = ops.rms_norm(self.q_b(q_resid, step).reshape(x.shape[0], self.n_heads, self.head_dim), None, self.eps)
        return q, q_resid, self.kv_norm(self.kv(x, step), step)

    def _output(self, out, step: Step):
        return self.o_b(step.ops.grouped_linear(out, self.o_a.value, self.o_groups), step)

    def __call__(self, x, step: Step):
        q, q_resid, kv = self._project(x, step)
        return self._output(self._attend(x, q, q_resid, kv, step), step)

    def batched(self, x, step: Step):
        """A batched step: the projections on all rows, attention per sequence."""
        q, q_resid, kv = self._project(x, step)
        outs = [self._attend(x[a:b], q[a:b], q_resid[a:b], kv[a:b], seg) for seg, (a, b) in zip(step.segments, step.rows)]
        return self._output(outs[0] if len(outs) == 1 else step.ops.concat(outs, 0), step)

    def _attend(self, x, q, q_resid, kv, step: Step):
        """One sequence's rows -> its attention output (before the output projection)."""
        ops = step.ops
        t, d = x.shape[0], self.head_dim
        cos, sin = rope_tables(self.rope, step)
        rd = self.rope.rotary_dim
        q = ops.rope(q, cos, sin, rd)
        kv = ops.rope(kv.reshape(t, 1, d), cos, sin, rd).reshape(t, d)
        state: CompressedAttentionState = step.cache.layers[self.layer]
        keys = state.rows.append(kv)
        positions = step.positions
        kept = keys.shape[0]
        key_pos = step.start - state.rows.offset + np.arange(kept)
        visible = (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] > positions[:, None] - self.window)
        if self.compressor is not None:
            entries = self.compressor(x, state.compressed, step)
            if self.indexer is not None:
                chosen = self.indexer(x, q_resid, state.index, step)
            else:
                chosen = visible_entries(positions, state.compressed.count, self.compressor.rate)
            if entries is not None:
                keys = ops.concat([keys, entries], 0)
                visible = np.concatenate([visible, chosen], axis=1)
        keys = keys.reshape(1, keys.shape[0], d)
        out = ops.masked_attention(q, keys, keys, self.scale, visible, self.sinks.value)
        out = ops.rope(out, cos, -sin, rd)  # the values' rotation undone at the query's position
        return out.reshape(t, self.n_heads * d)
