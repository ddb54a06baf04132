"""The CPU backend: numpy float32 activations, BLAS matmuls for float32 weights, and
colibri's compiled kernels (``colibri_core.compute.cpu._kernels``) for weights kept in a packed form
(int8, int4, MXFP4, fp8, bf16, and the
compressed-tensors int4 and gpt-oss MXFP4 layouts as checkpoints store them). Without the compiled kernels every weight is decoded to
float32 at load and the backend is pure numpy."""

from __future__ import annotations

import numpy as np

from colibri_core.compute import host
from colibri_core.compute.reference import ReferenceBackend
from colibri_core.formats.base import QuantTensor

try:
    from colibri_core.compute.cpu import _kernels
except ImportError:  # built without a C compiler: pure numpy
    _kernels = None

KERNEL_KINDS = frozenset({"q8", "q4", "mxfp4", "fp8", "bf16", "q4g32", "mxfp4pair"})
DEQUANT_ROWS = 512  # prefill dequantises this many weight rows at a time into a reused buffer
ATTENTION_ROW_LIMIT = 1 << 16  # query rows of one sequence in one exact call (a verification's)
KERNEL_ROW_LIMIT = 64  # up to this many activation rows, the kernels take them a few at a time:
# passes over the packed weight are cheaper than dequantising it for BLAS
VNNI_ROW_LIMIT = 256  # int4 and int8 on AVX-512 VNNI: a whole prefill chunk. Measured on an AMD EPYC Zen 4
# (2 threads, 2048 x 2048, 128 and 256 rows): int4 ~145-165 GMAC/s, int8 ~96, against 40-87 dequantised for
# BLAS; a 128-token prompt's prefill 2.13 -> 1.13 s (int4), 2.3-2.6 -> 1.6 s (int8)
# (benchmarks/results/2026-12-06-avx512-zen4.md)
ROUTE_ROW_LIMIT = 8  # up to this many tokens the compiled router runs; beyond, BLAS and numpy
_NO_SCALES = np.zeros(1, dtype=np.float32)
_KV_DTYPES = (np.float32, np.float16)


class CpuBackend(ReferenceBackend):
    """The reference numpy backend plus the compiled kernels; ``kernels=False`` is the
    reference itself."""

    name = "cpu"
    kv_dtypes = ("float32", "float16")  # the attention kernel reads either

    def __init__(self, kernels: bool = True):
        super().__init__()
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

    def start_threads(self) -> None:
        if self.kernels is not None and self.kernels.OPENMP:
            from colibri_core.formats.base import QuantTensor, f32_to_bf16

            weight = QuantTensor("bf16", f32_to_bf16(np.ones((64, 64), dtype=np.float32)), None, (64, 64))
            self.linear(np.ones((1, 64), dtype=np.float32), weight)  # a parallel region: OpenMP's team starts

    def keeps_stored(self, kind: str, use: str) -> bool:
        if use == "embedding":  # rows are decoded on lookup; fp8's block scales do not split by row
            return self.has_kernel(kind) and kind != "fp8"
        return super().keeps_stored(kind, use)

    def batch_invariant_rows(self, op, weights):
        # measured (docs/architecture.md, batched engine): the kernels compute each row
        # on its own up to their row limits; BLAS rounds differently for 1 and M rows
        if op == "linear":
            return max(1, self._kernel_rows(weights))
        if op == "router":
            (w,) = weights
            if self._router_kernel(w, 1):
                return ROUTE_ROW_LIMIT
            return max(1, self._kernel_rows(weights))
        if op == "experts":
            # an expert given more rows than its kernel takes falls back to BLAS (the
            # limits kept with each expert: this is asked at every batched step)
            rows = KERNEL_ROW_LIMIT << 8
            for w in weights:
                args = self._kernel_args(w)
                rows = min(rows, args[1] if args is not None else 1)
            return max(1, rows) if weights else 1
        if op == "attention" and self.kernels is not None:
            # the kernel computes each query row with the operations and order of that row
            # alone, whatever the rows beside it (tests/test_quant_formats.py)
            return ATTENTION_ROW_LIMIT
        if op == "mla" and self._mla_kernels(*weights):
            # absorbed MLA: the per-head products and the latent attention both in kernels
            # that compute a row as alone (the kit: test_mla_rows_claimed_exact_are_each_row_alone)
            return ATTENTION_ROW_LIMIT
        return 1

    def _router_kernel(self, weight, rows: int) -> bool:
        """Whether a router's logits for ``rows`` rows go through the compiled kernels
        (each row summed as alone): float32 weights of at most MAX_ROUTED experts."""
        return (self.kernels is not None and isinstance(weight, np.ndarray) and weight.dtype == np.float32
                and weight.ndim == 2 and weight.shape[0] <= self.kernels.MAX_ROUTED and rows <= ROUTE_ROW_LIMIT)

    def router_logits(self, x, weight, bias=None):
        if not self._router_kernel(weight, x.shape[0]):
            return super().router_logits(x, weight, bias)
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)
        self.kernels.head_matmul(x[:, None, :], weight[None], out, True)
        if bias is not None:
            out += np.asarray(bias, dtype=np.float32).reshape(-1)
        return out

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
        if w.kind == "fp8":
            return self.kernels.MAX_ROWS
        if w.kind in ("q4", "q8") and self.kernels.INT4_PATH == "avx512-vnni":
            return VNNI_ROW_LIMIT
        return KERNEL_ROW_LIMIT

    def _kernel_rows(self, weights) -> int:
        """The most x rows the compiled kernels take for these weights together; 0 when
        they cannot take them all (no kernels, float32 arrays, a kind without a kernel)."""
        if self.kernels is None or not weights:
            return 0
        rows = VNNI_ROW_LIMIT << 8
        for w in weights:  # a plain loop: this runs for every product of a batched step
            if not isinstance(w, QuantTensor) or w.kind not in KERNEL_KINDS:
                return 0
            rows = min(rows, self._row_limit(w))
        return rows

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

    def prepare_weight(self, w, use="linear"):
        if isinstance(w, QuantTensor):  # packed only when the kernels take it: kept as stored
            return w
        return self.asarray(w)

    def weight_nbytes(self, kind, shape, stored_nbytes):
        return stored_nbytes if kind is not None else super().weight_nbytes(kind, shape, stored_nbytes)

    def embedding(self, table, ids):
        ids = np.asarray(ids, dtype=np.int64)
        if not isinstance(table, QuantTensor):
            return super().embedding(table, ids)
        rows = np.ascontiguousarray(table.data[ids])
        scales = np.ascontiguousarray(table.scales[ids]) if table.scales is not None else _NO_SCALES
        out = np.empty((len(ids), table.shape[1]), dtype=np.float32)
        self.kernels.dequantize(table.kind, rows, scales, out, len(ids), table.shape[1])
        return out

    def linear(self, x, weight, bias=None):
        if not isinstance(weight, QuantTensor):
            return super().linear(x, weight, bias)
        y = self._quant_linear(x, weight)
        if bias is not None:
            y += bias
        return y

    def rms_norm(self, x, weight, eps):
        if self.kernels is not None:
            x = np.ascontiguousarray(x, dtype=np.float32)
            out = np.empty_like(x)
            self.kernels.rms_norm(x, weight, eps, out, x.shape[-1])
            return out
        return super().rms_norm(x, weight, eps)

    def rope(self, x, cos, sin, rotary_dim):
        if self.kernels is not None and x.dtype == np.float32 and cos.dtype == sin.dtype == np.float32:
            x = np.ascontiguousarray(x)
            out = np.empty_like(x)
            self.kernels.rope(x, np.ascontiguousarray(cos), np.ascontiguousarray(sin), rotary_dim, out)
            return out
        return super().rope(x, cos, sin, rotary_dim)

    def rope_interleaved(self, x, cos, sin, rotary_dim):
        if self.kernels is not None and x.dtype == np.float32 and cos.dtype == sin.dtype == np.float32:
            x = np.ascontiguousarray(x)
            out = np.empty_like(x)
            self.kernels.rope(x, np.ascontiguousarray(cos), np.ascontiguousarray(sin), rotary_dim, out, True)
            return out
        return super().rope_interleaved(x, cos, sin, rotary_dim)

    def attention(self, q, k, v, start, scale):
        if self.kernels is not None and q.dtype == np.float32 and k.dtype == v.dtype and k.dtype in _KV_DTYPES:
            q = np.ascontiguousarray(q)
            out = np.empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=np.float32)
            self.kernels.attention(q, k, v, start, scale, out)
            return out
        return super().attention(q, k, v, start, scale)

    def softmax_top_k(self, x, weight, k, renormalise, bias=None):
        if bias is not None or not self._router_kernel(weight, x.shape[0]):
            return super().softmax_top_k(x, weight, k, renormalise, bias)
        t = x.shape[0]
        indices = np.empty((t, k), dtype=np.int64)
        weights = np.empty((t, k), dtype=np.float32)
        self.kernels.route(np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(weight, dtype=np.float32), k,
                           renormalise, indices, weights)
        return indices, weights

    def sigmoid_grouped_top_k(self, x, weight, bias, k, n_group, topk_group, renormalise, scaling):
        logits = self.router_logits(x, weight)
        t, e = logits.shape
        if (self.kernels is None or e > self.kernels.MAX_ROUTED or e % n_group or (n_group > 1 and e // n_group < 2)
                or not 1 <= topk_group <= n_group or not 1 <= k <= topk_group * (e // n_group)):
            return host.sigmoid_grouped_top_k(logits, bias, k, n_group, topk_group, renormalise, scaling)
        indices = np.empty((t, k), dtype=np.int64)
        weights = np.empty((t, k), dtype=np.float32)
        self.kernels.sigmoid_route(np.ascontiguousarray(logits), None if bias is None else np.ascontiguousarray(
            bias, dtype=np.float32).reshape(-1), k, n_group, topk_group, renormalise, scaling, indices, weights)
        return indices, weights

    def routed_experts(self, x, indices, weights, fetch, window: int = 8, ready=None):
        if self.kernels is None:
            return super().routed_experts(x, indices, weights, fetch, window, ready)
        t, k = indices.shape
        if t == 1 and ready is None and k <= window:
            out, fetch = self._one_token_at_hand(x, indices, weights, fetch)
            if out is not None:
                return out
        out = np.zeros_like(x)
        if t == 1:  # decode: one token, k distinct experts
            order = np.argsort(indices[0])
            experts = indices[0, order].tolist()
            token_of = np.zeros(k, dtype=np.int32)
            starts, counts = range(k), (1,) * k
        else:  # (expert, token) pairs grouped by expert, ascending
            order, experts, starts, counts = host.group_by_expert(indices)
            token_of = (order // k).astype(np.int32)
        weight_of = np.ascontiguousarray(weights.ravel()[order], dtype=np.float32)
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

        for i, e in enumerate(experts):  # ascending expert ids: a fixed reduction order
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
    # -- absorbed MLA: kernels that compute each query row as alone, so a verification's
    # drafted positions go through one call each and still equal decode steps
    def _mla_kernels(self, kv_b=None) -> bool:
        return self.kernels is not None and isinstance(kv_b, np.ndarray) and kv_b.dtype == np.float32

    def mla_absorb_query(self, q_nope, kv_b, nope_dim, v_dim):
        if not self._mla_kernels(kv_b) or q_nope.dtype != np.float32:
            return super().mla_absorb_query(q_nope, kv_b, nope_dim, v_dim)
        t, h, _ = q_nope.shape
        w = self._kv_b_heads(kv_b, h, nope_dim, v_dim)[:, :nope_dim, :]  # (H, nope, rank): q @ W
        out = np.empty((t, h, kv_b.shape[-1]), dtype=np.float32)
        self.kernels.head_matmul(np.ascontiguousarray(q_nope), w, out, False)
        return out

    def mla_absorb_output(self, o_lat, kv_b, nope_dim, v_dim):
        if not self._mla_kernels(kv_b) or o_lat.dtype != np.float32:
            return super().mla_absorb_output(o_lat, kv_b, nope_dim, v_dim)
        t, h, _ = o_lat.shape
        w = self._kv_b_heads(kv_b, h, nope_dim, v_dim)[:, nope_dim:, :]  # (H, v, rank): o @ W^T
        out = np.empty((t, h, v_dim), dtype=np.float32)
        self.kernels.head_matmul(np.ascontiguousarray(o_lat), w, out, True)
        return out

    def mla_attention(self, q_lat, q_rot, latent, k_rot, start, scale, selected=None):
        if self.kernels is None or latent.dtype != k_rot.dtype:
            return super().mla_attention(q_lat, q_rot, latent, k_rot, start, scale, selected)
        return self.mla_attention_kv(q_lat, q_rot, np.concatenate([latent, k_rot], -1), start, scale, selected)

    def mla_attention_kv(self, q_lat, q_rot, kv, start, scale, selected=None):
        # attention with one KV head: keys the whole rows [latent, k_rot], values the latents
        if self.kernels is None or q_lat.dtype != np.float32 or kv.dtype not in _KV_DTYPES or kv.strides[-1] != kv.itemsize:
            return super().mla_attention_kv(q_lat, q_rot, kv, start, scale, selected)
        t, h, rank = q_lat.shape
        q = np.concatenate([q_lat, q_rot.astype(np.float32, copy=False)], -1)
        out = np.empty((t, h, rank), dtype=np.float32)
        if selected is None:
            self.kernels.attention(q, kv[None], kv[None, :, :rank], start, scale, out)
        else:
            visible = np.ascontiguousarray(self._visible(t, kv.shape[0], start, selected), dtype=np.uint8)
            self.kernels.attention(q, kv[None], kv[None, :, :rank], start, scale, out, visible)
        return out

    def sparse_attention(self, q, k, v, start, scale, selected):
        if self.kernels is not None and q.dtype == k.dtype == v.dtype == np.float32:
            q = np.ascontiguousarray(q)
            visible = np.ascontiguousarray(self._visible(q.shape[0], k.shape[1], start, selected), dtype=np.uint8)
            out = np.empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=np.float32)
            self.kernels.attention(q, k, v, start, scale, out, visible)
            return out
        return super().sparse_attention(q, k, v, start, scale, selected)

