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
"""

from __future__ import annotations

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
