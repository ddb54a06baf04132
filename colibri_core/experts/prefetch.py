"""Router look-ahead prefetch.

While layer L computes, predict the experts of the next MoE layer by applying that
layer's own norm and router to the hidden state leaving layer L's attention, and start
reading the predicted experts on the store's I/O pool. The prediction changes only what
is read early; the routing itself is computed as always when the layer runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class _Next:
    norm: object
    router: object
    moe_index: int
    slots: int
    behind: int | None  # the MoE index of the predicting layer itself, if it is one


class Prefetcher:
    def __init__(self, lm, store, slots: int):
        """``slots``: at most this many experts are read ahead per layer."""
        self.store = store
        self._next: dict[int, _Next] = {}
        moe_layers = [(i, layer) for i, layer in enumerate(lm.layers) if getattr(layer, "mlp", None) is not None
                      and hasattr(layer.mlp, "router") and hasattr(layer.mlp, "experts")]
        for (i, _), (j, nxt) in zip(moe_layers, moe_layers[1:]):
            here = lm.layers[i].mlp.experts.decl.moe_index
            for k in range(i, j):  # every layer from this MoE layer up to the next one predicts it
                # a MoE layer's own misses are read before what it predicts (ExpertStore.prefetch)
                self._next[id(lm.layers[k])] = _Next(nxt.mlp_norm, nxt.mlp.router, nxt.mlp.experts.decl.moe_index,
                                                     slots, here if k == i else None)
        # a first MoE layer routed by token id (DeepSeek-V4's hash layers) is known exactly
        # from the ids, before any layer runs; later ones are predicted exactly as above
        self._first = None
        if moe_layers and hasattr(moe_layers[0][1].mlp.router, "experts_for"):
            first = moe_layers[0][1].mlp
            self._first = (first.router, first.experts.decl.moe_index)

    def after_embedding(self, step) -> None:
        """Start reading the first MoE layer's experts when the token ids alone decide them."""
        if self._first is None or step.ids is None:
            return
        router, moe_index = self._first
        self.store.prefetch(moe_index, [int(e) for e in np.unique(router.experts_for(step.ids, step.ops))])

    def after_attention(self, layer, h, step) -> None:
        nxt = self._next.get(id(layer))
        if nxt is None:
            return
        indices, _ = nxt.router(nxt.norm(h, step), step)
        votes = np.bincount(indices.ravel())
        order = np.lexsort((np.arange(votes.size), -votes))  # most voted first, then lower ids
        chosen = [int(e) for e in order[: nxt.slots] if votes[e] > 0]
        self.store.prefetch(nxt.moe_index, chosen, behind=nxt.behind)
