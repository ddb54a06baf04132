"""How a model routes labelled text: per domain, how many tokens each MoE layer's router
sent to each expert, and what random routers would have chosen on the same inputs.

Text goes through the model's ordinary batched prefill (windows from an empty cache);
the counts come from the experts each MoE layer was given (``Step.routing``), so they
are the router's own choices and nothing in the forward pass changes. To tell learned
specialisation from what any router would show on these hidden states, each router is
also shadowed by ``NULL_ROUTERS`` random linear routers (Gaussian weights, top-k of
the logits) fed the very input the real router gets: a model with random weights has
such a router, so its statistics are a draw from that same distribution
(``colibri_core.experts.atlas`` turns both into the atlas and its verdict).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from colibri_core.engine.perplexity import check_windows

NULL_ROUTERS = 32
# random router weights are kept while all layers' fit this; else drawn again per step (same seed, same weights)
NULL_WEIGHT_BYTES = 256 << 20


class _RouterTap:
    """Stands in for a MoE layer's router: hands its input to ``seen`` and returns the
    router's own result untouched (``route`` too, for routers that have it)."""

    def __init__(self, router, seen: Callable):
        self._router, self._seen = router, seen

    def __call__(self, x, step):
        self._seen(x, step)
        return self._router(x, step)

    def route(self, x, step):
        self._seen(x, step)
        return self._router.route(x, step)

    def __getattr__(self, name):
        return getattr(self._router, name)


class DomainRouting:
    """Counts for one model over several domains. ``counts[l, e, d]``: tokens of domain
    ``d`` the router of MoE layer ``l`` sent to expert ``e``; ``null[l, r, e, d]`` the
    same for random router ``r``; ``tokens[d]``: the domain's tokens. Use as a context
    manager: the routers are shadowed inside it only."""

    def __init__(self, model, domains: int, *, null_routers: int = NULL_ROUTERS, seed: int = 0):
        lm = model.lm
        self.model, self.seed, self.null_routers = model, seed, null_routers
        # the main layers' MoE blocks, in order (MTP layers are not run by a prefill)
        self._blocks = [(n, layer.mlp) for n, layer in enumerate(lm.layers)
                        if hasattr(getattr(layer, "mlp", None), "router") and hasattr(layer.mlp, "experts")]
        self.layer_of = {n: i for i, (n, _) in enumerate(self._blocks)}  # decoder layer -> MoE layer
        self.experts = max((len(model.store.layouts[b.experts.decl.moe_index]) for _, b in self._blocks), default=0)
        self.top_k = max((int(getattr(b.router, "top_k", 0)) for _, b in self._blocks), default=0)
        layers = len(self._blocks)
        self.counts = np.zeros((layers, self.experts, domains), dtype=np.int64)
        self.null = np.zeros((layers, null_routers, self.experts, domains), dtype=np.int64)
        self.tokens = np.zeros(domains, dtype=np.int64)
        self._domain: int | None = None  # the domain being added; None: other forwards are not counted
        self._weights: dict[int, np.ndarray] | None = {}
        self._originals = []

    def __enter__(self):
        for i, (_, block) in enumerate(self._blocks):
            self._originals.append(block.router)
            block.router = _RouterTap(block.router, lambda x, step, i=i: self._shadow(i, x, step))
        return self

    def __exit__(self, *exc):
        for (_, block), router in zip(self._blocks, self._originals):
            block.router = router
        self._originals = []

    def _null_weights(self, layer: int, hidden: int) -> np.ndarray:
        """(hidden, routers * experts) standard normal weights of layer ``layer``'s random routers."""
        if self._weights is not None and layer in self._weights:
            return self._weights[layer]
        shape = (hidden, self.null_routers * self.experts)
        weights = np.random.default_rng([self.seed, layer]).standard_normal(shape, dtype=np.float32)
        if self._weights is not None:
            if len(self._blocks) * weights.nbytes <= NULL_WEIGHT_BYTES:
                self._weights[layer] = weights
            else:
                self._weights = None
        return weights

    def _shadow(self, layer: int, x, step) -> None:
        """The random routers' choices for the rows the real router of ``layer`` sees."""
        k = self.top_k
        if self._domain is None or not k:
            return
        rows = np.asarray(step.ops.to_host(x), dtype=np.float32)
        logits = (rows @ self._null_weights(layer, rows.shape[1])).reshape(len(rows), self.null_routers, self.experts)
        chosen = np.argpartition(-logits, k - 1, axis=-1)[..., :k]  # (rows, routers, k)
        flat = (np.arange(self.null_routers)[None, :, None] * self.experts + chosen).ravel()
        self.null[layer, :, :, self._domain] += np.bincount(flat, minlength=self.null_routers * self.experts).reshape(
            self.null_routers, self.experts)

    def add(self, domain: int, wins: list[np.ndarray], batch: int = 8, progress: Callable[[int], None] | None = None):
        """Prefill ``wins`` (token id windows, each from an empty cache) as text of ``domain``."""
        lm, backend = self.model.lm, self.model.backend
        check_windows(lm, wins)
        for start in range(0, len(wins), batch):
            group = wins[start:start + batch]
            routing: list = []
            self._domain = domain
            try:
                lm.forward_batch([(w, lm.new_cache(backend)) for w in group], backend, routing=routing)
            finally:
                self._domain = None
            for layer, indices in routing:
                moe = self.layer_of.get(layer)
                if moe is not None:
                    self.counts[moe, :, domain] += np.bincount(np.asarray(indices).ravel(), minlength=self.experts)
            n = sum(len(w) for w in group)
            self.tokens[domain] += n
            if progress is not None:
                progress(n)
