"""The CPU backend: numpy float32 activations, BLAS matmuls for float32 weights, and
colibri's compiled kernels (``colibri_core._kernels``) for weights kept in a packed form
(int8, int4, MXFP4, fp8, bf16). Without the compiled kernels every weight is decoded to
float32 at load and the backend is pure numpy."""

from __future__ import annotations

import numpy as np

from ..backend import Backend
from ..quant import QuantTensor

try:
    from .. import _kernels
except ImportError:  # built without a C compiler: pure numpy
    _kernels = None

KERNEL_KINDS = frozenset({"q8", "q4", "mxfp4", "fp8", "bf16"})
DEQUANT_ROWS = 512  # prefill dequantises this many weight rows at a time into a reused buffer
KERNEL_ROW_LIMIT = 64  # up to this many activation rows, the kernels take them a few at a time:
# passes over the packed weight are cheaper than dequantising it for BLAS
ROUTE_ROW_LIMIT = 8  # up to this many tokens the compiled router runs; beyond, BLAS and numpy
_NO_SCALES = np.zeros(1, dtype=np.float32)


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, kernels: bool = True):
        self.kernels = _kernels if kernels else None
        self._scratch: dict[tuple[int, int], np.ndarray] = {}  # (rows, K) float32 buffers, reused

    def has_kernel(self, kind: str) -> bool:
        return self.kernels is not None and kind in KERNEL_KINDS

    def placed(self, packed: bool) -> None:
        if packed and self.kernels is not None and self.kernels.OPENMP:
            # The kernels' OpenMP threads then do the heavy work; numpy's BLAS is left with
            # small products (routers, attention), and its own threads, spinning after each
            # call, would take the cores the kernels need (measured: a 32-token prompt of
            # the full-size OLMoE took 1.6 s with both pools, 0.5 s with BLAS on one thread).
            from threadpoolctl import threadpool_limits

            threadpool_limits(limits=1, user_api="blas")

    def keeps_stored(self, kind: str, use: str) -> bool:
        if use == "embedding":  # rows are decoded on lookup; fp8's block scales do not split by row
            return self.has_kernel(kind) and kind != "fp8"
        return super().keeps_stored(kind, use)

    def swiglu_expert(self, x, gate, up, down):
        mats = (gate, up, down)
        if x.shape[0] <= self._kernel_rows(mats):
            # the layer kernel with one expert taking every row at weight 1 (0 + 1 * y is y)
            x = np.ascontiguousarray(x, dtype=np.float32)
            t = x.shape[0]
            out = np.zeros((t, down.shape[0]), dtype=np.float32)
            self.kernels.moe(x, [tuple(self._prepared(w) for w in mats)], np.arange(t, dtype=np.int32),
                             np.ones(t, dtype=np.float32), np.array([0, t], dtype=np.int64), out)
            return out
        return super().swiglu_expert(x, gate, up, down)

    def _prepared(self, w: QuantTensor):
        """w as the kernels take it: checked once by ``_kernels.weight`` and kept with w."""
        handle = w.derived.get("cpu")
        if handle is None:
            scales = w.scales if w.scales is not None else _NO_SCALES
            handle = w.derived["cpu"] = self.kernels.weight(w.kind, w.data, scales, w.shape[0], w.shape[1], *w.block)
        return handle

    def _row_limit(self, w: QuantTensor) -> int:
        """Up to this many x rows the kernels pass over the packed weight; beyond, it is
        dequantised for BLAS (fp8's per-element decode makes repeated passes dearer)."""
        return self.kernels.MAX_ROWS if w.kind == "fp8" else KERNEL_ROW_LIMIT

    def _kernel_rows(self, weights) -> int:
        """The most x rows the compiled kernels take for these weights together; 0 when
        they cannot take them all (no kernels, float32 arrays, a kind without a kernel)."""
        if self.kernels is None or not all(isinstance(w, QuantTensor) and w.kind in KERNEL_KINDS for w in weights):
            return 0
        return min(self._row_limit(w) for w in weights)

    def linears(self, x, weights, biases=None):
        if len(weights) < 2 or x.shape[0] > self._kernel_rows(weights):
            return super().linears(x, weights, biases)
        x = np.ascontiguousarray(x, dtype=np.float32)
        outs = [np.empty((x.shape[0], w.shape[0]), dtype=np.float32) for w in weights]
        self.kernels.linears(x, [self._prepared(w) for w in weights], outs)
        for y, b in zip(outs, biases or ()):
            if b is not None:
                y += b
        return outs

    def _quant_linear(self, x, w: QuantTensor):
        n, k = w.shape
        x = np.ascontiguousarray(x, dtype=np.float32)
        m = x.shape[0]
        scales = w.scales if w.scales is not None else _NO_SCALES
        out = np.empty((m, n), dtype=np.float32)
        if m <= self._row_limit(w):  # decode and short prompts: passes over the packed weight
            self.kernels.matmul(x, self._prepared(w), out)
            return out
        # many rows (prefill): dequantise a block of rows at a time and let BLAS multiply
        step = DEQUANT_ROWS
        if w.kind == "fp8":  # whole blocks of rows, so each slice starts on a scale block
            step = max(w.block[0], DEQUANT_ROWS // w.block[0] * w.block[0])
        scratch = self._scratch.get((step, k))
        if scratch is None:
            scratch = self._scratch[(step, k)] = np.empty((step, k), dtype=np.float32)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            block = scratch[: r1 - r0]
            if w.kind == "fp8":  # scales cover (bm x bn) blocks: pass the rows' block rows
                sc = scales[r0 // w.block[0] : -(-r1 // w.block[0])]
            elif w.scales is None:
                sc = scales
            else:
                sc = scales[r0:r1]
            self.kernels.dequantize(w.kind, w.data[r0:r1], sc, block, r1 - r0, k, *w.block)
            out[:, r0:r1] = x @ block.T  # (matmul into a strided slice would leave BLAS)
        return out

    def asarray(self, host_f32):
        return np.ascontiguousarray(host_f32, dtype=np.float32)

    def to_numpy(self, x):
        return x

    def zeros(self, shape):
        return np.zeros(shape, dtype=np.float32)

    def embedding(self, table, ids):
        ids = np.asarray(ids, dtype=np.int64)
        if not isinstance(table, QuantTensor):
            return table[ids]
        rows = np.ascontiguousarray(table.data[ids])
        scales = np.ascontiguousarray(table.scales[ids]) if table.scales is not None else _NO_SCALES
        out = np.empty((len(ids), table.shape[1]), dtype=np.float32)
        self.kernels.dequantize(table.kind, rows, scales, out, len(ids), table.shape[1])
        return out

    def linear(self, x, weight, bias=None):
        y = self._quant_linear(x, weight) if isinstance(weight, QuantTensor) else x @ weight.T
        if bias is not None:
            y += bias
        return y

    def rms_norm(self, x, weight, eps):
        if self.kernels is not None:
            x = np.ascontiguousarray(x, dtype=np.float32)
            out = np.empty_like(x)
            self.kernels.rms_norm(x, weight, eps, out, x.shape[-1])
            return out
        variance = np.mean(np.square(x), axis=-1, keepdims=True)
        y = x * (1.0 / np.sqrt(variance + np.float32(eps)))
        return y * weight if weight is not None else y

    def rope(self, x, cos, sin, rotary_dim):
        if self.kernels is not None and x.dtype == np.float32 and cos.dtype == sin.dtype == np.float32:
            x = np.ascontiguousarray(x)
            out = np.empty_like(x)
            self.kernels.rope(x, np.ascontiguousarray(cos), np.ascontiguousarray(sin), rotary_dim, out)
            return out
        cos = cos[:, None, :]
        sin = sin[:, None, :]
        rot = x[..., :rotary_dim]
        half = rotary_dim // 2
        rotated = np.concatenate((-rot[..., half:], rot[..., :half]), axis=-1)
        out = rot * cos + rotated * sin
        if rotary_dim == x.shape[-1]:
            return out
        return np.concatenate((out, x[..., rotary_dim:]), axis=-1)

    def attention(self, q, k, v, start, scale):
        if self.kernels is not None and q.dtype == k.dtype == v.dtype == np.float32:
            q = np.ascontiguousarray(q)
            out = np.empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=np.float32)
            self.kernels.attention(q, k, v, start, scale, out)
            return out
        t, hq, d = q.shape
        hkv, s, _ = k.shape
        group = hq // hkv
        qh = q.reshape(t, hkv, group, d).transpose(1, 2, 0, 3)  # (Hkv, G, T, D)
        scores = np.matmul(qh, k[:, None].transpose(0, 1, 3, 2)) * np.float32(scale)  # (Hkv, G, T, S)
        if t > 1 or start + t < s:
            # query i sits at position start + i and sees keys 0..start+i
            visible = np.arange(s)[None, :] <= (start + np.arange(t))[:, None]
            scores = np.where(visible, scores, np.float32(-np.inf))
        probs = self.softmax(scores)
        out = np.matmul(probs, v[:, None])  # (Hkv, G, T, Dv)
        return out.transpose(2, 0, 1, 3).reshape(t, hq, v.shape[-1])

    def clip(self, x, limit):
        return np.clip(x, -limit, limit)

    def silu_mul(self, gate, up):
        # silu(g) = g * sigmoid(g), written as g / (1 + exp(-g)); exp may overflow to inf
        # for very negative g, which correctly gives -0.
        with np.errstate(over="ignore"):
            return gate / (np.float32(1.0) + np.exp(-gate)) * up

    def sigmoid(self, x):
        with np.errstate(over="ignore"):
            return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))

    def softmax(self, x):
        m = np.max(x, axis=-1, keepdims=True)
        e = np.exp(x - m)
        return e / np.sum(e, axis=-1, keepdims=True)

    def softmax_top_k(self, x, weight, k, renormalise):
        if (self.kernels is None or not isinstance(weight, np.ndarray) or x.shape[0] > ROUTE_ROW_LIMIT
                or weight.shape[0] > self.kernels.MAX_ROUTED):
            return super().softmax_top_k(x, weight, k, renormalise)
        t = x.shape[0]
        indices = np.empty((t, k), dtype=np.int64)
        weights = np.empty((t, k), dtype=np.float32)
        self.kernels.route(np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(weight, dtype=np.float32), k,
                           renormalise, indices, weights)
        return indices, weights

    def routed_experts(self, x, indices, weights, fetch, window: int = 8, ready=None):
        t, k = indices.shape
        if t == 1 and ready is None and k <= window and self.kernels is not None:
            out, fetch = self._one_token_at_hand(x, indices, weights, fetch)
            if out is not None:
                return out
        out = np.zeros_like(x)
        if t == 1:  # decode: one token, k distinct experts
            order = np.argsort(indices[0])
            experts = indices[0, order]
            token_of = np.zeros(k, dtype=np.int32)
            starts, counts = range(k), (1,) * k
        else:
            flat = indices.ravel()
            order = np.argsort(flat, kind="stable")  # (expert, token) pairs grouped by expert, ascending
            experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
            token_of = (order // k).astype(np.int32)
        weight_of = np.ascontiguousarray(weights.ravel()[order], dtype=np.float32)
        if self.kernels is not None:
            x = np.ascontiguousarray(x, dtype=np.float32)
        batch: list = []  # kernel arguments of consecutive experts: one call for all of them
        first = 0  # index in ``experts`` of the batch's first expert

        def flush():
            if batch:
                lo = starts[first]
                off = np.zeros(len(batch) + 1, dtype=np.int64)
                np.cumsum(counts[first : first + len(batch)], out=off[1:])
                self.kernels.moe(x, batch, token_of[lo : lo + off[-1]], weight_of[lo : lo + off[-1]], off, out)
                batch.clear()

        for i, e in enumerate(experts.tolist()):  # ascending expert ids: a fixed reduction order
            if batch and ready is not None and not ready(e):
                flush()  # compute what is here while e's read finishes
            w = fetch(e)
            specs = self._kernel_args(w)
            if specs is not None and counts[i] <= specs[1]:
                if not batch:
                    first = i
                batch.append(specs[0])
                if len(batch) >= max(1, window):
                    flush()
                continue
            flush()
            rows = token_of[starts[i] : starts[i] + counts[i]]
            y = self.swiglu_expert(x[rows], w["gate"], w["up"], w["down"])
            out[rows] += y * weight_of[starts[i] : starts[i] + counts[i], None]
        flush()
        return out

    def _one_token_at_hand(self, x, indices, weights, fetch):
        """Decode with every expert at hand: the token's experts in one kernel call, with
        no per-expert checks. Returns (output, fetch); the output is None when an expert
        has no kernel, and ``fetch`` then serves the experts already fetched (the store
        counts every fetch as a use)."""
        k = indices.shape[1]
        order = np.argsort(indices[0])
        experts = indices[0, order].tolist()
        fetched = [fetch(e) for e in experts]
        args = [self._kernel_args(w) for w in fetched]
        if any(a is None for a in args):
            return None, dict(zip(experts, fetched)).__getitem__
        out = np.zeros((1, x.shape[-1]), dtype=np.float32)
        self.kernels.moe(np.ascontiguousarray(x, dtype=np.float32), [a[0] for a in args], np.zeros(k, np.int32),
                         np.ascontiguousarray(weights[0, order], dtype=np.float32), np.arange(k + 1, dtype=np.int64), out)
        return out, fetch

    def _kernel_args(self, w):
        """(moe kernel arguments, most token rows it takes) for an expert, derived once
        and kept with it; None when the compiled kernels cannot take its formats."""
        key = ("cpu", self.kernels is not None)
        derived = w.derived.get(key)
        if derived is None and key not in w.derived:
            mats = (w["gate"], w["up"], w["down"])
            rows = self._kernel_rows(mats)
            derived = (tuple(self._prepared(m) for m in mats), rows) if rows else None
            w.derived[key] = derived
        return derived

    # -- MLA, DSA and interleaved RoPE --------------------------------------------------
    def layer_norm(self, x, weight, bias, eps):
        mean = np.mean(x, axis=-1, keepdims=True)
        centred = x - mean
        variance = np.mean(np.square(centred), axis=-1, keepdims=True)
        y = centred / np.sqrt(variance + np.float32(eps))
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y

    def rope_interleaved(self, x, cos, sin, rotary_dim):
        half = rotary_dim // 2
        cos = cos[:, None, :half]
        sin = sin[:, None, :half]
        first, second = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out = np.concatenate((first * cos - second * sin, second * cos + first * sin), axis=-1)
        if rotary_dim == x.shape[-1]:
            return out
        return np.concatenate((out, x[..., rotary_dim:]), axis=-1)

    def mla_expand(self, q_nope, q_rot, latent, k_rot, kv_b, nope_dim, v_dim):
        t, h, _ = q_nope.shape
        s, rope = k_rot.shape
        kv = (latent @ kv_b.T).reshape(s, h, nope_dim + v_dim).transpose(1, 0, 2)  # (H, S, nope+v)
        keys = np.empty((h, s, nope_dim + rope), dtype=np.float32)
        keys[..., :nope_dim] = kv[..., :nope_dim]
        keys[..., nope_dim:] = k_rot[None]
        q = np.concatenate((q_nope, q_rot), axis=-1)
        return q, keys, np.ascontiguousarray(kv[..., nope_dim:])

    @staticmethod
    def _kv_b_heads(kv_b, n_heads, nope_dim, v_dim):
        return kv_b.reshape(n_heads, nope_dim + v_dim, kv_b.shape[-1])  # (H, nope+v, rank), a view

    def mla_absorb_query(self, q_nope, kv_b, nope_dim, v_dim):
        w = self._kv_b_heads(kv_b, q_nope.shape[1], nope_dim, v_dim)
        out = np.matmul(q_nope.transpose(1, 0, 2), w[:, :nope_dim, :])  # (H, T, rank)
        return np.ascontiguousarray(out.transpose(1, 0, 2))

    def mla_attention(self, q_lat, q_rot, latent, k_rot, start, scale, selected=None):
        t, h, rank = q_lat.shape
        s = latent.shape[0]
        scores = (np.matmul(q_lat, latent.T) + np.matmul(q_rot, k_rot.T)) * np.float32(scale)  # (T, H, S)
        visible = self._visible(t, s, start, selected)
        if visible is not None:
            scores = np.where(visible[:, None, :], scores, np.float32(-np.inf))
        return np.matmul(self.softmax(scores), latent)  # (T, H, rank)

    def mla_absorb_output(self, o_lat, kv_b, nope_dim, v_dim):
        w = self._kv_b_heads(kv_b, o_lat.shape[1], nope_dim, v_dim)
        out = np.matmul(o_lat.transpose(1, 0, 2), w[:, nope_dim:, :].transpose(0, 2, 1))  # (H, T, v)
        return np.ascontiguousarray(out.transpose(1, 0, 2))

    @staticmethod
    def _visible(t, s, start, selected=None):
        """(T, S) bool: what each query may see (causal, and the selection if any); None
        when every query sees every key."""
        visible = None
        if t > 1 or start + t < s:
            visible = np.arange(s)[None, :] <= (start + np.arange(t))[:, None]
        if selected is not None:
            chosen = np.zeros((t, s), dtype=bool)
            np.put_along_axis(chosen, np.asarray(selected, dtype=np.int64), True, axis=-1)
            visible = chosen if visible is None else visible & chosen
        return visible

    def sparse_attention(self, q, k, v, start, scale, selected):
        if self.kernels is not None and q.dtype == k.dtype == v.dtype == np.float32:
            q = np.ascontiguousarray(q)
            visible = np.ascontiguousarray(self._visible(q.shape[0], k.shape[1], start, selected), dtype=np.uint8)
            out = np.empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=np.float32)
            self.kernels.attention(q, k, v, start, scale, out, visible)
            return out
        t, hq, d = q.shape
        hkv, s, _ = k.shape
        group = hq // hkv
        qh = q.reshape(t, hkv, group, d).transpose(1, 2, 0, 3)  # (Hkv, G, T, D)
        scores = np.matmul(qh, k[:, None].transpose(0, 1, 3, 2)) * np.float32(scale)  # (Hkv, G, T, S)
        scores = np.where(self._visible(t, s, start, selected), scores, np.float32(-np.inf))
        out = np.matmul(self.softmax(scores), v[:, None])  # (Hkv, G, T, Dv)
        return out.transpose(2, 0, 1, 3).reshape(t, hq, v.shape[-1])

    def dsa_index_scores(self, q, k, weights, scale, start):
        t = q.shape[0]
        s = k.shape[0]
        per_head = np.maximum(np.matmul(q, k.T) * np.float32(scale), np.float32(0))  # (T, Hi, S)
        scores = np.matmul(weights[:, None, :], per_head)[:, 0, :]  # (T, S)
        visible = self._visible(t, s, start)
        if visible is not None:
            scores = np.where(visible, scores, np.float32(-np.inf))
        return scores

    def top_k(self, scores, k):
        order = np.argsort(-scores, axis=-1, kind="stable")
        return order[..., :k].astype(np.int64)

    # -- recurrent (linear-attention) layers -------------------------------------------
    def silu(self, x):
        with np.errstate(over="ignore"):
            return x / (np.float32(1.0) + np.exp(-x))

    def softplus(self, x):
        with np.errstate(over="ignore"):
            return np.where(x > np.float32(20.0), x, np.log1p(np.exp(np.minimum(x, np.float32(20.0))))).astype(np.float32)

    def l2_norm(self, x, eps):
        return x * (np.float32(1.0) / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps)))

    def causal_conv1d(self, x, weight, state):
        t, width = x.shape[0], weight.shape[1]
        full = np.concatenate((state, x), axis=0)  # (K-1+T, C)
        out = full[0:t] * weight[:, 0]
        for j in range(1, width):
            out += full[j : j + t] * weight[:, j]
        return out, np.ascontiguousarray(full[t:])

    @staticmethod
    def _delta_heads(q, k, v, g, beta):
        """(H, T, ...) float32 views with the key heads repeated to the value heads."""
        rep = v.shape[1] // k.shape[1]
        if rep > 1:
            q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
        return (q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2), g.T, beta.T)

    def gated_delta_chunked(self, q, k, v, g, beta, state, chunk_size):
        t = q.shape[0]
        q, k, v, g, beta = self._delta_heads(q, k, v, g, beta)
        h, dv = v.shape[0], v.shape[2]
        c = chunk_size
        pad = (-t) % c
        if pad:
            q, k, v = (np.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (q, k, v))
            g, beta = (np.pad(a, ((0, 0), (0, pad))) for a in (g, beta))
        n = (t + pad) // c
        v_beta = (v * beta[..., None]).reshape(h, n, c, dv)
        k_beta = (k * beta[..., None]).reshape(h, n, c, -1)
        q, k = q.reshape(h, n, c, -1), k.reshape(h, n, c, -1)
        cum = np.cumsum(g.reshape(h, n, c), axis=-1, dtype=np.float32)
        upper = np.triu(np.ones((c, c), dtype=bool), 1)
        with np.errstate(over="ignore"):  # masked (upper) entries may overflow before masking
            pair = np.exp(np.where(upper, np.float32(-np.inf), cum[..., :, None] - cum[..., None, :]))
        kt = k.swapaxes(-1, -2)
        ut = (k_beta @ kt) * pair
        intra = (q @ kt) * pair
        # (I + strictly-lower(ut)) X = B: a unit lower-triangular solve, as solve_triangular(unitriangular=True)
        lower = np.tril(ut, -1) + np.eye(c, dtype=np.float32)
        new_values = np.linalg.solve(lower, v_beta).astype(np.float32)
        k_cumdecay = np.linalg.solve(lower, k_beta * np.exp(cum)[..., None]).astype(np.float32)
        q = q * np.exp(cum)[..., None]
        k = k * np.exp(cum[..., -1:] - cum)[..., None]
        chunk_decay = np.exp(cum[..., -1])[..., None, None]
        s = np.array(state, dtype=np.float32, copy=True)
        out = np.empty((h, n, c, dv), dtype=np.float32)
        for i in range(n):
            v_new = new_values[:, i] - k_cumdecay[:, i] @ s
            out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
            s = s * chunk_decay[:, i] + k[:, i].swapaxes(-1, -2) @ v_new
        out = out.reshape(h, n * c, dv)[:, :t]
        return np.ascontiguousarray(out.transpose(1, 0, 2)), s

    def gated_delta_step(self, q, k, v, g, beta, state):
        t = q.shape[0]
        q, k, v, g, beta = self._delta_heads(q, k, v, g, beta)
        s = np.array(state, dtype=np.float32, copy=True)
        out = np.empty((v.shape[0], t, v.shape[2]), dtype=np.float32)
        decay = np.exp(g)
        for i in range(t):
            s = s * decay[:, i, None, None]
            kv_mem = (s * k[:, i, :, None]).sum(axis=-2)
            delta = (v[:, i] - kv_mem) * beta[:, i, None]
            s = s + k[:, i, :, None] * delta[:, None, :]
            out[:, i] = (s * q[:, i, :, None]).sum(axis=-2)
        return np.ascontiguousarray(out.transpose(1, 0, 2)), s
