"""The CUDA backend: the whole contract on an NVIDIA GPU through CuPy, float32.

Where the work goes:

- products with float32 weights: cuBLAS (CuPy's matmul, float32 compute: CuPy uses
  TF32 only when CUPY_TF32=1 is set, which colibri never does);
- products with packed weights (int4-gs64, int8-row, mxfp4, fp8 blocks, bfloat16), up to
  ``geometry.GEMV_TOKEN_LIMIT`` tokens: the matrix-vector kernels (``kernels/gemv.cu``),
  on the stored bytes; more tokens: the weight decoded once on the device, then cuBLAS;
- one token's routed experts: two fused launches per window of experts
  (``kernels/experts.cu``); several tokens: batch-union, expert by expert, through the
  products above;
- attention: split over the sequence and combined (``kernels/attention.cu``); RoPE,
  RMS/LayerNorm, the softmax router's top-k and the gated delta step (decode of the
  linear-attention layers): kernels of their own;
- everything else (MLA, the DSA indexer's scores, sparse attention, the causal
  convolution, the chunked gated delta rule, elementwise and row operations): CuPy array
  operations written as the numpy reference writes them. The DSA top-k and DeepSeek's
  grouped router use the contract's host implementations (one synchronisation each).

The backend's Python code is written against ``self.xp`` (CuPy) and ``self.kernels``
(``colibri_cuda.kernels.CudaKernels``), so the tests run all of it on numpy with numpy
mirrors of the kernels; only the kernels themselves need a GPU.
"""

from __future__ import annotations

import numpy as np

from colibri_core.compute.backend import Backend, allocated_dtype
from colibri_core.compute.host import check_visible, delta_chunked, expert_groups, grouped_shapes
from colibri_core.formats.base import QuantTensor
from colibri_core.formats.reference import dequantize
from colibri_cuda import geometry, layouts
from colibri_cuda.layouts import PackedWeight

DTYPES = {name: np.dtype(name) for name in ("float32", "float16", "int64", "int32", "uint8")}  # CuPy has no bfloat16
SOFTPLUS_THRESHOLD = 20.0  # PyTorch's


def fused_layouts(experts: list) -> bool:
    """Whether the experts of a window can share one fused launch: every gate and up in
    one layout, every down in one (possibly another), fp8 blocks alike."""

    def key(w):
        return (w.kind, w.p0, w.p1) if isinstance(w, PackedWeight) else ("f32", 0, 0)

    gate_up = {key(e[role]) for e in experts for role in ("gate", "up")}
    down = {key(e["down"]) for e in experts}
    shapes = {(e["gate"].shape, e["up"].shape, e["down"].shape) for e in experts}
    return len(gate_up) == 1 and len(down) == 1 and len(shapes) == 1


class CudaBackend(Backend):
    name = "cuda"
    deferred = True  # kernels run on a stream, asynchronously to the host
    device_tier = "colibri_cuda.tier:CudaDeviceTier"

    def __init__(self, device=None, kernels=None):
        """``device`` and ``kernels``: the current CUDA device and its kernels by default
        (tests pass numpy stand-ins)."""
        super().__init__()
        if device is None:
            from colibri_cuda.device import CupyDevice

            device = CupyDevice()
        if kernels is None:
            from colibri_cuda.kernels import CudaKernels

            kernels = CudaKernels(device)
        self.device = device
        self.kernels = kernels
        self.xp = device.xp

    # -- memory ------------------------------------------------------------------------
    def asarray(self, host, dtype="float32"):
        return self.device.upload(np.ascontiguousarray(host, dtype=allocated_dtype(DTYPES, dtype)))

    def zeros(self, shape, dtype="float32"):
        return self.xp.zeros(tuple(shape), dtype=allocated_dtype(DTYPES, dtype))

    def _to_host(self, x):
        return self.device.to_host(x)

    def device_memory(self):
        return self.device.memory()

    # -- weights -----------------------------------------------------------------------
    def has_kernel(self, kind):
        return kind in layouts.KINDS

    def prepare_weight(self, w, use="linear"):
        if isinstance(w, QuantTensor):
            if use == "linear" and self.has_kernel(w.kind):
                return self.upload_packed(layouts.host_pack(w))
            return self.asarray(dequantize(w))
        return self.asarray(w)

    def upload_packed(self, p: layouts.HostPacked) -> PackedWeight:
        scales = None if p.scales is None else self.device.upload(p.scales)
        return PackedWeight(p.kind, p.shape, self.device.upload(p.data), scales, p.p0, p.p1)

    def weight_nbytes(self, kind, shape, stored_nbytes):
        if kind is not None and self.has_kernel(kind):
            return layouts.packed_nbytes(kind, shape)
        return 4 * int(np.prod(shape, dtype=np.int64))

    def _ready(self, w):
        """Order the compute after an asynchronous upload of ``w`` (once)."""
        if isinstance(w, PackedWeight) and w.ready is not None:
            self.device.wait(w.ready)
            w.ready = None
        return w

    # -- products ------------------------------------------------------------------------
    def _rows(self, x):
        """x as contiguous float32 (rows, features)."""
        return self.xp.ascontiguousarray(x.reshape(-1, x.shape[-1]), dtype=self.xp.float32)

    def linear(self, x, weight, bias=None):
        weight = self._ready(weight)
        rows = self._rows(x)
        if isinstance(weight, PackedWeight):
            if weight.kind == "f32":
                y = rows @ weight.data.T
            elif geometry.uses_gemv(rows.shape[0]):
                y = self.kernels.gemv(weight, rows)
            else:
                y = rows @ self.kernels.dequantize(weight).T
        else:
            y = rows @ weight.T
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def embedding(self, table, ids):
        return table[self.device.upload(np.asarray(ids, dtype=np.int64))]

    # -- norms and positions ----------------------------------------------------------------
    def rms_norm(self, x, weight, eps):
        return self.kernels.rms_norm(self._rows(x), weight, eps).reshape(x.shape)

    def layer_norm(self, x, weight, bias, eps):
        return self.kernels.layer_norm(self._rows(x), weight, bias, eps).reshape(x.shape)

    def _rope(self, x, cos, sin, rotary_dim, interleaved):
        xp = self.xp
        return self.kernels.rope(xp.ascontiguousarray(x, dtype=xp.float32), xp.ascontiguousarray(cos, dtype=xp.float32),
                                 xp.ascontiguousarray(sin, dtype=xp.float32), rotary_dim, interleaved)

    def rope(self, x, cos, sin, rotary_dim):
        return self._rope(x, cos, sin, rotary_dim, False)

    def rope_interleaved(self, x, cos, sin, rotary_dim):
        return self._rope(x, cos, sin, rotary_dim, True)

    # -- attention -------------------------------------------------------------------------
    def attention(self, q, k, v, start, scale):
        xp = self.xp
        if geometry.attention_fits(q.shape[-1]):
            return self.kernels.attention(xp.ascontiguousarray(q, dtype=xp.float32), self._kv_rows(k), self._kv_rows(v),
                                          start, scale)
        return self._attention(q, k, v, self._visible(q.shape[0], k.shape[1], start), scale)

    def _kv_rows(self, a):
        """A (heads, S, D) array whose rows are contiguous float32 (the KV cache's view
        of its first S positions is): as it is; anything else copied into that form."""
        if a.dtype == np.float32 and geometry.rows_contiguous(a.shape, a.strides, 4):
            return a
        return self.xp.ascontiguousarray(a, dtype=self.xp.float32)

    def sparse_attention(self, q, k, v, start, scale, selected):
        return self._attention(q, k, v, self._visible(q.shape[0], k.shape[1], start, selected), scale)

    def windowed_attention(self, q, k, v, start, scale, window=None, sinks=None):
        if window is None and sinks is None:
            return self.attention(q, k, v, start, scale)
        xp = self.xp
        pos, keys = start + xp.arange(q.shape[0])[:, None], xp.arange(k.shape[1])[None, :]
        visible = keys <= pos
        if window is not None:
            visible = visible & (keys > pos - int(window))
        return self._attention(q, k, v, visible, scale, sinks=sinks)

    def attention_relative_bias(self, q, k, v, start, scale, rel, table, window=None):
        xp = self.xp
        t, hq, _ = q.shape
        hkv, s = k.shape[0], k.shape[1]
        bias = xp.matmul(rel, table)  # (T, Hq, E): one bias per distance
        extent = bias.shape[-1]
        distance = (start + xp.arange(t))[:, None] - xp.arange(s)[None, :]  # (T, S)
        by_head = bias.reshape(t, hkv, hq // hkv, extent).transpose(1, 2, 0, 3)  # (Hkv, G, T, E)
        index = xp.broadcast_to(xp.clip(distance, 0, extent - 1), (hkv, hq // hkv, t, s))
        added = xp.where((distance >= 0) & (distance < extent), xp.take_along_axis(by_head, index, axis=-1), 0.0)
        visible = distance >= 0
        if window is not None:
            visible = visible & (distance < int(window))
        return self._attention(q, k, v, visible, scale, bias=added.astype(xp.float32))

    def masked_attention(self, q, k, v, scale, visible, sinks=None):
        visible = check_visible(visible, q.shape[0], k.shape[1])
        return self._attention(q, k, v, self.device.upload(visible), scale, sinks=sinks)

    def grouped_linear(self, x, weight, groups):
        xp = self.xp
        t, c, r = grouped_shapes(x.shape, weight.shape, groups)
        xs = x.reshape(t, groups, c).transpose(1, 0, 2)  # (G, T, C)
        ws = weight.reshape(groups, r, c)  # (G, R, C)
        out = xp.matmul(xs, ws.transpose(0, 2, 1))  # (G, T, R)
        return xp.ascontiguousarray(out.transpose(1, 0, 2).reshape(t, -1), dtype=xp.float32)

    def _attention(self, q, k, v, visible, scale, bias=None, sinks=None):
        """Attention as the reference computes it, masked by ``visible`` (T, S) or None;
        ``bias`` (Hkv, G, T, S) added to the scaled scores, ``sinks`` (Hq,) one logit per
        head in the softmax that carries no value."""
        xp = self.xp
        t, hq, d = q.shape
        hkv = k.shape[0]
        group = hq // hkv
        qh = q.reshape(t, hkv, group, d).transpose(1, 2, 0, 3)  # (Hkv, G, T, D)
        scores = xp.matmul(qh, k[:, None].transpose(0, 1, 3, 2)) * scale  # (Hkv, G, T, S)
        if bias is not None:
            scores = scores + bias
        if visible is not None:
            scores = xp.where(visible, scores, -np.inf)
        if sinks is not None:
            sink = xp.broadcast_to(xp.asarray(sinks, dtype=xp.float32).reshape(hkv, group, 1, 1), (hkv, group, t, 1))
            probs = self.softmax(xp.concatenate([scores, sink], axis=-1))[..., :-1]
        else:
            probs = self.softmax(scores)
        out = xp.matmul(probs, v[:, None])  # (Hkv, G, T, Dv)
        return xp.ascontiguousarray(out.transpose(2, 0, 1, 3).reshape(t, hq, v.shape[-1]))

    def _visible(self, t, s, start, selected=None):
        """(T, S) bool: what each query may see (causal, and the selection if any); None
        when every query sees every key."""
        xp = self.xp
        visible = None
        if t > 1 or start + t < s:
            visible = xp.arange(s)[None, :] <= (start + xp.arange(t))[:, None]
        if selected is not None:
            chosen = xp.zeros((t, s + 1), dtype=bool)  # -1 pads a row of fewer positions: a spare column, dropped
            chosen[xp.arange(t)[:, None], xp.where(selected < 0, s, selected)] = True
            chosen = chosen[:, :s]
            visible = chosen if visible is None else visible & chosen
        return visible

    # -- elementwise and rows ----------------------------------------------------------------
    def clip(self, x, limit):
        return self.xp.clip(x, -limit, limit)

    def silu(self, x):
        with self.device.errstate():
            return x / (1.0 + self.xp.exp(-x))

    def silu_mul(self, gate, up):
        with self.device.errstate():
            return gate / (1.0 + self.xp.exp(-gate)) * up

    def gated_activation(self, gate, up, act):
        if act.plain:
            return self.silu_mul(gate, up)
        xp = self.xp
        if act.limit is not None:
            gate, up = xp.minimum(gate, xp.float32(act.limit)), xp.clip(up, xp.float32(-act.limit), xp.float32(act.limit))
        with self.device.errstate():
            glu = gate / (xp.float32(1.0) + xp.exp(-gate * xp.float32(act.alpha)))
        return glu * (up + xp.float32(act.up_offset))

    def sigmoid(self, x):
        with self.device.errstate():
            return 1.0 / (1.0 + self.xp.exp(-x))

    def softplus(self, x):
        xp = self.xp
        with self.device.errstate():
            soft = xp.log1p(xp.exp(xp.minimum(x, SOFTPLUS_THRESHOLD)))
        return xp.where(x > SOFTPLUS_THRESHOLD, x, soft).astype(xp.float32)

    def softmax(self, x):
        xp = self.xp
        e = xp.exp(x - xp.max(x, axis=-1, keepdims=True))
        return e / xp.sum(e, axis=-1, keepdims=True)

    def l2_norm(self, x, eps):
        xp = self.xp
        return x * (1.0 / xp.sqrt(xp.sum(x * x, axis=-1, keepdims=True) + eps))

    def concat(self, arrays, axis):
        return self.xp.concatenate(arrays, axis=axis)

    # -- primitives ----------------------------------------------------------------------------
    def exp(self, x):
        with self.device.errstate():
            return self.xp.exp(x)

    def maximum(self, x, floor):
        return self.xp.maximum(x, np.float32(floor))

    def matmul(self, a, b):
        return self.xp.matmul(a, b)

    def reduce_sum(self, x):
        return x.sum(axis=-1, keepdims=True)

    def reduce_max(self, x):
        return x.max(axis=-1, keepdims=True)

    def take_rows(self, x, rows):
        return x[self.device.upload(np.asarray(rows, dtype=np.int64))]

    def add_rows(self, out, rows, y, scale):
        index = self.device.upload(np.asarray(rows, dtype=np.int64))
        out[index] += y * self.device.upload(np.asarray(scale, dtype=np.float32))[:, None]
        return out

    # -- routing ----------------------------------------------------------------------------
    def softmax_top_k(self, x, weight, k, renormalise, bias=None):
        logits = self._rows(self.linear(x, weight, bias))
        if not geometry.router_fits(logits.shape[1], k):
            return super().softmax_top_k(x, weight, k, renormalise, bias)
        chosen = self.to_host(self.kernels.softmax_top_k(logits, k, renormalise))  # one copy: both halves
        return np.rint(chosen[:, 0]).astype(np.int64), np.ascontiguousarray(chosen[:, 1], dtype=np.float32)

    # -- routed experts ------------------------------------------------------------------------
    def routed_experts(self, x, indices, weights, fetch, window=8, ready=None):
        if x.shape[0] != 1:
            return super().routed_experts(x, indices, weights, fetch, window, ready)
        # one token: its experts in ascending order, ``window`` of them per fused launch
        groups = [(e, scale[0]) for e, _, scale in expert_groups(indices, weights)]
        out = self.zeros(tuple(x.shape), "float32")
        rows = self._rows(x)
        size = max(1, min(window, geometry.EXPERT_WINDOW_LIMIT))
        for first in range(0, len(groups), size):
            part = groups[first : first + size]
            held = [self._expert_matrices(fetch(e)) for e, _ in part]
            scales = np.array([s for _, s in part], dtype=np.float32)
            if fused_layouts(held):
                self.kernels.experts_token(rows, held, scales, out)
            else:  # layouts that differ between experts: one expert at a time, same order
                for w, s in zip(held, scales):
                    y = self.swiglu_expert(rows, w["gate"], w["up"], w["down"])
                    out = self.add_rows(out, np.zeros(1, dtype=np.int64), y, np.array([s], dtype=np.float32))
            del held  # the window's experts go before the next window is fetched
        return out

    def _expert_matrices(self, weights) -> dict:
        """The three matrices of a fetched expert, uploads waited for; the fetched object
        itself is not kept (the window bounds what the backend holds)."""
        return {role: self._ready(weights[role]) for role in ("gate", "up", "down")}

    # -- latent attention and DSA: masks built on the device (the expand/absorb products are composites)
    def mla_attention(self, q_lat, q_rot, latent, k_rot, start, scale, selected=None):
        xp = self.xp
        t = q_lat.shape[0]
        scores = (xp.matmul(q_lat, latent.T) + xp.matmul(q_rot, k_rot.T)) * scale  # (T, H, S)
        visible = self._visible(t, latent.shape[0], start, selected)
        if visible is not None:
            scores = xp.where(visible[:, None, :], scores, -np.inf)
        return xp.matmul(self.softmax(scores), latent)  # (T, H, rank)

    def dsa_index_scores(self, q, k, weights, scale, start):
        xp = self.xp
        per_head = xp.maximum(xp.matmul(q, k.T) * scale, 0.0)  # (T, Hi, S)
        scores = xp.matmul(weights[:, None, :], per_head)[:, 0, :]  # (T, S)
        visible = self._visible(q.shape[0], k.shape[0], start)
        if visible is not None:
            scores = xp.where(visible, scores, -np.inf)
        return scores

    # -- recurrent layers: the chunked prefill and the step's kernel (the convolution is the composite)
    def gated_delta_chunked(self, q, k, v, g, beta, state, chunk_size):
        return delta_chunked(self.xp, self.device.errstate(), q, k, v, g, beta, state, chunk_size)

    def gated_delta_step(self, q, k, v, g, beta, state):
        xp = self.xp
        arrays = (xp.ascontiguousarray(a, dtype=xp.float32) for a in (q, k, v, g, beta, state))
        return self.kernels.gated_delta_step(*arrays)
