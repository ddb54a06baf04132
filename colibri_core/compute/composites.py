"""The contract's composite operations, written once against its primitives.

Each function takes ``ops`` (any ``Backend``) and that backend's arrays, and computes
with ``ops``' primitives and the array protocol only, so it runs on the device of
whatever backend executes it: no host round trip unless a comment says why (a host
mask is uploaded with ``asarray``, which is not a synchronisation). ``Backend``'s default
methods call these; a backend may override an op with a fused kernel, and the
conformance kit checks each override against the composite computed on the same backend.

Masks are added, not selected: a position a query may not see gets ``-inf`` added to its
score (the host builds the 0 / -inf mask), as transformers' eager attention does.
"""

from __future__ import annotations

import numpy as np

from colibri_core.compute import host

NEG_INF = np.float32(-np.inf)


# -- helpers -------------------------------------------------------------------------------
def swap_last(x):
    """x with its last two axes exchanged."""
    axes = list(range(x.ndim))
    axes[-2], axes[-1] = axes[-1], axes[-2]
    return x.transpose(*axes)


def additive_mask(ops, visible: np.ndarray):
    """A host bool mask as the backend's float32 array of 0 (visible) and -inf."""
    return ops.asarray(np.where(visible, np.float32(0.0), NEG_INF).astype(np.float32))


def causal_visible(t: int, s: int, start: int, window: int | None = None) -> np.ndarray | None:
    """(T, S) bool: query t (at position start + t) sees keys s <= start + t (and, with a
    window, the last ``window`` of them, itself included); None when it sees every key."""
    if window is None and t == 1 and start + t >= s:
        return None
    pos = start + np.arange(t)[:, None]
    visible = np.arange(s)[None, :] <= pos
    if window is not None:
        visible &= np.arange(s)[None, :] > pos - int(window)
    return visible


def selected_visible(ops, t: int, s: int, start: int, selected) -> np.ndarray | None:
    """The causal mask narrowed to ``selected`` (backend int (T, K), -1 pads). The
    selection crosses to the host here: one synchronisation (a backend with a device
    selection overrides the attention that takes it)."""
    return causal_selected_visible(t, s, start, None if selected is None else ops.to_host(selected))


def causal_selected_visible(t: int, s: int, start: int, selected: np.ndarray | None) -> np.ndarray | None:
    """``causal_visible`` narrowed to a host ``selected`` (int (T, K), -1 pads) if any."""
    visible = causal_visible(t, s, start)
    if selected is None:
        return visible
    # -1 pads a row of fewer positions: it marks a spare column, dropped
    chosen = np.zeros((t, s + 1), dtype=bool)
    sel = np.asarray(selected, dtype=np.int64)
    np.put_along_axis(chosen, np.where(sel < 0, s, sel), True, axis=-1)
    chosen = chosen[:, :s]
    return chosen if visible is None else visible & chosen


def broadcast(ops, x, shape: tuple[int, ...]):
    """x broadcast to ``shape`` as a new array (the protocol has no broadcast_to)."""
    return ops.zeros(shape, ops.activation_dtype) + x


# -- attention -----------------------------------------------------------------------------
def grouped_attention(ops, q, k, v, scale: float, mask=None, sinks=None, bias=None):
    """Softmax attention of q (T, Hq, D) over k, v (Hkv, S, D / Dv), query head h on KV
    head h // (Hq / Hkv): scores * scale (+ ``bias`` (Hkv, G, T, S)) (+ the additive
    ``mask`` (T, S)); ``sinks`` (Hq,) join the softmax as one more column per head and
    are then dropped (gpt-oss, DeepSeek-V4). Returns (T, Hq, Dv)."""
    t, hq, d = q.shape
    hkv, s, _ = k.shape
    group = hq // hkv
    # a KV head's G query heads as G * T rows of one product: no copy of the keys per head
    qh = q.reshape(t, hkv, group, d).transpose(1, 2, 0, 3).reshape(hkv, group * t, d)
    scores = (ops.matmul(qh, swap_last(k)) * float(scale)).reshape(hkv, group, t, s)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores + mask
    if sinks is not None:
        sink = broadcast(ops, sinks.reshape(hkv, group, 1, 1), (hkv, group, t, 1))
        probs = ops.softmax(ops.concat([scores, sink], -1))[..., :s]
    else:
        probs = ops.softmax(scores)
    out = ops.matmul(probs.reshape(hkv, group * t, s), v)  # (Hkv, G * T, Dv)
    return out.reshape(hkv, group, t, v.shape[-1]).transpose(2, 0, 1, 3).reshape(t, hq, v.shape[-1])


def sparse_attention(ops, q, k, v, start, scale, selected):
    visible = selected_visible(ops, q.shape[0], k.shape[1], start, selected)
    return grouped_attention(ops, q, k, v, scale, None if visible is None else additive_mask(ops, visible))


def windowed_attention(ops, q, k, v, start, scale, window=None, sinks=None):
    visible = causal_visible(q.shape[0], k.shape[1], start, window)
    return grouped_attention(ops, q, k, v, scale, None if visible is None else additive_mask(ops, visible), sinks)


def masked_attention(ops, q, k, v, scale, visible, sinks=None):
    visible = host.check_visible(visible, q.shape[0], k.shape[1])
    return grouped_attention(ops, q, k, v, scale, additive_mask(ops, visible), sinks)


# the one-hot that gathers the relative bias by distance, at most this many bytes; above
# it (long prefills) the bias is gathered on the host
RELATIVE_ONEHOT_BYTES = 64 << 20


def attention_relative_bias(ops, q, k, v, start, scale, rel, table, window=None):
    t, hq, _ = q.shape
    hkv, s, _ = k.shape
    group, extent = hq // hkv, table.shape[-1]
    if 4 * t * extent * s > RELATIVE_ONEHOT_BYTES:
        on_host = [ops.to_host(a) for a in (q, k, v, rel, table)]
        out = host.relative_bias_attention(*on_host[:3], start, scale, *on_host[3:], window)
        return ops.asarray(out, ops.activation_dtype)
    bias = ops.matmul(rel, table)  # (T, Hq, E)
    # bias[t, h, d] belongs to key s = start + t - d: gathered by one product with a host
    # one-hot (T, E, S); distances at or past E get no bias
    distance = (start + np.arange(t))[:, None] - np.arange(s)[None, :]  # (T, S)
    onehot = (distance[:, None, :] == np.arange(extent)[None, :, None]).astype(np.float32)
    by_key = ops.matmul(bias, ops.asarray(onehot)).reshape(t, hkv, group, s).transpose(1, 2, 0, 3)
    visible = distance >= 0
    if window is not None:
        visible &= distance < int(window)
    return grouped_attention(ops, q, k, v, scale, additive_mask(ops, visible), bias=by_key)


# -- rotary embeddings ---------------------------------------------------------------------
def rope_interleaved(ops, x, cos, sin, rotary_dim):
    """Pairs (x0, x1), (x2, x3), ... de-interleaved (all first members, then all second
    members), then rotate-half RoPE: transformers' apply_rotary_pos_emb_interleave."""
    t, h, d = x.shape
    rot = x[..., :rotary_dim].reshape(t, h, rotary_dim // 2, 2).transpose(0, 1, 3, 2).reshape(t, h, rotary_dim)
    if rotary_dim < d:
        rot = ops.concat([rot, x[..., rotary_dim:]], -1)
    return ops.rope(rot, cos, sin, rotary_dim)


# -- multi-head latent attention (DeepSeek-V3, Kimi K2, GLM) -------------------------------
def mla_expand(ops, q_nope, q_rot, latent, k_rot, kv_b, nope_dim, v_dim):
    h = q_nope.shape[1]
    s, rope = k_rot.shape
    kv = ops.matmul(latent, swap_last(kv_b)).reshape(s, h, nope_dim + v_dim).transpose(1, 0, 2)  # (H, S, nope+v)
    keys = ops.concat([kv[..., :nope_dim], broadcast(ops, k_rot[None], (h, s, rope))], -1)
    return ops.concat([q_nope, q_rot], -1), keys, kv[..., nope_dim:]


def _kv_b_heads(kv_b, heads, nope_dim, v_dim):
    return kv_b.reshape(heads, nope_dim + v_dim, kv_b.shape[-1])  # (H, nope+v, rank)


def mla_absorb_query(ops, q_nope, kv_b, nope_dim, v_dim):
    w = _kv_b_heads(kv_b, q_nope.shape[1], nope_dim, v_dim)
    return ops.matmul(q_nope.transpose(1, 0, 2), w[:, :nope_dim, :]).transpose(1, 0, 2)  # (T, H, rank)


def mla_absorb_output(ops, o_lat, kv_b, nope_dim, v_dim):
    w = _kv_b_heads(kv_b, o_lat.shape[1], nope_dim, v_dim)
    return ops.matmul(o_lat.transpose(1, 0, 2), swap_last(w[:, nope_dim:, :])).transpose(1, 0, 2)  # (T, H, v)


def mla_attention(ops, q_lat, q_rot, latent, k_rot, start, scale, selected=None):
    t = q_lat.shape[0]
    s = latent.shape[0]
    scores = (ops.matmul(q_lat, swap_last(latent)) + ops.matmul(q_rot, swap_last(k_rot))) * float(scale)  # (T, H, S)
    visible = selected_visible(ops, t, s, start, selected)
    if visible is not None:
        scores = scores + additive_mask(ops, visible)[:, None, :]
    return ops.matmul(ops.softmax(scores), latent)  # (T, H, rank)


def dsa_index_scores(ops, q, k, weights, scale, start):
    per_head = ops.maximum(ops.matmul(q, swap_last(k)) * float(scale), 0.0)  # (T, Hi, S)
    scores = ops.matmul(weights[:, None, :], per_head)[:, 0, :]  # (T, S)
    visible = causal_visible(q.shape[0], k.shape[0], start)
    return scores if visible is None else scores + additive_mask(ops, visible)


# -- grouped projection, hyper-connections -------------------------------------------------
def grouped_linear(ops, x, weight, groups):
    t = x.shape[0]
    c = x.shape[-1] // groups
    r = weight.shape[0] // groups
    xg = x.reshape(t, groups, c).transpose(1, 0, 2)  # (G, T, C)
    out = ops.matmul(xg, swap_last(weight.reshape(groups, r, c)))  # (G, T, R)
    return out.transpose(1, 0, 2).reshape(t, groups * r)


def sinkhorn(ops, x, iters, eps):
    def by_columns(y):
        return y / (swap_last(ops.reduce_sum(swap_last(y))) + float(eps))

    x = by_columns(x)
    for _ in range(iters - 1):
        x = by_columns(x / (ops.reduce_sum(x) + float(eps)))
    return x


# -- recurrent layers ----------------------------------------------------------------------
def causal_conv1d(ops, x, weight, state):
    t, width = x.shape[0], weight.shape[1]
    full = ops.concat([state, x], 0)  # (K-1+T, C)
    out = full[0:t] * weight[:, 0]
    for j in range(1, width):
        out = out + full[j : j + t] * weight[:, j]
    # the new state a copy (* 1.0 is exact): a view would hold all T rows of [state; x]
    # alive in the sequence's state until the next step replaces it
    return out, full[t:] * 1.0


def _delta_heads(ops, q, k, v, beta):
    """(H, T, ...) views, the key heads repeated to the value heads."""
    hk, hv = k.shape[1], v.shape[1]
    if hv > hk:
        rep = hv // hk
        q, k = (broadcast(ops, a[:, :, None, :], (a.shape[0], hk, rep, a.shape[-1])).reshape(a.shape[0], hv, a.shape[-1])
                for a in (q, k))
    return q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2), beta.transpose(1, 0)


def delta_channel_step(ops, q, k, v, g, beta, state):
    """The gated delta rule, one position after another, a decay per key channel: g
    (T, Hv, Dk) (or (T, Hv, 1): one per head). Per value head:
    S = diag(exp(g)) S; S += k (beta * (v - k^T S))^T; out = q^T S."""
    t = q.shape[0]
    q, k, v, beta = _delta_heads(ops, q, k, v, beta)  # (H, T, D)
    decay = ops.exp(g).transpose(1, 0, 2)  # (H, T, Dk or 1)
    s = state
    outs = []
    for i in range(t):
        s = s * decay[:, i, :, None]
        kv_mem = ops.matmul(k[:, i, None, :], s)  # (H, 1, Dv)
        delta = (v[:, i, None, :] - kv_mem) * beta[:, i, None, None]
        s = s + ops.matmul(k[:, i, :, None], delta)  # (H, Dk, 1) @ (H, 1, Dv)
        outs.append(ops.matmul(q[:, i, None, :], s))  # (H, 1, Dv)
    return ops.concat(outs, 1).transpose(1, 0, 2), s


def gated_delta_step(ops, q, k, v, g, beta, state):
    return delta_channel_step(ops, q, k, v, g[..., None], beta, state)


# -- activations ---------------------------------------------------------------------------
def ungated_activation(ops, x, act):
    """``UngatedActivation`` ``act`` of x: "relu2" is max(x, 0)^2."""
    if act.name != "relu2":
        raise ValueError(f"ungated activation {act.name!r} is not implemented")
    r = ops.maximum(x, 0.0)
    return r * r


def gated_activation(ops, gate, up, act):
    if act.limit is not None:
        limit = float(act.limit)
        gate = -ops.maximum(-gate, -limit)  # min(gate, limit)
        up = ops.clip(up, limit)
    glu = gate * ops.sigmoid(gate * float(act.alpha))
    return glu * (up + float(act.up_offset)) if act.up_offset else glu * up
