"""Host math on numpy float32 arrays: the routers' selection (whose ids the expert
store needs on the host), the reference backend's plain forms of the composite ops (the
yardstick the conformance kit checks every backend against), and small shape checks the
backends share. No backend arrays here."""

from __future__ import annotations

import numpy as np


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def top_k_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest scores per row, largest first (ties: lower index first)."""
    order = np.argsort(-scores, axis=-1, kind="stable")
    return order[..., :k].astype(np.int64)


def softmax_top_k(logits: np.ndarray, k: int, renormalise: bool) -> tuple[np.ndarray, np.ndarray]:
    """The k most probable experts of each row of router logits and their probabilities."""
    probs = softmax(logits)
    indices = top_k_indices(probs, k)
    weights = np.take_along_axis(probs, indices, axis=-1)
    if renormalise:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return indices, weights.astype(np.float32)


def sigmoid_grouped_top_k(logits: np.ndarray, bias: np.ndarray | None, k: int, n_group: int, topk_group: int,
                          renormalise: bool, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """``Backend.sigmoid_grouped_top_k`` on host float32 logits."""
    with np.errstate(over="ignore"):
        scores = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))
    choice = scores if bias is None else scores + bias
    if n_group > 1:
        t, n = choice.shape
        grouped = choice.reshape(t, n_group, n // n_group)
        best_two = -np.sort(-grouped, axis=-1)[..., :2]
        group_scores = best_two[..., 0] + best_two[..., 1]
        groups = top_k_indices(group_scores, topk_group)
        keep = np.zeros((t, n_group), dtype=bool)
        np.put_along_axis(keep, groups, True, axis=-1)
        choice = np.where(np.repeat(keep, n // n_group, axis=-1), choice, np.float32(-np.inf))
    indices = top_k_indices(choice, k)
    weights = np.take_along_axis(scores, indices, axis=-1)
    if renormalise:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    weights = weights * np.float32(scaling)
    return indices, weights.astype(np.float32)


def softmax_grouped_top_k(logits: np.ndarray, k: int, n_group: int, topk_group: int, scaling: float,
                          bias: np.ndarray | None = None, renormalise: bool = False,
                          norm_min: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """``SoftmaxGroupedTopKRouter`` on host float32 logits: probabilities softmax(logits)
    over all experts; ``bias`` (ERNIE 4.5's e_score_correction_bias) is added to them
    for choosing only; with ``n_group`` > 1 (DeepSeek-V2's ``group_limited_greedy``)
    experts form equal groups scored by their best probability and the experts outside
    the ``topk_group`` best groups are set to 0 before the top k are taken (``n_group``
    1: the top k of all experts). The chosen (unbiased) probabilities are divided by
    max(their sum, ``norm_min``) when ``renormalise``, then multiplied by ``scaling``."""
    probs = softmax(logits.astype(np.float32, copy=False)).astype(np.float32, copy=False)
    choice = probs if bias is None else probs + np.asarray(bias, dtype=np.float32).reshape(-1)
    if n_group > 1:
        t, n = probs.shape
        group_scores = choice.reshape(t, n_group, n // n_group).max(axis=-1)
        groups = top_k_indices(group_scores, topk_group)
        keep = np.zeros((t, n_group), dtype=bool)
        np.put_along_axis(keep, groups, True, axis=-1)
        choice = np.where(np.repeat(keep, n // n_group, axis=-1), choice, np.float32(0.0))
    indices = top_k_indices(choice, k)
    weights = np.take_along_axis(probs, indices, axis=-1)
    if renormalise:
        weights = weights / np.maximum(weights.sum(axis=-1, keepdims=True), np.float32(norm_min))
    if scaling != 1.0:
        weights = weights * np.float32(scaling)
    return indices, weights.astype(np.float32)


def sparsemixer_top2(logits: np.ndarray, jitter_eps: float) -> tuple[np.ndarray, np.ndarray]:
    """Phi-MoE's sparsemixer router as transformers computes it in eval mode, on host
    float32 logits: the best expert, weighted by its softmax among the experts whose
    logit is within a relative 2 * ``jitter_eps`` of it; then the best of the others,
    weighted by its softmax among those (of the others) within 2 * ``jitter_eps`` of it.
    The two weights are not renormalised."""
    scores = logits.astype(np.float32, copy=False)
    eps2, ninf = np.float32(2 * jitter_eps), np.float32(-np.inf)
    indices, weights = [], []
    masked = scores
    for _ in range(2):
        best = np.argmax(masked, axis=-1)[:, None]
        top = np.take_along_axis(masked, best, axis=-1)
        with np.errstate(invalid="ignore", divide="ignore"):  # 0 / 0 is NaN, never masked, as in torch
            # the threshold measures every logit (the first choice's too) against the best
            far = (top - scores) / np.maximum(np.abs(scores), top) > eps2
        gates = softmax(np.where(far, ninf, masked))
        indices.append(best)
        weights.append(np.take_along_axis(gates, best, axis=-1))
        masked = masked.copy()
        np.put_along_axis(masked, best, ninf, axis=-1)  # the second choice excludes the first
    return np.concatenate(indices, axis=-1).astype(np.int64), np.concatenate(weights, axis=-1).astype(np.float32)


# (token, expert) pairs up to which grouping them in Python beats numpy's argsort +
# unique (~15 us of fixed cost; measured: 2 x 6 pairs 9 vs 34 us, 8 x 8 16 vs 20 us,
# 16 x 8 32 vs 22 us): a verification's or a batched step's few rows
SMALL_GROUPING = 64


def group_by_expert(indices: np.ndarray) -> tuple[np.ndarray, list[int], list[int], list[int]]:
    """(order, experts, starts, counts) of ``indices`` (T, k): ``order`` the flat (token,
    slot) positions sorted by expert, stably (token order within an expert); for each
    expert used, ascending, its id, where its positions start in ``order`` and how many."""
    if indices.size <= SMALL_GROUPING:
        ids = indices.ravel().tolist()
        order = sorted(range(len(ids)), key=ids.__getitem__)  # sorted() is stable
        experts, starts, counts = [], [], []
        for j, p in enumerate(order):
            if experts and experts[-1] == ids[p]:
                counts[-1] += 1
            else:
                experts.append(ids[p])
                starts.append(j)
                counts.append(1)
        return np.asarray(order, dtype=np.intp), experts, starts, counts
    flat = indices.ravel()
    order = np.argsort(flat, kind="stable")
    experts, starts, counts = np.unique(flat[order], return_index=True, return_counts=True)
    return order, experts.tolist(), starts.tolist(), counts.tolist()


def expert_groups(indices: np.ndarray, weights: np.ndarray):
    """(expert, token rows, their weights) for each expert the tokens use, in ascending
    expert order: the fixed reduction order of ``routed_experts``."""
    order, experts, starts, counts = group_by_expert(indices)
    rows = (order // indices.shape[1]).astype(np.int64)
    scale = np.ascontiguousarray(weights.ravel()[order], dtype=np.float32)
    for e, s, c in zip(experts, starts, counts):
        yield e, rows[s : s + c], scale[s : s + c]


def _delta_channel_heads(q, k, v, g, beta):
    """(H, T, ...) float32 copies with the key heads repeated to the value heads."""
    rep = v.shape[1] // k.shape[1]
    f32 = [np.asarray(a, dtype=np.float32) for a in (q, k, v, g, beta)]
    q, k, v, g, beta = f32
    if rep > 1:
        q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
    return q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2), g.transpose(1, 0, 2), beta.T


def delta_channel_step(q, k, v, g, beta, state):
    """``Backend.gated_delta_channel_step`` on host float32 arrays."""
    t = q.shape[0]
    q, k, v, g, beta = _delta_channel_heads(q, k, v, g, beta)
    s = np.array(state, dtype=np.float32, copy=True)
    out = np.empty((v.shape[0], t, v.shape[2]), dtype=np.float32)
    decay = np.exp(g)  # (H, T, Dk)
    for i in range(t):
        s = s * decay[:, i, :, None]
        kv_mem = (s * k[:, i, :, None]).sum(axis=-2)
        delta = (v[:, i] - kv_mem) * beta[:, i, None]
        s = s + k[:, i, :, None] * delta[:, None, :]
        out[:, i] = (s * q[:, i, :, None]).sum(axis=-2)
    return np.ascontiguousarray(out.transpose(1, 0, 2)), s


def delta_channel_chunked(q, k, v, g, beta, state, chunk_size):
    """``Backend.gated_delta_channel_chunked`` on host float32 arrays: the WY/UT form of
    transformers' chunk_kimi_delta_attention, the decay inside each key-channel product."""
    t = q.shape[0]
    q, k, v, g, beta = _delta_channel_heads(q, k, v, g, beta)
    h, dk, dv = v.shape[0], k.shape[2], v.shape[2]
    c = int(chunk_size)
    pad = (-t) % c
    if pad:
        q, k, v, g = (np.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (q, k, v, g))
        beta = np.pad(beta, ((0, 0), (0, pad)))
    n = (t + pad) // c
    v_beta = (v * beta[..., None]).reshape(h, n, c, dv)
    k_beta = (k * beta[..., None]).reshape(h, n, c, dk)
    q, k = q.reshape(h, n, c, dk), k.reshape(h, n, c, dk)
    cum = np.cumsum(g.reshape(h, n, c, dk), axis=2, dtype=np.float32)  # per chunk, per channel
    upper = np.triu(np.ones((c, c), dtype=bool), 1)
    eye = np.eye(c, dtype=np.float32)
    s = np.array(state, dtype=np.float32, copy=True)
    out = np.empty((h, n, c, dv), dtype=np.float32)
    for i in range(n):
        ci = cum[:, i]  # (H, C, Dk)
        with np.errstate(over="ignore"):  # masked (upper) entries may overflow before masking
            pair = np.exp(np.where(upper[None, :, :, None], np.float32(-np.inf), ci[:, :, None, :] - ci[:, None, :, :]))
        # (H, C, C): sum over channels of x[i, d] y[j, d] exp(cum[i, d] - cum[j, d]), j <= i
        ut = np.einsum("hid,hjd,hijd->hij", k_beta[:, i], k[:, i], pair, optimize=True)
        intra = np.einsum("hid,hjd,hijd->hij", q[:, i], k[:, i], pair, optimize=True)
        lower = np.tril(ut, -1) + eye  # (I + strictly-lower(ut)) X = B: a unit lower-triangular solve
        new_values = np.linalg.solve(lower, v_beta[:, i]).astype(np.float32)
        k_cumdecay = np.linalg.solve(lower, k_beta[:, i] * np.exp(ci)).astype(np.float32)
        v_new = new_values - k_cumdecay @ s
        out[:, i] = (q[:, i] * np.exp(ci)) @ s + intra @ v_new
        last = ci[:, -1]  # (H, Dk)
        s = s * np.exp(last)[:, :, None] + (k[:, i] * np.exp(last[:, None, :] - ci)).swapaxes(-1, -2) @ v_new
    out = out.reshape(h, n * c, dv)[:, :t]
    return np.ascontiguousarray(out.transpose(1, 0, 2)), s


def sinkhorn(x, iters, eps):
    """``Backend.sinkhorn`` on a host float32 array."""
    x = np.asarray(x, dtype=np.float32)
    eps = np.float32(eps)
    x = x / (x.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        x = x / (x.sum(axis=-1, keepdims=True) + eps)
        x = x / (x.sum(axis=-2, keepdims=True) + eps)
    return x


def check_visible(visible, queries: int, keys: int) -> np.ndarray:
    """``masked_attention``'s mask as a host bool (T, S) array, its shape checked (every
    backend's implementation takes it through here)."""
    visible = np.asarray(visible, dtype=bool)
    if visible.shape != (queries, keys):
        raise ValueError(f"masked_attention: visible is {visible.shape}, queries and keys are {(queries, keys)}")
    return visible


def grouped_shapes(x_shape, weight_shape, groups: int) -> tuple[int, int, int]:
    """``grouped_linear``'s (T, C, R): tokens, features per group, rows per group; a shape
    mismatch is refused (every backend's implementation checks through here)."""
    t, width = x_shape
    if width % groups or weight_shape[0] % groups or weight_shape[1] * groups != width:
        raise ValueError(f"grouped_linear: {groups} groups do not fit x {tuple(x_shape)} and weight {tuple(weight_shape)}")
    return t, width // groups, weight_shape[0] // groups


def masked_attention(q, k, v, scale, visible, sinks=None):
    """``Backend.masked_attention`` on host float32 arrays (transformers' eager DeepSeek-V4
    attention: the mask added, the sink joined, the max taken over keys and sink)."""
    q, k, v = (np.asarray(a, dtype=np.float32) for a in (q, k, v))
    t, hq, d = q.shape
    hkv, s, _ = k.shape
    visible = check_visible(visible, t, s)
    group = hq // hkv
    qh = q.reshape(t, hkv, group, d).transpose(1, 2, 0, 3)  # (Hkv, G, T, D)
    scores = np.matmul(qh, k[:, None].transpose(0, 1, 3, 2)) * np.float32(scale)  # (Hkv, G, T, S)
    scores = np.where(visible, scores, np.float32(-np.inf))
    if sinks is not None:
        sink = np.broadcast_to(np.asarray(sinks, dtype=np.float32).reshape(hkv, group, 1, 1), (hkv, group, t, 1))
        scores = np.concatenate([scores, sink], axis=-1)
    scores = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(scores)
    probs = e / e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        probs = probs[..., :-1]
    out = np.matmul(probs, v[:, None])  # (Hkv, G, T, Dv)
    return np.ascontiguousarray(out.transpose(2, 0, 1, 3).reshape(t, hq, v.shape[-1]), dtype=np.float32)


def grouped_linear(x, weight, groups):
    """``Backend.grouped_linear`` on host float32 arrays."""
    x, weight = np.asarray(x, dtype=np.float32), np.asarray(weight, dtype=np.float32)
    t, c, r = grouped_shapes(x.shape, weight.shape, groups)
    xs = x.reshape(t, groups, c).transpose(1, 0, 2)  # (G, T, C)
    ws = weight.reshape(groups, r, c)  # (G, R, C)
    out = np.matmul(xs, ws.transpose(0, 2, 1))  # (G, T, R)
    return np.ascontiguousarray(out.transpose(1, 0, 2).reshape(t, -1), dtype=np.float32)


ROUTER_SCORINGS = ("sqrtsoftplus", "sigmoid")


def router_scores(logits, scoring):
    """f(logits) of ``Backend.scored_top_k`` in float32 (softplus as torch: x itself above 20)."""
    logits = np.asarray(logits, dtype=np.float32)
    with np.errstate(over="ignore"):
        if scoring == "sqrtsoftplus":
            return np.sqrt(np.where(logits > 20, logits, np.log1p(np.exp(logits)))).astype(np.float32)
        if scoring == "sigmoid":
            return (np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))).astype(np.float32)
    raise ValueError(f"router scoring {scoring!r} is not one of {ROUTER_SCORINGS}")


def scored_top_k(logits, bias, k, scoring, scaling, chosen=None):
    """``Backend.scored_top_k`` on host float32 logits."""
    scores = router_scores(logits, scoring)
    if chosen is None:
        indices = top_k_indices(scores if bias is None else scores + bias, k)
    else:
        indices = np.asarray(chosen, dtype=np.int64)
    weights = np.take_along_axis(scores, indices, axis=-1)
    weights = weights / (weights.sum(axis=-1, keepdims=True) + np.float32(1e-20))
    return indices, (weights * np.float32(scaling)).astype(np.float32)


def windowed_attention(q, k, v, start, scale, window=None, sinks=None):
    """``Backend.windowed_attention`` on host float32 arrays (transformers' eager gpt-oss
    attention: the sink joins the softmax after the max is taken over keys and sink):
    ``masked_attention`` with the causal window as its mask."""
    t, s = np.shape(q)[0], np.shape(k)[1]
    pos = start + np.arange(t)[:, None]
    visible = np.arange(s)[None, :] <= pos
    if window is not None:
        visible &= np.arange(s)[None, :] > pos - int(window)
    return masked_attention(q, k, v, scale, visible, sinks)


def gated_activation(gate, up, act):
    """``Backend.gated_activation`` on host float32 arrays."""
    gate, up = np.asarray(gate, dtype=np.float32), np.asarray(up, dtype=np.float32)
    if act.limit is not None:
        limit = np.float32(act.limit)
        gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    with np.errstate(over="ignore"):
        glu = gate / (np.float32(1.0) + np.exp(-gate * np.float32(act.alpha)))
    return (glu * (up + np.float32(act.up_offset))).astype(np.float32, copy=False)


def relative_bias_attention(q, k, v, start, scale, rel, table, window=None):
    """``Backend.attention_relative_bias`` on host float32 arrays (transformers' eager
    Inkling attention: scores * scale, then the bias, then the mask)."""
    q, k, v, rel, table = (np.asarray(a, dtype=np.float32) for a in (q, k, v, rel, table))
    bias = np.matmul(rel, table)  # (T, Hq, E)
    t, hq, d = q.shape
    hkv, s, _ = k.shape
    group, extent = hq // hkv, bias.shape[-1]
    qh = q.reshape(t, hkv, group, d).transpose(1, 2, 0, 3)  # (Hkv, G, T, D)
    scores = np.matmul(qh, k[:, None].transpose(0, 1, 3, 2)) * np.float32(scale)  # (Hkv, G, T, S)
    distance = (start + np.arange(t))[:, None] - np.arange(s)[None, :]  # (T, S)
    by_head = bias.reshape(t, hkv, group, extent).transpose(1, 2, 0, 3)  # (Hkv, G, T, E)
    index = np.broadcast_to(np.clip(distance, 0, extent - 1), (hkv, group, t, s))
    gathered = np.take_along_axis(by_head, index, axis=-1)
    scores = scores + np.where((distance >= 0) & (distance < extent), gathered, np.float32(0.0))
    visible = distance >= 0
    if window is not None:
        visible &= distance < int(window)
    scores = np.where(visible, scores, np.float32(-np.inf))
    probs = softmax(scores)
    out = np.matmul(probs, v[:, None])  # (Hkv, G, T, Dv)
    return np.ascontiguousarray(out.transpose(2, 0, 1, 3).reshape(t, hq, v.shape[-1]), dtype=np.float32)


def delta_chunked(xp, overflow_ok, q, k, v, g, beta, state, chunk_size):
    """``Backend.gated_delta_chunked`` in the WY/UT form of transformers'
    torch_chunk_gated_delta_rule, for a numpy-like array module ``xp`` (numpy, CuPy);
    ``overflow_ok`` a context in which exp may overflow (masked entries do, before the
    mask takes them)."""
    t = q.shape[0]
    rep = v.shape[1] // k.shape[1]
    if rep > 1:
        q, k = xp.repeat(q, rep, axis=1), xp.repeat(k, rep, axis=1)
    q, k, v, g, beta = q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2), g.T, beta.T
    h, dv = v.shape[0], v.shape[2]
    c = chunk_size
    pad = (-t) % c
    if pad:
        q, k, v = (xp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (q, k, v))
        g, beta = (xp.pad(a, ((0, 0), (0, pad))) for a in (g, beta))
    n = (t + pad) // c
    v_beta = (v * beta[..., None]).reshape(h, n, c, dv)
    k_beta = (k * beta[..., None]).reshape(h, n, c, -1)
    q, k = q.reshape(h, n, c, -1), k.reshape(h, n, c, -1)
    cum = xp.cumsum(g.reshape(h, n, c), axis=-1, dtype=xp.float32)
    upper = xp.triu(xp.ones((c, c), dtype=bool), 1)
    with overflow_ok:
        pair = xp.exp(xp.where(upper, xp.float32(-np.inf), cum[..., :, None] - cum[..., None, :]))
    kt = k.swapaxes(-1, -2)
    ut = (k_beta @ kt) * pair
    intra = (q @ kt) * pair
    # (I + strictly-lower(ut)) X = B: a unit lower-triangular solve, as solve_triangular(unitriangular=True)
    lower = xp.tril(ut, -1) + xp.eye(c, dtype=xp.float32)
    new_values = xp.linalg.solve(lower, v_beta).astype(xp.float32)
    k_cumdecay = xp.linalg.solve(lower, k_beta * xp.exp(cum)[..., None]).astype(xp.float32)
    q = q * xp.exp(cum)[..., None]
    k = k * xp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = xp.exp(cum[..., -1])[..., None, None]
    s = xp.array(state, dtype=xp.float32, copy=True)
    out = xp.empty((h, n, c, dv), dtype=xp.float32)
    for i in range(n):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].swapaxes(-1, -2) @ v_new
    out = out.reshape(h, n * c, dv)[:, :t]
    return xp.ascontiguousarray(out.transpose(1, 0, 2)), s
