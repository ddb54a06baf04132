"""Multi-head Latent Attention (MLA): DeepSeek V2/V3/V3.2, Kimi K2, GLM-4.7-Flash, GLM-5.

MLA compresses each token's keys and values into one latent vector (``kv_lora_rank``
floats, after the kv RMSNorm) plus one rotary key shared by all heads
(``qk_rope_head_dim`` floats). The cache holds exactly that: 576 floats per token per
layer for DeepSeek-V3, against 128 heads x (192 + 128) = 40,960 for the expanded keys and
values. Per-head keys and values are a linear function of the latent (``kv_b_proj``):

- prefill *expands* the latent into per-head keys and values (one matmul over the
  chunk) and runs ordinary attention;
- decode uses the *absorbed* form: the key up-projection is folded into the query
  (q_nope @ W_uk), attention runs against the cached latents directly, and the value
  up-projection is applied to the attention output (W_uv @ o). No past key is ever
  expanded again.

With a DSA indexer (``colibri_core.nn.dsa``), each query attends only to the keys its
indexer selects, in both forms.
"""

from __future__ import annotations

import math
from typing import Any

from colibri_core.compute.backend import ITEMSIZE
from colibri_core.nn.cache import check_saved_arrays, saved_length, to_backend
from colibri_core.nn.layers import Linear, RMSNorm, Step, rope_tables
from colibri_core.nn.rope import RoPE, rope_parameters


class _Rows:
    """One per-token stream of a layer's cache: (positions, dim) rows of the cache dtype grown by
    doubling up to the context length, so appending a token copies nothing."""

    def __init__(self, backend, dim: int, max_len: int):
        self.backend, self.dim, self.max_len = backend, dim, max_len
        self.length = 0
        self._data = None

    def _grow(self, end: int) -> None:
        capacity = 0 if self._data is None else self._data.shape[0]
        if end > capacity:
            new_cap = min(max(end, 2 * capacity, 64), max(self.max_len, end))
            data = self.backend.zeros((new_cap, self.dim), self.backend.cache_dtype)
            if self.length:
                data[: self.length] = self._data[: self.length]
            self._data = data

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` rows (at most the context) at once (as ``KVCache.reserve``)."""
        self._grow(min(tokens, self.max_len))

    def append(self, rows):
        """Add (T, dim) rows; return all rows so far (S, dim)."""
        end = self.length + rows.shape[0]
        self._grow(end)
        self._data[self.length : end] = rows
        self.length = end
        return self._data[:end]

    @property
    def nbytes(self) -> int:
        return 0 if self._data is None else int(self.backend.nbytes(self._data))


class MLACache:
    """The cache of one MLA layer: per token, the compressed latent (kv_lora_rank, after
    the kv norm) and the rotated shared key (qk_rope_head_dim) side by side in one row
    (the latent attention reads them as one key); with DSA, also the indexer's key
    (index_head_dim). Never the expanded per-head keys and values."""

    def __init__(self, backend, kv_lora_rank: int, rope_dim: int, max_len: int, index_dim: int = 0):
        self.rank = kv_lora_rank
        self.kv = _Rows(backend, kv_lora_rank + rope_dim, max_len)
        self.index_keys = _Rows(backend, index_dim, max_len) if index_dim else None

    @property
    def length(self) -> int:
        return self.kv.length

    def reserve(self, tokens: int) -> None:
        for rows in (self.kv, self.index_keys):
            if rows is not None:
                rows.reserve(tokens)

    def append(self, latent, k_rot):
        """Add (T, rank) latents and (T, rope) keys; return every position cached so far as
        (S, rank + rope) rows: its latent, then its rotary key."""
        return self.kv.append(self.kv.backend.concat([latent, k_rot], 1))

    def copy_prefix(self, dst: "MLACache", n: int, snapshot=None) -> None:
        """Give ``dst`` (empty) this cache's first ``n`` positions (prefix reuse)."""
        if n:
            for mine, theirs in ((self.kv, dst.kv), (self.index_keys, dst.index_keys)):
                if mine is not None:
                    theirs.append(mine._data[:n])

    def snapshot(self):
        """Nothing: earlier rows never change, so any prefix can be copied."""
        return None

    def rewind(self, n: int) -> None:
        """Forget the positions from ``n`` on (as ``KVCache.rewind``)."""
        for rows in (self.kv, self.index_keys):
            if rows is not None:
                rows.length = min(rows.length, n)

    def append_index(self, keys):
        """Add (T, index_dim) indexer keys; return all of them."""
        return self.index_keys.append(keys)

    state_kind = "mla"

    def export_state(self) -> tuple[dict, dict]:
        """The positions in use of each stream (latents, rotary keys, DSA indexer keys)."""
        n = self.length
        if self.index_keys is not None and self.index_keys.length != n:
            raise ValueError(f"its streams hold different numbers of positions: {n} latents, "
                             f"{self.index_keys.length} indexer keys")
        if not n:
            return {"length": 0}, {}
        kv = self.kv._data[:n]
        arrays = {"latent": kv[:, : self.rank], "k_rot": kv[:, self.rank :]}
        if self.index_keys is not None:
            arrays["index_keys"] = self.index_keys._data[:n]
        return {"length": n}, arrays

    def import_state(self, meta: dict, arrays: dict) -> None:
        import numpy as np

        n = saved_length(meta, self.kv.max_len)
        shapes = {"latent": (n, self.rank), "k_rot": (n, self.kv.dim - self.rank)}
        if self.index_keys is not None:
            shapes["index_keys"] = (n, self.index_keys.dim)
        check_saved_arrays(arrays, shapes if n else {})
        streams = [(self.kv, lambda: np.concatenate([np.asarray(arrays["latent"]), np.asarray(arrays["k_rot"])], 1))]
        if self.index_keys is not None:
            streams.append((self.index_keys, lambda: arrays["index_keys"]))
        for rows, saved in streams:
            if n:
                rows._grow(n)
                rows._data[:n] = to_backend(rows.backend, saved(), rows.backend.cache_dtype)
            rows.length = n

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (self.index_keys.nbytes if self.index_keys else 0)

    def bytes_per_token(self) -> int:
        """Bytes per cached token: (kv_lora_rank + qk_rope_head_dim) values of the cache
        dtype, plus index_head_dim when the layer has a DSA indexer."""
        dims = self.kv.dim + (self.index_keys.dim if self.index_keys else 0)
        return dims * ITEMSIZE[self.kv.backend.cache_dtype]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(config: dict[str, Any], qk_head_dim: int, source: str = "config.json") -> float:
    """The attention scale of DeepSeek-style MLA: qk_head_dim ** -0.5, times mscale**2
    where mscale = 0.1 * mscale_all_dim * ln(factor) + 1 when the rope scaling (any type
    but default) sets ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``). The rope
    tables carry the other half of yarn's correction (``attention_factor``)."""
    scale = qk_head_dim**-0.5
    params = rope_parameters(config, source)
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"]))
        scale = scale * m * m
    return scale


class MLAttention:
    """Multi-head latent attention, optionally with a DSA indexer.

    q: ``q_proj`` (no q LoRA) or ``q_a`` -> ``q_a_norm`` -> ``q_b``; per head, the first
    ``nope_dim`` features are position-free and the last ``rope_dim`` are rotated.
    kv: ``kv_a`` gives the latent (``kv_lora_rank``, normed by ``kv_a_norm``) and the
    shared rotary key (``rope_dim``); ``kv_b`` (H * (nope_dim + v_dim), rank) expands the
    latent. ``rope_interleave`` selects DeepSeek's interleaved-pair rotary layout;
    ``rope`` None: no position encoding at all (Kimi Linear's NoPE MLA), the last
    ``rope_dim`` features of each query and the shared key are used as they come.

    ``absorb_max_tokens``: steps of at most this many new tokens use the absorbed form,
    larger ones (prefill) expand. Both forms compute the same attention.
    """

    def __init__(
        self,
        *,
        layer: int,
        kv_a: Linear,
        kv_a_norm: RMSNorm,
        kv_b: Linear,
        o: Linear,
        n_heads: int,
        kv_lora_rank: int,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        rope: RoPE | None,
        scale: float,
        q: Linear | None = None,
        q_a: Linear | None = None,
        q_a_norm: RMSNorm | None = None,
        q_b: Linear | None = None,
        rope_interleave: bool = True,
        indexer=None,
        absorb_max_tokens: int = 1,
    ):
        if (q is None) == (q_b is None):
            raise ValueError("MLAttention needs either q (no q LoRA) or q_a, q_a_norm and q_b")
        self.layer = layer
        self.q, self.q_a, self.q_a_norm, self.q_b = q, q_a, q_a_norm, q_b
        self.kv_a, self.kv_a_norm, self.kv_b, self.o = kv_a, kv_a_norm, kv_b, o
        kv_b.weight.role = "plain"  # the absorbed form reads it per head, as an array
        self.n_heads, self.kv_lora_rank = n_heads, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = nope_dim, rope_dim, v_dim
        self.rope, self.scale, self.rope_interleave = rope, scale, rope_interleave
        self.indexer = indexer
        self.absorb_max_tokens = absorb_max_tokens

    def new_state(self, backend, max_len: int) -> MLACache:
        index_dim = getattr(self.indexer, "cached_dim", 0) if self.indexer is not None else 0
        return MLACache(backend, self.kv_lora_rank, self.rope_dim, max_len, index_dim)

    def _rotate(self, x, cos, sin, ops):
        if self.rope is None:  # NoPE
            return x
        if self.rope_interleave:
            return ops.rope_interleaved(x, cos, sin, self.rope_dim)
        return ops.rope(x, cos, sin, self.rope_dim)

    def __call__(self, x, step: Step):
        q, q_resid, compressed = self._project(x, step)
        return self.o(self._attend(x, q, q_resid, compressed, step), step)

    def batched(self, x, step: Step):
        """A batched step: the projections on all rows, attention per sequence (a
        verification's drafted positions of one sequence in one call, where exact)."""
        q, q_resid, compressed = self._project(x, step)
        merged = step.runs is not None and self._merges(step)
        outs = [self._attend(x[a:b], q[a:b], None if q_resid is None else q_resid[a:b], compressed[a:b], seg,
                             absorbed=merged)
                for seg, (a, b) in (step.runs if merged else zip(step.segments, step.rows))]
        return self.o(outs[0] if len(outs) == 1 else step.ops.concat(outs, 0), step)

    def _merges(self, step: Step) -> bool:
        """Whether a verification's runs (consecutive positions of one sequence) may go
        through this layer at once and give each row's bits as a step of its own would:
        every segment small enough for the absorbed form (which is what it would take),
        no DSA indexer (its scores are not computed row by row), and a backend whose
        absorbed MLA computes rows independently."""
        rows = max(b - a for _, (a, b) in step.runs)
        return (self.indexer is None and max(b - a for a, b in step.rows) <= self.absorb_max_tokens
                and step.ops.batch_invariant_rows("mla", [self.kv_b.weight.value]) >= rows)

    def _project(self, x, step: Step):
        if self.q is not None:
            q_resid = None
            q = self.q(x, step)
        else:
            q_resid = self.q_a_norm(self.q_a(x, step), step)
            q = self.q_b(q_resid, step)
        return q, q_resid, self.kv_a(x, step)

    def _attend(self, x, q, q_resid, compressed, step: Step, absorbed: bool = False):
        """One sequence's rows -> its attention output (before o_proj); ``absorbed``: in
        the absorbed form whatever their number (a verification's merged positions)."""
        ops = step.ops
        t = x.shape[0]
        h, dn, dr, dv = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim
        q = q.reshape(t, h, dn + dr)
        latent = self.kv_a_norm(compressed[:, : self.kv_lora_rank], step)
        k_rot = compressed[:, self.kv_lora_rank :].reshape(t, 1, dr)

        cos, sin = rope_tables(self.rope, step) if self.rope is not None else (None, None)
        q_nope, q_rot = q[..., :dn], self._rotate(q[..., dn:], cos, sin, ops)
        k_rot = self._rotate(k_rot, cos, sin, ops).reshape(t, dr)

        state: MLACache = step.cache.layers[self.layer]
        kv = state.append(latent, k_rot)
        selected = None
        if self.indexer is not None:
            selected = self.indexer(x, q_resid, state, step)

        kv_b = self.kv_b.weight.value
        if absorbed or t <= self.absorb_max_tokens:
            q_lat = ops.mla_absorb_query(q_nope, kv_b, dn, dv)
            o_lat = ops.mla_attention_kv(q_lat, q_rot, kv, step.start, self.scale, selected)
            out = ops.mla_absorb_output(o_lat, kv_b, dn, dv)
        else:
            rank = self.kv_lora_rank
            q_full, keys, values = ops.mla_expand(q_nope, q_rot, kv[:, :rank], kv[:, rank:], kv_b, dn, dv)
            if selected is None:
                out = ops.attention(q_full, keys, values, step.start, self.scale)
            else:
                out = ops.sparse_attention(q_full, keys, values, step.start, self.scale, selected)
        return out.reshape(t, h * dv)
