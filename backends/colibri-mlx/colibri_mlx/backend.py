"""The MLX backend: the whole contract in MLX operations, float32.

It computes on Metal's GPU where Metal exists (Apple silicon), else on MLX's CPU build.
Every operation runs on the backend's own stream (``on_device``), whatever another part
of the process set as MLX's default. MLX evaluates lazily: operations build a graph that
runs when a result reaches the host (``to_host``: logits, router choices) or when the
routed experts bound what they hold (``routed_experts``).

MLX binds a stream, and the graph queued on it, to the thread that made it (another
thread fails: "There is no Stream(cpu, 0) in current thread"), while a model is loaded on
one thread and served by the batched engine on another. So the backend's stream is a
thread-local one: each thread computes on a stream of its own. What does cross threads
holds no pending operation: weights are made from host arrays (``prepare_weight`` too,
on the expert store's reading threads), and a sequence's state is built and advanced by
the one thread that runs it.

Packed weights become MLX's quantised layouts where those hold exactly the reference
numbers (``colibri_mlx.packed``); products with them run in ``mx.quantized_matmul``.
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx
import numpy as np

from colibri_core.compute.backend import Backend, allocated_dtype
from colibri_core.compute.host import check_visible, expert_groups, grouped_shapes
from colibri_core.formats.base import QuantTensor
from colibri_mlx import packed

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16, "int64": mx.int64,
          "int32": mx.int32, "uint8": mx.uint8}
# the host form each is made from (numpy has no bfloat16: float32, narrowed by MLX)
HOST_DTYPES = {"float32": np.float32, "bfloat16": np.float32, "float16": np.float16, "int64": np.int64,
               "int32": np.int32, "uint8": np.uint8}
SOFTPLUS_THRESHOLD = 20.0  # PyTorch's: above it softplus(x) is x


def on_device(method):
    """Run the method with the backend's stream as MLX's default."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with mx.stream(self.stream):
            return method(self, *args, **kwargs)

    return run


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


class MlxBackend(Backend):
    name = "mlx"
    unified_memory = True  # MLX arrays live in host memory on Apple silicon and on the CPU build alike
    deferred = True  # lazy arrays: evaluated when the host reads one

    def __init__(self, device: str | None = None):
        """``device``: "gpu" or "cpu"; by default Metal's GPU where it exists, else the CPU."""
        super().__init__()
        if device is None:
            device = "gpu" if mx.metal.is_available() else "cpu"
        if device not in ("gpu", "cpu"):
            raise ValueError(f"device {device!r}: expected 'gpu' or 'cpu'")
        self.device = mx.gpu if device == "gpu" else mx.cpu
        self.stream = mx.new_thread_local_stream(self.device)  # one per thread: see the module docstring

    # -- memory ------------------------------------------------------------------------
    @on_device
    def asarray(self, host, dtype="float32"):
        target = allocated_dtype(DTYPES, dtype)
        x = mx.array(np.asarray(host, dtype=HOST_DTYPES[dtype]))
        return x if x.dtype == target else x.astype(target)

    @on_device
    def zeros(self, shape, dtype="float32"):
        return mx.zeros(tuple(shape), dtype=allocated_dtype(DTYPES, dtype))

    def _to_host(self, x):
        if x.dtype == mx.bfloat16:  # numpy has no bfloat16
            x = x.astype(mx.float32)
        return np.array(x)

    def _to_host_all(self, *arrays) -> list[np.ndarray]:
        """Several arrays brought to the host at one synchronisation (counted once)."""
        self.host_syncs += 1
        mx.eval(*arrays)
        return [self._to_host(a) for a in arrays]

    def device_memory(self) -> int:
        """Metal's recommended working set on Apple silicon; the host's memory on the CPU
        build (MLX memory is host memory either way: ``unified_memory``)."""
        working_set = mx.device_info().get("max_recommended_working_set_size") if self.device == mx.gpu else None
        return int(working_set) if working_set else host_memory()

    # -- weights -----------------------------------------------------------------------
    def has_kernel(self, kind):
        return kind in packed.NATIVE_KINDS

    def keeps_stored(self, kind, use):
        return use in ("linear", "embedding") and self.has_kernel(kind)

    def prepare_weight(self, w, use="linear"):
        # no MLX operation here, so no stream: the expert store's reading threads call it
        if isinstance(w, QuantTensor):
            return packed.prepare(w)
        return mx.array(np.asarray(w, dtype=np.float32))

    def weight_nbytes(self, kind, shape, stored_nbytes):
        if kind is None:
            return super().weight_nbytes(kind, shape, stored_nbytes)
        return packed.prepared_nbytes(kind, tuple(shape), stored_nbytes)

    # -- dense operations --------------------------------------------------------------
    @on_device
    def embedding(self, table, ids):
        ids = mx.array(np.asarray(ids, dtype=np.int64))
        if isinstance(table, mx.array):
            return table[ids]
        return table.rows(ids)

    @on_device
    def linear(self, x, weight, bias=None):
        y = x @ weight.T if isinstance(weight, mx.array) else weight.matmul(x)
        return y if bias is None else y + bias

    @on_device
    def rms_norm(self, x, weight, eps):
        return mx.fast.rms_norm(x, weight, eps)

    @on_device
    def layer_norm(self, x, weight, bias, eps):
        return mx.fast.layer_norm(x, weight, bias, eps)

    @on_device
    def rope(self, x, cos, sin, rotary_dim):
        cos, sin = cos[:, None, :], sin[:, None, :]
        rot = x[..., :rotary_dim]
        half = rotary_dim // 2
        out = rot * cos + mx.concatenate((-rot[..., half:], rot[..., :half]), axis=-1) * sin
        return self._with_rest(out, x, rotary_dim)

    @on_device
    def rope_interleaved(self, x, cos, sin, rotary_dim):
        half = rotary_dim // 2
        cos, sin = cos[:, None, :half], sin[:, None, :half]
        first, second = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
        out = mx.concatenate((first * cos - second * sin, second * cos + first * sin), axis=-1)
        return self._with_rest(out, x, rotary_dim)

    @staticmethod
    def _with_rest(rotated, x, rotary_dim):
        """The rotated features followed by x's features beyond ``rotary_dim``."""
        if rotary_dim == x.shape[-1]:
            return rotated
        return mx.concatenate((rotated, x[..., rotary_dim:]), axis=-1)

    @staticmethod
    def _visible(t, s, start, selected=None):
        """(T, S) bool: what each query may see (causal, and the selection if any); None
        when every query sees every key."""
        visible = None
        if t > 1 or start + t < s:
            visible = mx.arange(s)[None, :] <= (start + mx.arange(t))[:, None]
        if selected is not None:
            sel = selected.astype(mx.int32)  # -1 pads a row of fewer positions: a spare column, dropped
            chosen = mx.put_along_axis(mx.zeros((t, s + 1), dtype=mx.bool_), mx.where(sel < 0, s, sel),
                                       mx.array(True), axis=-1)[:, :s]
            visible = chosen if visible is None else visible & chosen
        return visible

    def _attend(self, q, k, v, scale, visible):
        """Attention of q (T, Hq, D) over k, v (Hkv, S, D / Dv) where ``visible`` allows.
        Heads of q share KV heads in groups (MLX's fused attention takes GQA as is)."""
        out = mx.fast.scaled_dot_product_attention(q.transpose(1, 0, 2)[None], k[None], v[None], scale=scale,
                                                   mask=visible)
        return out[0].transpose(1, 0, 2)

    @on_device
    def attention(self, q, k, v, start, scale):
        return self._attend(q, k, v, scale, self._visible(q.shape[0], k.shape[1], start))

    @on_device
    def sparse_attention(self, q, k, v, start, scale, selected):
        return self._attend(q, k, v, scale, self._visible(q.shape[0], k.shape[1], start, selected))

    @staticmethod
    def _recent(t, s, start, window):
        """(T, S) bool: causal, and within the last ``window`` positions when given."""
        pos, keys = start + mx.arange(t)[:, None], mx.arange(s)[None, :]
        visible = keys <= pos
        return visible if window is None else visible & (keys > pos - int(window))

    @on_device
    def windowed_attention(self, q, k, v, start, scale, window=None, sinks=None):
        if window is None and sinks is None:
            return self.attention(q, k, v, start, scale)
        # MLX's fused attention takes the sinks as gpt-oss defines them (one logit per head
        # joining the softmax, adding no value)
        out = mx.fast.scaled_dot_product_attention(q.transpose(1, 0, 2)[None], k[None], v[None], scale=scale,
                                                   mask=self._recent(q.shape[0], k.shape[1], start, window), sinks=sinks)
        return out[0].transpose(1, 0, 2)

    @on_device
    def attention_relative_bias(self, q, k, v, start, scale, rel, table, window=None):
        t, hq, _ = q.shape
        s = k.shape[1]
        bias = (rel @ table).transpose(1, 0, 2)  # (Hq, T, E): one bias per distance
        extent = bias.shape[-1]
        distance = (start + mx.arange(t))[:, None] - mx.arange(s)[None, :]  # (T, S)
        index = mx.broadcast_to(mx.clip(distance, 0, extent - 1)[None], (hq, t, s))
        by_distance = mx.where(distance < extent, mx.take_along_axis(bias, index, axis=-1), 0.0)
        visible = distance >= 0
        if window is not None:
            visible = visible & (distance < int(window))
        # the bias and the mask as one additive mask (each query sees itself: no row is all -inf)
        additive = mx.where(visible, by_distance, -mx.inf)
        out = mx.fast.scaled_dot_product_attention(q.transpose(1, 0, 2)[None], k[None], v[None], scale=scale,
                                                   mask=additive[None])
        return out[0].transpose(1, 0, 2)

    @on_device
    def clip(self, x, limit):
        return mx.clip(x, -limit, limit)

    @on_device
    def silu(self, x):
        # x / (1 + exp(-x)) as the reference writes it; exp(-x) may overflow to inf for very
        # negative x, which correctly gives -0
        return x / (1.0 + mx.exp(-x))

    @on_device
    def silu_mul(self, gate, up):
        return gate / (1.0 + mx.exp(-gate)) * up

    @on_device
    def gated_activation(self, gate, up, act):
        if act.plain:
            return self.silu_mul(gate, up)
        if act.limit is not None:
            gate, up = mx.minimum(gate, act.limit), mx.clip(up, -act.limit, act.limit)
        return gate / (1.0 + mx.exp(-gate * act.alpha)) * (up + act.up_offset)

    @on_device
    def sigmoid(self, x):
        return 1.0 / (1.0 + mx.exp(-x))

    @on_device
    def softplus(self, x):
        return mx.where(x > SOFTPLUS_THRESHOLD, x, mx.log1p(mx.exp(mx.minimum(x, SOFTPLUS_THRESHOLD))))

    @on_device
    def softmax(self, x):
        return self._softmax(x)

    @staticmethod
    def _softmax(x):
        e = mx.exp(x - mx.max(x, axis=-1, keepdims=True))
        return e / mx.sum(e, axis=-1, keepdims=True)

    @on_device
    def l2_norm(self, x, eps):
        return x * (1.0 / mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True) + eps))

    @on_device
    def concat(self, arrays, axis):
        return mx.concatenate(list(arrays), axis=axis)

    # -- primitives ----------------------------------------------------------------------
    @on_device
    def exp(self, x):
        return mx.exp(x)

    @on_device
    def maximum(self, x, floor):
        return mx.maximum(x, floor)

    @on_device
    def matmul(self, a, b):
        return a @ b

    @on_device
    def reduce_sum(self, x):
        return x.sum(axis=-1, keepdims=True)

    @on_device
    def reduce_max(self, x):
        return x.max(axis=-1, keepdims=True)

    @on_device
    def take_rows(self, x, rows):
        return x[mx.array(np.asarray(rows, dtype=np.int64))]

    @on_device
    def add_rows(self, out, rows, y, scale):
        return out.at[mx.array(np.asarray(rows, dtype=np.int64))].add(y * mx.array(scale)[:, None])

    # -- routing -----------------------------------------------------------------------
    @staticmethod
    def _top_k(scores, k):
        """Indices of the k largest scores per row, largest first; of equal scores the
        lower index first: MLX's sort is stable, so sorting -scores ascending keeps equal
        scores in index order."""
        return mx.argsort(-scores, axis=-1)[..., :k]

    @on_device
    def top_k(self, scores, k):
        return self._top_k(scores, k).astype(mx.int64)

    @on_device
    def softmax_top_k(self, x, weight, k, renormalise, bias=None):
        probs = self._softmax(self.linear(x, weight, bias))
        indices = self._top_k(probs, k)
        weights = mx.take_along_axis(probs, indices, axis=-1)
        if renormalise:
            weights = weights / mx.sum(weights, axis=-1, keepdims=True)
        indices, weights = self._to_host_all(indices, weights)
        return indices.astype(np.int64), weights

    @on_device
    def sigmoid_grouped_top_k(self, x, weight, bias, k, n_group, topk_group, renormalise, scaling):
        scores = self.sigmoid(self.linear(x, weight))
        choice = scores if bias is None else scores + mx.array(bias)
        if n_group > 1:
            t, n = choice.shape
            grouped = choice.reshape(t, n_group, n // n_group)
            best_two = -mx.sort(-grouped, axis=-1)[..., :2]
            groups = self._top_k(best_two[..., 0] + best_two[..., 1], topk_group)
            keep = mx.put_along_axis(mx.zeros((t, n_group), dtype=mx.bool_), groups, mx.array(True), axis=-1)
            keep = mx.repeat(keep, n // n_group, axis=-1)
            choice = mx.where(keep, choice, -mx.inf)
        indices = self._top_k(choice, k)
        weights = mx.take_along_axis(scores, indices, axis=-1)
        if renormalise:
            weights = weights / (mx.sum(weights, axis=-1, keepdims=True) + 1e-20)
        indices, weights = self._to_host_all(indices, weights * scaling)
        return indices.astype(np.int64), weights

    @on_device
    def scored_top_k(self, x, weight, bias, k, scoring, scaling, chosen=None):
        logits = self.linear(x, weight)
        if scoring == "sqrtsoftplus":
            scores = mx.sqrt(self.softplus(logits))
        elif scoring == "sigmoid":
            scores = self.sigmoid(logits)
        else:
            return super().scored_top_k(x, weight, bias, k, scoring, scaling, chosen)  # names the bad scoring
        if chosen is None:
            indices = self._top_k(scores if bias is None else scores + mx.array(bias), k)
        else:  # a hash-routed layer: the experts looked up from the token ids
            indices = mx.array(np.asarray(chosen, dtype=np.int32))
        weights = mx.take_along_axis(scores, indices, axis=-1)
        weights = weights / (mx.sum(weights, axis=-1, keepdims=True) + 1e-20)
        indices, weights = self._to_host_all(indices, weights * scaling)
        return indices.astype(np.int64), weights

    # -- DeepSeek-V4's attention and grouped output projection -------------------------
    @on_device
    def masked_attention(self, q, k, v, scale, visible, sinks=None):
        visible = check_visible(visible, q.shape[0], k.shape[1])
        # MLX's fused attention: the boolean mask as given, the sinks as gpt-oss's (one
        # logit per head joining the softmax, adding no value)
        out = mx.fast.scaled_dot_product_attention(q.transpose(1, 0, 2)[None], k[None], v[None], scale=scale,
                                                   mask=mx.array(visible), sinks=sinks)
        return out[0].transpose(1, 0, 2)

    @on_device
    def grouped_linear(self, x, weight, groups):
        t, c, r = grouped_shapes(x.shape, weight.shape, groups)
        xs = x.reshape(t, groups, c).transpose(1, 0, 2)  # (G, T, C)
        ws = weight.reshape(groups, r, c)  # (G, R, C)
        return (xs @ ws.transpose(0, 2, 1)).transpose(1, 0, 2).reshape(t, -1)  # (T, G * R)

    # -- routed experts ----------------------------------------------------------------
    @on_device
    def routed_experts(self, x, indices, weights, fetch, window=8, ready=None):
        """Each expert once for all its tokens, outputs summed into the tokens' rows in
        ascending expert order. The graph of the experts fetched so far is evaluated every
        ``window`` experts (so it holds no more of them), and before waiting for an expert
        still being read (the device works while the read finishes)."""
        single = x.shape[0] == 1
        out = mx.zeros(x.shape, dtype=x.dtype)
        held = 0
        for e, rows, scale in expert_groups(indices, weights):
            if held and ready is not None and not ready(e):
                mx.async_eval(out)
            w = fetch(e)
            if single:  # one token: its rows are [0]; no gather or scatter
                out = out + self.swiglu_expert(x, w["gate"], w["up"], w["down"]) * float(scale[0])
            else:
                idx = mx.array(rows)
                y = self.swiglu_expert(x[idx], w["gate"], w["up"], w["down"])
                out = out.at[idx].add(y * mx.array(scale)[:, None])
            held += 1
            if held >= max(1, window):
                mx.eval(out)
                held = 0
        return out

    # -- multi-head latent attention and DSA -------------------------------------------
    @on_device
    def mla_attention(self, q_lat, q_rot, latent, k_rot, start, scale, selected=None):
        t = q_lat.shape[0]
        s = latent.shape[0]
        scores = (q_lat @ latent.T + q_rot @ k_rot.T) * scale  # (T, H, S)
        visible = self._visible(t, s, start, selected)
        if visible is not None:
            scores = mx.where(visible[:, None, :], scores, -mx.inf)
        return self._softmax(scores) @ latent  # (T, H, rank)

    @on_device
    def dsa_index_scores(self, q, k, weights, scale, start):
        t, s = q.shape[0], k.shape[0]
        per_head = mx.maximum((q @ k.T) * scale, 0.0)  # (T, Hi, S)
        scores = (weights[:, None, :] @ per_head)[:, 0, :]  # (T, S)
        visible = self._visible(t, s, start)
        return scores if visible is None else mx.where(visible, scores, -mx.inf)

    # -- recurrent (linear-attention) layers: the chunked prefill (the step is the composite)
    @staticmethod
    def _delta_heads(q, k, v, g, beta):
        """(H, T, ...) views with the key heads repeated to the value heads."""
        rep = v.shape[1] // k.shape[1]
        if rep > 1:
            q, k = mx.repeat(q, rep, axis=1), mx.repeat(k, rep, axis=1)
        return q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2), g.T, beta.T

    @on_device
    def gated_delta_chunked(self, q, k, v, g, beta, state, chunk_size):
        t = q.shape[0]
        q, k, v, g, beta = self._delta_heads(q, k, v, g, beta)
        h, dv = v.shape[0], v.shape[2]
        c = chunk_size
        pad = (-t) % c
        if pad:
            q, k, v = (mx.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (q, k, v))
            g, beta = (mx.pad(a, ((0, 0), (0, pad))) for a in (g, beta))
        n = (t + pad) // c
        v_beta = (v * beta[..., None]).reshape(h, n, c, dv)
        k_beta = (k * beta[..., None]).reshape(h, n, c, -1)
        q, k = q.reshape(h, n, c, -1), k.reshape(h, n, c, -1)
        cum = mx.cumsum(g.reshape(h, n, c), axis=-1)
        upper = mx.triu(mx.ones((c, c), dtype=mx.bool_), 1)
        pair = mx.exp(mx.where(upper, -mx.inf, cum[..., :, None] - cum[..., None, :]))
        kt = k.swapaxes(-1, -2)
        ut = (k_beta @ kt) * pair
        intra = (q @ kt) * pair
        # (I + strictly-lower(ut)) X = B, a unit lower-triangular solve (MLX's is CPU-only)
        lower = mx.tril(ut, -1) + mx.eye(c, dtype=mx.float32)
        solved = mx.linalg.solve_triangular(lower, mx.concatenate((v_beta, k_beta * mx.exp(cum)[..., None]), axis=-1),
                                            upper=False, stream=mx.cpu)
        new_values, k_cumdecay = solved[..., :dv], solved[..., dv:]
        q = q * mx.exp(cum)[..., None]
        k = k * mx.exp(cum[..., -1:] - cum)[..., None]
        chunk_decay = mx.exp(cum[..., -1])[..., None, None]
        s = state
        outs = []
        for i in range(n):  # chunks, not positions: each chunk's state feeds the next
            v_new = new_values[:, i] - k_cumdecay[:, i] @ s
            outs.append(q[:, i] @ s + intra[:, i] @ v_new)
            s = s * chunk_decay[:, i] + k[:, i].swapaxes(-1, -2) @ v_new
        out = mx.concatenate(outs, axis=1)[:, :t]  # (H, T, Dv)
        return out.transpose(1, 0, 2), s
