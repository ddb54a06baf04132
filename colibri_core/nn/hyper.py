"""Manifold-constrained hyper-connections (mHC; DeepSeek-V4, GLM-5 Next).

The residual is ``n_streams`` parallel streams, (T, N, D) instead of (T, D). Around each
block (attention, MLP) a ``HyperConnection`` computes, per token, from all N streams
(flattened, RMS-normalised without weight, projected by ``fn``):

    pre  = sigmoid(w_pre  * scale[0] + base_pre)  + eps        (N,)  collapses the streams
    post = 2 * sigmoid(w_post * scale[1] + base_post)           (N,)  spreads the block's output
    comb = sinkhorn(softmax(w_comb * scale[2] + base_comb) + eps)  (N, N)  mixes the residual

The block sees ``sum_j pre[j] * streams[j]``; its output y gives the new streams
``out[k] = post[k] * y + sum_j comb[j, k] * streams[j]`` (comb used transposed, as
transformers does). The embeddings enter as N copies; ``HyperHead`` collapses the
streams before the final norm: a learned weighting (DeepSeek-V4's ``hc_head``) or their
mean (GLM-5 Next).

Everything is composed from contract ops (``rms_norm``, ``linear``, ``sigmoid``,
``softmax``, and ``sinkhorn`` for the normalisation) plus array-protocol arithmetic, so
every backend runs it; all of it is per token, so a batched step's rows stay independent.
"""

from __future__ import annotations

from colibri_core.nn.layers import DecoderLayer, Embedding, Linear, Step
from colibri_core.nn.stages import ATTENTION, OTHER, PREFETCH
from colibri_core.nn.weights import Param


def _collapse(streams, pre, n: int):
    """sum_j pre[:, j] * streams[:, j]: (T, N, D), (T, N) -> (T, D), in stream order."""
    out = pre[:, 0:1] * streams[:, 0, :]
    for j in range(1, n):
        out = out + pre[:, j : j + 1] * streams[:, j, :]
    return out


class HyperConnection:
    """One mHC site (a layer's ``attn_hc`` or ``ffn_hc``): ``fn`` (N * (N + 2), N * D),
    ``base`` (N * (N + 2),) and ``scale`` (3,), in transformers' order [pre | post | comb].
    ``norm_eps``: the unweighted RMSNorm's epsilon (the model's ``rms_norm_eps``);
    ``eps``: ``hc_eps``; ``sinkhorn_iters``: ``hc_sinkhorn_iters``."""

    def __init__(self, fn: Param, base: Param, scale: Param, *, n_streams: int, sinkhorn_iters: int, eps: float,
                 norm_eps: float):
        n = n_streams
        if fn.shape[0] != n * (n + 2) or base.shape != (n * (n + 2),) or scale.shape != (3,):
            raise ValueError(f"hyper-connection weights {fn.shape}, {base.shape}, {scale.shape} do not fit {n} streams")
        if sinkhorn_iters < 1:
            raise ValueError(f"hc_sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
        fn.role = "linear"  # only ever multiplied: a backend may keep it packed
        self.fn, self.base, self.scale = Linear(fn), base, scale
        self.n, self.iters, self.eps, self.norm_eps = n, sinkhorn_iters, eps, norm_eps

    def collapse(self, streams, step: Step):
        """(T, N, D) streams -> (the block's input (T, D), post (T, N), comb (T, N, N))."""
        ops, n = step.ops, self.n
        t, _, d = streams.shape
        mixes = self.fn(ops.rms_norm(streams.reshape(t, n * d), None, self.norm_eps), step)
        base, scale = self.base.value, self.scale.value
        pre = ops.sigmoid(mixes[:, :n] * scale[0:1] + base[:n]) + self.eps
        post = ops.sigmoid(mixes[:, n : 2 * n] * scale[1:2] + base[n : 2 * n]) * 2.0
        comb = mixes[:, 2 * n :].reshape(t, n, n) * scale[2:3] + base[2 * n :].reshape(n, n)
        comb = ops.sinkhorn(ops.softmax(comb) + self.eps, self.iters, self.eps)
        return _collapse(streams, pre, n), post, comb

    def expand(self, y, residual, post, comb, step: Step):
        """The block's output y (T, D) back into streams: post[k] * y + sum_j comb[j, k] *
        residual[j] -> (T, N, D)."""
        t, n, d = residual.shape
        mixed = comb[:, 0, :].reshape(t, n, 1) * residual[:, 0:1, :]
        for j in range(1, n):
            mixed = mixed + comb[:, j, :].reshape(t, n, 1) * residual[:, j : j + 1, :]
        return post.reshape(t, n, 1) * y.reshape(t, 1, d) + mixed


class HyperHead:
    """The final collapse of the streams, before the final norm: with ``fn`` (N, N * D),
    ``base`` (N,) and ``scale`` (1,), DeepSeek-V4's learned weighting sum_j (sigmoid(w_j *
    scale + base_j) + eps) * streams[j] (w from the unweighted-RMS-normalised streams);
    without, the streams' mean (GLM-5 Next)."""

    def __init__(self, n_streams: int, fn: Param | None = None, base: Param | None = None, scale: Param | None = None,
                 *, eps: float = 1e-6, norm_eps: float = 1e-6):
        n = n_streams
        if (fn is None) != (base is None) or (fn is None) != (scale is None):
            raise ValueError("HyperHead takes fn, base and scale together, or none of them (the mean)")
        if fn is not None:
            if fn.shape[0] != n or base.shape != (n,) or scale.shape != (1,):
                raise ValueError(f"hyper head weights {fn.shape}, {base.shape}, {scale.shape} do not fit {n} streams")
            fn.role = "linear"
        self.n = n
        self.fn = None if fn is None else Linear(fn)
        self.base, self.scale, self.eps, self.norm_eps = base, scale, eps, norm_eps

    def __call__(self, streams, step: Step):
        ops, n = step.ops, self.n
        t, _, d = streams.shape
        if self.fn is None:
            return _mean(streams, n)
        mixes = self.fn(ops.rms_norm(streams.reshape(t, n * d), None, self.norm_eps), step)
        pre = ops.sigmoid(mixes * self.scale.value + self.base.value) + self.eps
        return _collapse(streams, pre, n)


def _mean(streams, n: int):
    """The streams' mean (T, N, D) -> (T, D): their sum in order, divided by N."""
    out = streams[:, 0, :]
    for j in range(1, n):
        out = out + streams[:, j, :]
    return out / float(n)


class StreamEmbedding(Embedding):
    """Token embeddings entering as ``n_streams`` identical streams (T, N, D)."""

    def __init__(self, weight: Param, n_streams: int, embedded_as: dict[int, int] | None = None):
        super().__init__(weight, embedded_as)
        self.n = n_streams

    def __call__(self, ids, step: Step):
        x = super().__call__(ids, step)
        t, d = x.shape
        row = x.reshape(t, 1, d)
        return step.ops.concat([row] * self.n, 1)


class HeadNorm:
    """The final norm after the ``HyperHead`` collapse: norm(head(streams))."""

    def __init__(self, head: HyperHead, norm):
        self.head, self.norm = head, norm

    def __call__(self, x, step: Step):
        return self.norm(self.head(x, step), step)


class HyperDecoderLayer(DecoderLayer):
    """A decoder layer on streams: the token mixer and the MLP each between a
    ``HyperConnection``'s collapse and expand (transformers' DeepseekV4DecoderLayer /
    Glm5NextTextDecoderLayer). Takes and returns (T, N, D)."""

    def __init__(self, attn_hc: HyperConnection, attn_norm, attn, ffn_hc: HyperConnection, mlp_norm, mlp):
        super().__init__(attn_norm, attn, mlp_norm, mlp)
        self.attn_hc, self.ffn_hc = attn_hc, ffn_hc

    def __call__(self, x, step: Step):
        clock = step.clock
        post, comb, h = self._collapse(self.attn_hc, x, step)
        if clock is not None:  # the streams' collapse and expand count as "other"
            clock.lap(OTHER)
        mixed = self.mix(h, step)
        if clock is not None:
            clock.lap(ATTENTION)
        x = self.attn_hc.expand(mixed, x, post, comb, step)
        post, comb, h = self._collapse(self.ffn_hc, x, step)
        if clock is not None:
            clock.lap(OTHER)
        if step.prefetcher is not None:  # the exact input of this layer's MLP norm
            step.prefetcher.after_attention(self, h, step)
            if clock is not None:
                clock.lap(PREFETCH)
        out = self.mlp(self.mlp_norm(h, step), step)
        if clock is not None:
            self.lap_mlp(clock)
        return self.ffn_hc.expand(out, x, post, comb, step)

    @staticmethod
    def _collapse(hc: HyperConnection, x, step: Step):
        h, post, comb = hc.collapse(x, step)
        return post, comb, h


def hyper_connection(w, prefix: str, site: str, *, hidden: int, n_streams: int, sinkhorn_iters: int, eps: float,
                     norm_eps: float) -> HyperConnection:
    """The mHC site ``site`` ("attn" or "ffn") of the layer at ``prefix``, under either
    spelling: transformers' ``{prefix}.{site}_hc.{fn,base,scale}`` or the original
    checkpoints' ``{prefix}.hc_{site}_{fn,base,scale}``."""
    n = n_streams
    m = n * (n + 2)
    names = [f"{prefix}.{site}_hc.{part}" for part in ("fn", "base", "scale")]
    if not w.has(names[0]) and w.has(f"{prefix}.hc_{site}_fn"):
        names = [f"{prefix}.hc_{site}_{part}" for part in ("fn", "base", "scale")]
    fn, base, scale = w.param(names[0], (m, n * hidden)), w.param(names[1], (m,)), w.param(names[2], (3,))
    return HyperConnection(fn, base, scale, n_streams=n, sinkhorn_iters=sinkhorn_iters, eps=eps, norm_eps=norm_eps)


def hyper_head(w, model_prefix: str, *, hidden: int, n_streams: int, eps: float, norm_eps: float,
               weighted: bool) -> HyperHead:
    """The final collapse: ``weighted`` (DeepSeek-V4) reads ``{model}hc_head.hc_{fn,base,scale}``
    (or the original ``hc_head_{fn,base,scale}``); otherwise the mean, no weights."""
    n = n_streams
    if not weighted:
        return HyperHead(n)
    names = [f"{model_prefix}hc_head.hc_{part}" for part in ("fn", "base", "scale")]
    if not w.has(names[0]) and w.has(f"{model_prefix}hc_head_fn"):
        names = [f"{model_prefix}hc_head_{part}" for part in ("fn", "base", "scale")]
    return HyperHead(n, w.param(names[0], (n, n * hidden)), w.param(names[1], (n,)), w.param(names[2], (1,)),
                     eps=eps, norm_eps=norm_eps)
