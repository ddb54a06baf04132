"""DeepSeek Sparse Attention (DSA): the lightning indexer of DeepSeek-V3.2 and GLM-5.

Each attention layer gets a small indexer. Its queries come from the attention's q
LoRA activation (``wq_b``), its single key per token from the hidden state (``wk``,
then a LayerNorm with bias); the first ``rope_dim`` features of both are rotated with
the attention's rope tables. For query t and cached key s:

    score(t, s) = sum_h w[t, h] * relu(q[t, h] . k[s] / sqrt(D)),  w = weights_proj(x) / sqrt(H)

and the query attends only to the ``index_topk`` keys of highest score (among those it
can see). The indexer keys are cached with the layer's MLA latents (``MLACache``), so
they count in the KV bytes per token.

When ``index_topk`` covers every cached key the selection is all of them, which is
dense attention: the scores are then not computed (the keys are still cached).

``PooledIndexer`` (GLM-5 Next) scores pools of consecutive tokens instead of tokens, and
``SharedIndexer`` reuses the previous indexer's selection (GLM-5, GLM-5 Next).
"""

from __future__ import annotations

import numpy as np

from colibri_core.compute.host import top_k_indices
from colibri_core.nn.layers import Linear, Step, rope_tables
from colibri_core.nn.rope import RoPE
from colibri_core.nn.weights import Param

_SELECTED = ("dsa", "selected")  # step.memo key: the last full indexer's selection in this step


class LayerNorm:
    """torch.nn.LayerNorm over the last axis, with optional weight and bias."""

    def __init__(self, weight: Param | None, bias: Param | None, eps: float):
        self.weight, self.bias, self.eps = weight, bias, eps

    def __call__(self, x, step: Step):
        return step.ops.layer_norm(x, None if self.weight is None else self.weight.value,
                                   None if self.bias is None else self.bias.value, self.eps)


class LightningIndexer:
    """Chooses, per query, the ``topk`` cached positions its attention may see.

    ``rope_interleave``: rotate the rope features as interleaved pairs (GLM-5) instead of
    DeepSeek-V3.2's half-split layout.
    """

    def __init__(self, *, wq_b: Linear, wk: Linear, k_norm: LayerNorm, weights_proj: Linear, n_heads: int,
                 head_dim: int, rope_dim: int, rope: RoPE, topk: int, rope_interleave: bool = False):
        if not 0 < rope_dim <= head_dim:
            raise ValueError(f"indexer rope_dim {rope_dim} must be within head_dim {head_dim}")
        self.wq_b, self.wk, self.k_norm, self.weights_proj = wq_b, wk, k_norm, weights_proj
        self.n_heads, self.head_dim, self.rope_dim = n_heads, head_dim, rope_dim
        self.rope, self.topk, self.rope_interleave = rope, topk, rope_interleave

    @property
    def cached_dim(self) -> int:
        return self.head_dim

    def _rotate(self, x, step: Step):
        cos, sin = rope_tables(self.rope, step)
        if self.rope_interleave:
            return step.ops.rope_interleaved(x, cos, sin, self.rope_dim)
        return step.ops.rope(x, cos, sin, self.rope_dim)

    def __call__(self, x, q_resid, state, step: Step):
        """Returns the selected key positions (host int array (T, K)), or None when every
        visible key is selected."""
        if q_resid is None:
            raise ValueError("the DSA indexer needs the attention's q LoRA activation (q_lora_rank)")
        ops = step.ops
        t = x.shape[0]
        k = self.k_norm(self.wk(x, step), step)
        keys = state.append_index(self._rotate(k.reshape(t, 1, self.head_dim), step).reshape(t, self.head_dim))
        selected = None
        if self.topk < keys.shape[0]:
            q = self._rotate(self.wq_b(q_resid, step).reshape(t, self.n_heads, self.head_dim), step)
            weights = self.weights_proj(x, step) * (self.n_heads**-0.5)
            scores = ops.dsa_index_scores(q, keys, weights, self.head_dim**-0.5, step.start)
            selected = ops.top_k(scores, self.topk)
        step.memo[_SELECTED] = selected
        return selected


class SharedIndexer:
    """A layer that reuses the selection of the last layer (in this forward step) that ran
    its own indexer (GLM-5's "shared" indexer layers). It caches nothing."""

    cached_dim = 0

    def __call__(self, x, q_resid, state, step: Step):
        if _SELECTED not in step.memo:
            raise ValueError("a shared DSA layer needs an earlier layer with its own indexer")
        return step.memo[_SELECTED]


class PooledIndexer:
    """GLM-5 Next's indexer (transformers' ``Glm5NextTextIndexer``): it scores pools of
    ``pool`` consecutive tokens instead of single tokens, and each query attends to the
    tokens of its ``topk // pool`` best complete pools plus its own incomplete last pool
    (the "tail": the visible tokens after the last complete pool).

    A pool's key is a learned weighting of its tokens' indexer keys, per channel:
    sum_j softmax_j(gate[j] + ape[j]) * k[j], with gate = ``compress_gate`` (x) and
    ``ape`` (pool, D); a pool is a candidate for a query once its last token is visible.
    Scores are ``LightningIndexer``'s (no rope: GLM-5 Next's attention is NoPE). Per
    token the layer's ``MLACache`` keeps the indexer key and the gate (2 * D floats).
    When every query's complete pools fit in its budget it sees all visible keys (dense
    attention) and no score is computed."""

    def __init__(self, *, wq_b: Linear, wk: Linear, k_norm: LayerNorm, weights_proj: Linear, compress_gate: Linear,
                 compress_ape: Param, n_heads: int, head_dim: int, topk: int, pool: int):
        if pool < 1 or topk < pool or topk % pool:
            raise ValueError(f"indexer topk {topk} must be a positive multiple of the pool size {pool}")
        compress_ape.role = "plain"
        self.wq_b, self.wk, self.k_norm, self.weights_proj = wq_b, wk, k_norm, weights_proj
        self.compress_gate, self.compress_ape = compress_gate, compress_ape
        self.n_heads, self.head_dim, self.topk, self.pool = n_heads, head_dim, topk, pool

    @property
    def cached_dim(self) -> int:
        return 2 * self.head_dim  # [indexer key | pool gate] per token

    def __call__(self, x, q_resid, state, step: Step):
        if q_resid is None:
            raise ValueError("the DSA indexer needs the attention's q LoRA activation (q_lora_rank)")
        ops, t, d, size = step.ops, x.shape[0], self.head_dim, self.pool
        k = self.k_norm(self.wk(x, step), step)
        rows = state.append_index(ops.concat([k, self.compress_gate(x, step)], 1))
        pools, budget = rows.shape[0] // size, self.topk // size
        selected = None
        if pools > budget:  # some query has more complete pools than it may keep
            keys = rows[: pools * size, :d].reshape(pools, size, d)
            logits = rows[: pools * size, d:].reshape(pools, size, d) + self.compress_ape.value
            probs = ops.softmax(logits.transpose(0, 2, 1)).transpose(0, 2, 1)  # over each pool's tokens
            pooled = probs[:, 0, :] * keys[:, 0, :]
            for j in range(1, size):
                pooled = pooled + probs[:, j, :] * keys[:, j, :]
            q = self.wq_b(q_resid, step).reshape(t, self.n_heads, d)
            weights = self.weights_proj(x, step) * (self.n_heads**-0.5)
            # start = pools: no pool is masked here; which ones a query may pick is decided below
            scores = ops.to_host(ops.dsa_index_scores(q, pooled, weights, d**-0.5, pools))
            selected = ops.asarray(self._select(scores, step.start, budget), "int64")
        step.memo[_SELECTED] = selected
        return selected

    def _select(self, scores: np.ndarray, start: int, budget: int) -> np.ndarray:
        """(T, budget * pool + pool - 1) token positions: per query its best visible
        complete pools and its tail; short rows padded with -1 (selects nothing)."""
        size = self.pool
        width = budget * size + size - 1
        out = np.empty((scores.shape[0], width), dtype=np.int64)
        for i, row in enumerate(scores):
            seen = start + i + 1  # positions 0 .. start + i
            complete = seen // size
            if complete > budget:
                best = top_k_indices(row[None, :complete], budget)[0]
            else:
                best = np.arange(complete)
            tokens = np.concatenate([(best[:, None] * size + np.arange(size)).ravel(),
                                     np.arange(complete * size, seen)])
            out[i, : tokens.size] = tokens
            out[i, tokens.size :] = -1
        return out
