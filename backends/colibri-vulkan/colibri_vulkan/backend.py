"""The Vulkan compute backend (``--backend vulkan``): every abstract operation of the
contract (the primitives exp, maximum, matmul, reduce_sum/max included), and the products,
norms, RoPE, attention and recurrent ops, in GLSL compute shaders (``shaders/``, committed
as SPIR-V in ``spirv/``) on one Vulkan device.

What does not run in a shader of its own (docs/backends.md, Vulkan): the contract's
composites it does not override (``masked_attention``, ``grouped_linear``, ``sinkhorn``, the
per-channel delta rule: ``colibri_core.compute.composites`` on the primitives above, on the
device), the reference implementations of ``top_k`` (a host round trip), of the routers'
selection (the router product runs on the device; the ids must reach the host anyway) and
of ``routed_experts`` / ``swiglu_expert`` / ``linears`` (compositions of device operations).
"""

from __future__ import annotations

import numpy as np

from colibri_core.compute.backend import Backend
from colibri_core.formats.base import QuantTensor, bf16_to_f32
from colibri_core.formats.fp8 import E4M3_TO_F32
from colibri_core.formats.integer import E2M1_VALUES
from colibri_vulkan.array import ITEMSIZE, VulkanArray, contiguous_strides
from colibri_vulkan.device import pack, shared_context

MAX_DIMS = 6
GROUP_LIMIT = 65535
ELTWISE = {"copy": 0, "+": 1, "-": 2, "*": 3, "/": 4, "neg": 11, "silu": 12, "sigmoid": 13, "softplus": 14, "clip": 15,
           "silu_mul": 16, "gated": 17, "exp": 18, "maximum": 19}
SCALAR = {"+": 5, "*": 6, "-": 7, "/": 9}
SCALAR_REFLECTED = {"+": 5, "*": 6, "-": 8, "/": 10}
ROWS = {"rms": 0, "layer": 1, "l2": 2, "softmax": 3}
REDUCE = {"sum": 4, "max": 5}  # rows.comp modes with one value out per row
KINDS = ("q8", "q4", "mxfp4", "fp8", "bf16")


def groups_for(n: int, per_group: int = 1) -> tuple[int, int, int]:
    """Workgroups covering n items (x at most 65535, the rest in y); shaders flatten (y, x)."""
    total = max(1, -(-n // per_group))
    if total <= GROUP_LIMIT:
        return (total, 1, 1)
    return (GROUP_LIMIT, -(-total // GROUP_LIMIT), 1)


def batch_strides(x: VulkanArray, lead: tuple[int, ...]) -> list[int]:
    """x's strides over the batch axes ``lead`` it broadcasts to (0 where it broadcasts)."""
    own = x.shape[:-2]
    pad = len(lead) - len(own)
    return [0] * pad + [0 if n == 1 else s for n, s in zip(own, x.strides[:-2])]


def fold_batch_axes(lead: tuple[int, ...], strides: list[list[int]]) -> list[tuple[int, tuple[int, ...]]]:
    """The batch axes as few (size, per-operand strides) axes as the strides allow: size-1
    axes drop out, and an axis folds into the one before it where, in every operand, the
    outer stride is the inner stride times the inner size. Never empty (a lone axis of 1)."""
    axes: list[tuple[int, tuple[int, ...]]] = []
    for i, size in enumerate(lead):
        st = tuple(s[i] for s in strides)
        if size == 1:
            continue
        if axes and all(outer == inner * size for outer, inner in zip(axes[-1][1], st)):
            axes[-1] = (axes[-1][0] * size, st)
        else:
            axes.append((size, st))
    return axes or [(1, (0,) * len(strides))]


class DeviceWeight:
    """A weight in the device's memory in its stored form: packed bytes, float32 scales."""

    def __init__(self, kind: str, shape: tuple[int, int], data, scales=None, g: int = 0, block=(1, 1)):
        self.kind, self.shape, self.data, self.scales, self.g, self.block = kind, shape, data, scales, g, block

    @property
    def nbytes(self) -> int:
        return self.data.size + (self.scales.size if self.scales is not None else 0)


def packed_device_bytes(kind: str, shape: tuple[int, int], block=(128, 128)) -> int:
    """Bytes a packed weight takes on the device: its bytes plus float32 scales."""
    n, k = shape
    if kind == "bf16":
        return 2 * n * k
    if kind == "q8":
        return n * k + 4 * n
    if kind == "q4":
        g = -(-k // 64)
        return n * g * 32 + 4 * n * g
    if kind == "mxfp4":
        g = -(-k // 32)
        return n * g * 16 + 4 * n * g
    if kind == "fp8":
        return n * k + 4 * -(-n // block[0]) * -(-k // block[1])
    raise ValueError(f"no Vulkan kernel for packed kind {kind!r}")


class VulkanBackend(Backend):
    name = "vulkan"
    deferred = True  # dispatches are recorded and submitted when the host downloads a result

    def __init__(self, device_index: int | None = None, context=None):
        super().__init__()
        self.ctx = context if context is not None else shared_context(device_index)
        self.device = self.ctx.info
        # a CPU implementation or an integrated GPU computes in host memory
        self.unified_memory = self.device.type in ("cpu", "integrated")
        self._dummy = self.ctx.allocate(4)
        self._luts = {}

    @property
    def product_programs(self) -> dict[str, str]:
        """The shader each weight kind's products run (docs/backends.md, Vulkan: variants)."""
        return dict(self.ctx.product_programs)

    def device_memory(self) -> int | None:
        return self.device.device_local_bytes

    # -- memory ------------------------------------------------------------------------
    def _new(self, shape, dtype: str = "float32") -> VulkanArray:
        if dtype not in ITEMSIZE:
            raise ValueError(f"dtype {dtype!r} is not one the Vulkan backend allocates ({', '.join(ITEMSIZE)})")
        shape = tuple(int(n) for n in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[dtype]
        return VulkanArray(self, self.ctx.allocate(max(4, nbytes)), shape, dtype)

    def asarray(self, host, dtype="float32"):
        if isinstance(host, VulkanArray):
            return host if host.dtype_name == dtype else self.asarray(self._to_host(host), dtype)
        x = self._new(np.shape(host), dtype)
        self.ctx.upload(x.alloc, np.ascontiguousarray(host, dtype=dtype))
        return x

    def zeros(self, shape, dtype="float32"):
        x = self._new(shape, dtype)
        self.ctx.fill_zero(x.alloc)
        return x

    def _to_host(self, x):
        if not isinstance(x, VulkanArray):
            return np.asarray(x)
        item = x.itemsize
        if x.size == 0:
            return np.zeros(x.shape, x.dtype)
        lo = x.offset + sum((n - 1) * s for n, s in zip(x.shape, x.strides) if s < 0)
        hi = x.offset + sum((n - 1) * s for n, s in zip(x.shape, x.strides) if s > 0)
        raw = np.frombuffer(self.ctx.download(x.alloc, lo * item, (hi - lo + 1) * item), dtype=x.dtype)
        view = np.lib.stride_tricks.as_strided(raw[x.offset - lo:], x.shape, tuple(s * item for s in x.strides))
        return np.array(view, copy=True)

    def nbytes(self, x):
        return int(x.nbytes)

    # -- the eltwise shader: views, copies, arithmetic --------------------------------------
    @staticmethod
    def _word_view(x: VulkanArray, shape: tuple[int, ...]):
        """(offset, strides) in 32-bit words of x broadcast to ``shape`` (an int64 element
        is two words: a trailing dimension of 2)."""
        words = x.itemsize // 4
        pad = len(shape) - x.ndim
        strides = [0] * pad + [0 if n == 1 and m != 1 else s * words for n, m, s in zip(x.shape, shape[pad:], x.strides)]
        if words == 2:
            strides.append(1)
        return x.offset * words, strides

    def _eltwise(self, op: int, out: VulkanArray, a: VulkanArray, b: VulkanArray | None = None, s: float = 0.0,
                 s2: float = 0.0, s3: float = 0.0):
        shape = out.shape
        oo, so = self._word_view(out, shape)
        oa, sa = self._word_view(a, shape)
        ob, sb = self._word_view(b, shape) if b is not None else (0, [0] * len(so))
        full = list(shape) + ([2] if out.itemsize == 8 else [])
        if len(full) > MAX_DIMS:  # fold leading dimensions that are contiguous in every operand
            raise ValueError(f"the Vulkan backend's elementwise operations take at most {MAX_DIMS} dimensions")
        n = int(np.prod(full, dtype=np.int64))
        if n == 0:
            return out
        if not full:
            full, so, sa, sb = [1], [0], [0], [0]
        d = len(full)
        six = lambda v: list(v) + [0] * (MAX_DIMS - d)  # noqa: E731
        push = pack("iifff6i6i6i6iiii", n, op | (d << 8), s, s2, s3, *six(full), *six(so), *six(sa), *six(sb),
                    oo, oa, ob)
        self.ctx.dispatch("eltwise", [out.alloc, a.alloc, (b if b is not None else a).alloc], push, groups_for(n, 256))
        return out

    def copy(self, x: VulkanArray) -> VulkanArray:
        """A dense copy of a view."""
        return self._eltwise(0, self._new(x.shape, x.dtype_name), x)

    def dense(self, x: VulkanArray) -> VulkanArray:
        if not isinstance(x, VulkanArray):
            return self.asarray(np.asarray(x, dtype=np.float32))
        return x if x.is_dense() else self.copy(x)

    def assign(self, dst: VulkanArray, value) -> None:
        if not isinstance(value, VulkanArray):
            value = self.asarray(np.broadcast_to(np.asarray(value, dtype=dst.dtype), dst.shape), dst.dtype_name)
        np.broadcast_shapes(value.shape, dst.shape)  # raises when they do not broadcast
        if value.alloc is dst.alloc:  # overlapping source: read it whole first
            value = self.copy(value)
        self._eltwise(0, dst, value)

    def binary(self, op: str, a: VulkanArray, b: VulkanArray) -> VulkanArray:
        shape = np.broadcast_shapes(a.shape, b.shape)
        return self._eltwise(ELTWISE[op], self._new(shape), a, b)

    def scalar(self, op: str, a: VulkanArray, s: float, reflected: bool) -> VulkanArray:
        table = SCALAR_REFLECTED if reflected else SCALAR
        return self._eltwise(table[op], self._new(a.shape), a, None, s)

    def unary(self, op: str, a: VulkanArray, s: float = 0.0) -> VulkanArray:
        return self._eltwise(ELTWISE[op], self._new(a.shape), a, None, s)

    # -- weights -----------------------------------------------------------------------
    def has_kernel(self, kind):
        return kind in KINDS

    def _lut(self, kind: str):
        if kind not in self._luts:
            table = E2M1_VALUES if kind == "mxfp4" else E4M3_TO_F32
            self._luts[kind] = self.asarray(np.asarray(table, dtype=np.float32))
        return self._luts[kind]

    def _upload_bytes(self, data: np.ndarray):
        raw = np.ascontiguousarray(data).view(np.uint8).ravel()
        alloc = self.ctx.allocate(max(4, raw.size))
        self.ctx.upload(alloc, raw)
        return alloc

    def _upload_f32(self, values: np.ndarray):
        return self.asarray(np.asarray(values, dtype=np.float32).ravel())

    def prepare_weight(self, w, use="linear"):
        if isinstance(w, QuantTensor):
            if not self.keeps_stored(w.kind, use):  # not asked for; decode like the reference
                from colibri_core.formats.reference import dequantize

                return self.asarray(dequantize(w))
            n, k = w.shape
            data = self._upload_bytes(w.data)
            if w.kind == "bf16":
                return DeviceWeight("bf16", (n, k), data)
            if w.kind == "q8":
                return DeviceWeight("q8", (n, k), data, self._upload_f32(w.scales))
            if w.kind == "q4":
                scales = bf16_to_f32(w.scales) if w.scales.dtype == np.uint16 else w.scales
                return DeviceWeight("q4", (n, k), data, self._upload_f32(scales), g=w.scales.shape[1])
            if w.kind == "mxfp4":
                scales = np.ldexp(np.float32(1.0), w.scales.astype(np.int32) - 127).astype(np.float32)
                return DeviceWeight("mxfp4", (n, k), data, self._upload_f32(scales), g=w.scales.shape[1])
            if w.kind == "fp8":
                scales = np.asarray(w.scales, dtype=np.float32)
                return DeviceWeight("fp8", (n, k), data, self._upload_f32(scales), g=scales.shape[1],
                                    block=tuple(w.block))
            raise ValueError(f"no Vulkan kernel for packed kind {w.kind!r}")
        return self.asarray(np.asarray(w, dtype=np.float32))

    def weight_nbytes(self, kind, shape, stored_nbytes):
        if kind is not None:
            return packed_device_bytes(kind, tuple(shape))
        return 4 * int(np.prod(shape, dtype=np.int64))

    # -- products ----------------------------------------------------------------------
    def linear(self, x, weight, bias=None):
        if isinstance(weight, VulkanArray):
            weight = DeviceWeight("f32", weight.shape, self.dense(weight).alloc)
        n, k = weight.shape
        lead = x.shape[:-1]
        x2 = self.dense(x).reshape(-1, k)
        t = x2.shape[0]
        out = self._new((t, n))
        if t and n:
            scales = weight.scales.alloc if weight.scales is not None else self._dummy
            lut = self._lut(weight.kind).alloc if weight.kind in ("mxfp4", "fp8") else self._dummy
            b = self.dense(bias).alloc if bias is not None else self._dummy
            bo, bi = weight.block
            program = self.ctx.product_programs[weight.kind]
            if "_subgroup" in program:  # a subgroup per row, rows_per_group rows per workgroup (more past 65535)
                rpg = max(self.ctx.rows_per_group, -(-n // GROUP_LIMIT))
                groups = (-(-n // rpg), -(-t // 8), 1)
            else:  # an invocation per row, 64 per workgroup
                rpg, groups = 0, (-(-n // 64), -(-t // 8), 1)
            push = pack("9i", t, n, k, weight.g, bo, bi, int(bias is not None), 0, rpg)
            self.ctx.dispatch(program, [out.alloc, x2.alloc, weight.data, scales, lut, b], push, groups)
        return out.reshape(*lead, n)

    def _bmm(self, out, a, b, nb, m, n, k, a_strides, b_strides, c_strides, ao=0, bo=0, co=0):
        push = pack("16i", nb, m, n, k, ao, *a_strides, bo, *b_strides, co, *c_strides)
        self.ctx.dispatch("bmm", [out.alloc, a.alloc, b.alloc], push, groups_for(nb * m * n, 256))
        return out

    def matmul(self, a, b):
        """The ``bmm`` shader over the operands' own strides: transposes and slices are read
        in place, a 2-D (or size-1) batch of b has batch stride 0, and the leading axes
        fold into the shader's one batch axis where every operand's strides allow; the
        axes that do not fold are dispatched one index at a time."""
        a, b = self._float_view(a), self._float_view(b)
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul takes (..., M, K) @ (..., K, N), not {a.shape} @ {b.shape}")
        (m, k), (kb, n) = a.shape[-2:], b.shape[-2:]
        if k != kb:
            raise ValueError(f"matmul: {a.shape} @ {b.shape} (inner sizes {k} and {kb} differ)")
        lead = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
        out = self._new(lead + (m, n))
        if out.size == 0:
            return out
        if k == 0:
            self.ctx.fill_zero(out.alloc)
            return out
        operands = (a, b, out)
        axes = fold_batch_axes(lead, [batch_strides(x, lead) for x in operands])
        (nb, inner), outer = axes[-1], axes[:-1]
        for index in np.ndindex(*(size for size, _ in outer)):
            ao, bo, co = (x.offset + sum(i * st[j] for i, (_, st) in zip(index, outer)) for j, x in enumerate(operands))
            self._bmm(out, a, b, nb, m, n, k, (inner[0], *a.strides[-2:]), (inner[1], *b.strides[-2:]),
                      (inner[2], *out.strides[-2:]), ao, bo, co)
        return out

    # -- rows --------------------------------------------------------------------------
    def _float_view(self, x) -> VulkanArray:
        if not isinstance(x, VulkanArray):
            return self.asarray(np.asarray(x, dtype=np.float32))
        if x.dtype_name != "float32":
            raise TypeError(f"the Vulkan backend computes in float32, not {x.dtype_name}")
        return x

    def _contiguous(self, x) -> VulkanArray:
        """x itself when its rows lie one after another (at any offset), else a dense copy."""
        x = self._float_view(x)
        return x if x.is_contiguous() else self.copy(x)

    def _rows(self, mode: str, x, weight=None, bias=None, eps: float = 0.0):
        x = self._contiguous(x)
        cols = x.shape[-1]
        rows = x.size // cols if cols else 0
        out = self._new(x.shape)
        if rows:
            w = self.dense(weight).alloc if weight is not None else self._dummy
            b = self.dense(bias).alloc if bias is not None else self._dummy
            push = pack("5ifi", rows, cols, ROWS[mode], int(weight is not None), int(bias is not None), eps, x.offset)
            self.ctx.dispatch("rows", [out.alloc, x.alloc, w, b], push, groups_for(rows))
        return out

    def _reduce(self, mode: str, x):
        x = self._contiguous(x)
        if x.ndim == 0:
            raise ValueError("a reduction over the last axis needs an axis")
        cols = x.shape[-1]
        out = self._new(x.shape[:-1] + (1,))
        if out.size and not cols:
            if mode == "max":
                raise ValueError("reduce_max over an empty axis has no value")
            self.ctx.fill_zero(out.alloc)
        elif out.size:
            push = pack("5ifi", out.size, cols, REDUCE[mode], 0, 0, 0.0, x.offset)
            self.ctx.dispatch("rows", [out.alloc, x.alloc, self._dummy, self._dummy], push, groups_for(out.size))
        return out

    def reduce_sum(self, x):
        return self._reduce("sum", x)

    def reduce_max(self, x):
        return self._reduce("max", x)

    def rms_norm(self, x, weight, eps):
        return self._rows("rms", x, weight, None, eps)

    def layer_norm(self, x, weight, bias, eps):
        return self._rows("layer", x, weight, bias, eps)

    def l2_norm(self, x, eps):
        return self._rows("l2", x, None, None, eps)

    def softmax(self, x):
        return self._rows("softmax", x)

    # -- elementwise -------------------------------------------------------------------
    def clip(self, x, limit):
        return self.unary("clip", x, float(limit))

    def silu(self, x):
        return self.unary("silu", x)

    def sigmoid(self, x):
        return self.unary("sigmoid", x)

    def softplus(self, x):
        return self.unary("softplus", x)

    def exp(self, x):
        return self.unary("exp", self._float_view(x))

    def maximum(self, x, floor):
        return self.unary("maximum", self._float_view(x), float(floor))

    def silu_mul(self, gate, up):
        return self._eltwise(ELTWISE["silu_mul"], self._new(np.broadcast_shapes(gate.shape, up.shape)), gate, up)

    def gated_activation(self, gate, up, act):
        if act.plain:
            return self.silu_mul(gate, up)
        limit = float("inf") if act.limit is None else float(act.limit)  # min / clip by inf change nothing
        return self._eltwise(ELTWISE["gated"], self._new(np.broadcast_shapes(gate.shape, up.shape)), gate, up, limit,
                             float(act.alpha), float(act.up_offset))

    def concat(self, arrays, axis):
        axis = axis % arrays[0].ndim
        shape = list(arrays[0].shape)
        shape[axis] = sum(a.shape[axis] for a in arrays)
        out = self._new(tuple(shape), arrays[0].dtype_name)
        at = 0
        for a in arrays:
            key = (slice(None),) * axis + (slice(at, at + a.shape[axis]),)
            self._eltwise(0, out[key], a)
            at += a.shape[axis]
        return out

    # -- rows by index -----------------------------------------------------------------
    def _gather(self, mode: int, out, x, rows: np.ndarray, scale=None):
        width = int(np.prod(x.shape[1:], dtype=np.int64)) if x.ndim > 1 else 1
        n = len(rows)
        if n and width:
            idx = self.asarray(np.asarray(rows, dtype=np.int32), "int32")
            sc = self.asarray(np.asarray(scale, dtype=np.float32)).alloc if scale is not None else self._dummy
            push = pack("5i", n, width, mode, x.offset, out.offset)
            self.ctx.dispatch("gather", [out.alloc, x.alloc, idx.alloc, sc], push, groups_for(n * width, 256))
        return out

    def take_rows(self, x, rows):
        x = self.dense(x)
        rows = np.asarray(rows, dtype=np.int64)
        return self._gather(0, self._new((len(rows),) + x.shape[1:]), x, rows)

    def embedding(self, table, ids):
        return self.take_rows(table, np.asarray(ids, dtype=np.int64).ravel()).reshape(*np.shape(ids), table.shape[-1])

    def add_rows(self, out, rows, y, scale):
        out = self.dense(out)
        return self._gather(1, out, self.dense(y), np.asarray(rows, dtype=np.int64), scale)

    # -- RoPE --------------------------------------------------------------------------
    def _rope(self, mode: int, x, cos, sin, rotary_dim):
        x = self.dense(x)
        t, h, d = x.shape
        out = self._new(x.shape)
        if x.size:
            push = pack("5i", t, h, d, rotary_dim, mode)
            c, s = self.dense(cos), self.dense(sin)
            if c.shape[-1] != rotary_dim:  # tables wider than the rotary part: keep its columns
                c, s = self.copy(c[:, :rotary_dim]), self.copy(s[:, :rotary_dim])
            self.ctx.dispatch("rope", [out.alloc, x.alloc, c.alloc, s.alloc], push, groups_for(x.size, 256))
        return out

    def rope(self, x, cos, sin, rotary_dim):
        return self._rope(0, x, cos, sin, rotary_dim)

    def rope_interleaved(self, x, cos, sin, rotary_dim):
        return self._rope(1, x, cos, sin, rotary_dim)

    # -- attention ---------------------------------------------------------------------
    def _kv(self, x):
        return x if x.strides[-1] == 1 or x.shape[-1] == 1 else self.copy(x)

    def _attention(self, q, k, v, start, scale, selected=None, window=None, sinks=None, rel=None, table=None):
        q = self.dense(q)
        k, v = self._kv(k), self._kv(v)
        t, hq, d = q.shape
        hkv, s, _ = k.shape
        dv = v.shape[-1]
        out = self._new((t, hq, dv))
        if t:
            sel, nsel, selo = self._dummy, 0, 0
            if selected is not None:
                selected = self.dense(self.asarray(selected, "int64") if not isinstance(selected, VulkanArray) else selected)
                sel, nsel = selected.alloc, selected.shape[-1]
            sink = rel_buf = table_buf = self._dummy
            if sinks is not None:
                sink = self.dense(sinks).alloc
            nrel = extent = 0
            if rel is not None:
                rel, table = self.dense(rel), self.dense(table)
                rel_buf, table_buf, (nrel, extent) = rel.alloc, table.alloc, table.shape
            push = pack("7if12i", t, hq, hkv, d, dv, s, int(start), float(scale), k.offset, k.strides[0], k.strides[1],
                        v.offset, v.strides[0], v.strides[1], nsel, selo, 0 if window is None else int(window),
                        int(sinks is not None), nrel, extent)
            chunks = -(-dv // 32)
            self.ctx.dispatch("attention", [out.alloc, q.alloc, k.alloc, v.alloc, sel, sink, rel_buf, table_buf], push,
                              (-(-hq * chunks // 64), t, 1))
        return out

    def attention(self, q, k, v, start, scale):
        return self._attention(q, k, v, start, scale)

    def sparse_attention(self, q, k, v, start, scale, selected):
        return self._attention(q, k, v, start, scale, selected)

    def windowed_attention(self, q, k, v, start, scale, window=None, sinks=None):
        return self._attention(q, k, v, start, scale, window=window, sinks=sinks)

    def attention_relative_bias(self, q, k, v, start, scale, rel, table, window=None):
        return self._attention(q, k, v, start, scale, window=window, rel=rel, table=table)

    # -- MLA and DSA -------------------------------------------------------------------
    def mla_expand(self, q_nope, q_rot, latent, k_rot, kv_b, nope_dim, v_dim):
        t, h, _ = q_nope.shape
        s, rope = k_rot.shape
        kv = self.linear(latent, kv_b).reshape(s, h, nope_dim + v_dim).transpose(1, 0, 2)  # (H, S, nope+v), a view
        keys = self._new((h, s, nope_dim + rope))
        self._eltwise(0, keys[:, :, :nope_dim], kv[:, :, :nope_dim])
        self._eltwise(0, keys[:, :, nope_dim:], k_rot[None])
        return self.concat([q_nope, q_rot], -1), keys, self.copy(kv[:, :, nope_dim:])

    def mla_absorb_query(self, q_nope, kv_b, nope_dim, v_dim):
        q, w = self.dense(q_nope), self.dense(kv_b)
        t, h, _ = q.shape
        rank = w.shape[-1]
        out = self._new((t, h, rank))
        # out[t, h, r] = sum_i q[t, h, i] * kv_b[h * (nope + v) + i, r]
        return self._bmm(out, q, w, h, t, rank, nope_dim, (nope_dim, h * nope_dim, 1),
                         ((nope_dim + v_dim) * rank, rank, 1), (rank, h * rank, 1))

    def mla_absorb_output(self, o_lat, kv_b, nope_dim, v_dim):
        o, w = self.dense(o_lat), self.dense(kv_b)
        t, h, rank = o.shape
        out = self._new((t, h, v_dim))
        # out[t, h, j] = sum_r o[t, h, r] * kv_b[h * (nope + v) + nope + j, r]
        return self._bmm(out, o, w, h, t, v_dim, rank, (rank, h * rank, 1), ((nope_dim + v_dim) * rank, 1, rank),
                         (v_dim, h * v_dim, 1), bo=nope_dim * rank)

    def mla_attention(self, q_lat, q_rot, latent, k_rot, start, scale, selected=None):
        # latent attention is attention with one KV head: keys [latent, k_rot], values latent
        q = self.concat([q_lat, q_rot], -1)
        keys = self.concat([latent, k_rot], -1)[None]
        return self._attention(q, keys, latent[None], start, scale, selected)

    def dsa_index_scores(self, q, k, weights, scale, start):
        q, w = self.dense(q), self.dense(weights)
        k = self._kv(k)
        t, h, d = q.shape
        s = k.shape[0]
        out = self._new((t, s))
        if t and s:
            push = pack("5if2i", t, h, d, s, int(start), float(scale), k.offset, k.strides[0])
            self.ctx.dispatch("dsa", [out.alloc, q.alloc, k.alloc, w.alloc], push, groups_for(t * s, 256))
        return out

    # -- recurrent (causal_conv1d is the composite) ------------------------------------
    def gated_delta_step(self, q, k, v, g, beta, state):
        q, k, v, g, beta = (self.dense(a) for a in (q, k, v, g, beta))
        t, hk, dk = q.shape
        hv, dv = v.shape[1], v.shape[2]
        new_state = self.copy(state)
        out = self._new((t, hv, dv))
        if t:
            push = pack("5i", t, hk, hv, dk, dv)
            self.ctx.dispatch("delta", [out.alloc, new_state.alloc, q.alloc, k.alloc, v.alloc, g.alloc, beta.alloc], push,
                              groups_for(hv * dv, 64))
        return out, new_state

    def gated_delta_chunked(self, q, k, v, g, beta, state, chunk_size):
        # the same recurrence position by position: mathematically identical to the chunked form
        return self.gated_delta_step(q, k, v, g, beta, state)
