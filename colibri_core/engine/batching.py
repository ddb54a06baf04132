"""Batch-invariant operations for the batched engine's decode steps.

A batched decode step multiplies the rows of several sequences by the same weights at
once. That is only allowed if each row comes out exactly as it would alone: a request's
tokens must never depend on what else is in the batch. Measured on the CPU backend:
BLAS (OpenBLAS sgemm) gives other bits for a row of an M=8 product than for M=1 (about
1e-5 relative: another blocking, another summation order), while the compiled kernels
compute every row on its own up to their row limits (64 rows for int8 / int4 / MXFP4 /
bf16, 8 for fp8 and for the compiled router). ``RowInvariantOps`` wraps a backend and
feeds the row-mixing operations (``linear``, ``linears``, the routers and their
logits, the routed experts) at most ``Backend.batch_invariant_rows`` rows at a time, row by row where the
backend promises nothing (float32 weights through BLAS): the cost of the promise is one
weight pass per row there, and nothing where the kernels run.
"""

from __future__ import annotations

import numpy as np


def _chunks(n: int, size: int):
    size = max(1, size)
    return [(a, min(n, a + size)) for a in range(0, n, size)]


class RowInvariantOps:
    """The backend, with the row-mixing operations cut into batch-invariant pieces.
    Everything else is the backend's own (attribute access falls through)."""

    def __init__(self, backend):
        self.backend = backend

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def _concat(self, parts):
        return parts[0] if len(parts) == 1 else self.backend.concat(parts, 0)

    def linear(self, x, weight, bias=None):
        be = self.backend
        rows = be.batch_invariant_rows("linear", [weight])
        if x.shape[0] <= rows:  # one piece (the kernels' case): no slicing, no copy
            return be.linear(x, weight, bias)
        return self._concat([be.linear(x[a:b], weight, bias) for a, b in _chunks(x.shape[0], rows)])

    def linears(self, x, weights, biases=None):
        be = self.backend
        pieces = _chunks(x.shape[0], be.batch_invariant_rows("linear", list(weights)))
        if len(pieces) == 1:
            return be.linears(x, weights, biases)
        parts = [be.linears(x[a:b], weights, biases) for a, b in pieces]
        return [self._concat([p[i] for p in parts]) for i in range(len(weights))]

    def softmax_top_k(self, x, weight, k, renormalise, bias=None):
        be = self.backend
        rows = be.batch_invariant_rows("router", [weight])
        if x.shape[0] <= rows:
            return be.softmax_top_k(x, weight, k, renormalise, bias)
        parts = [be.softmax_top_k(x[a:b], weight, k, renormalise, bias) for a, b in _chunks(x.shape[0], rows)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def router_logits(self, x, weight, bias=None):
        be = self.backend
        rows = be.batch_invariant_rows("router", [weight])
        if x.shape[0] <= rows:
            return be.router_logits(x, weight, bias)
        return np.concatenate([be.router_logits(x[a:b], weight, bias) for a, b in _chunks(x.shape[0], rows)])

    def sigmoid_grouped_top_k(self, x, weight, bias, k, n_group, topk_group, renormalise, scaling):
        be = self.backend
        rows = be.batch_invariant_rows("router", [weight])
        if x.shape[0] <= rows:
            return be.sigmoid_grouped_top_k(x, weight, bias, k, n_group, topk_group, renormalise, scaling)
        parts = [be.sigmoid_grouped_top_k(x[a:b], weight, bias, k, n_group, topk_group, renormalise, scaling)
                 for a, b in _chunks(x.shape[0], rows)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def scored_top_k(self, x, weight, bias, k, scoring, scaling, chosen=None):
        be = self.backend
        rows = be.batch_invariant_rows("router", [weight])
        if x.shape[0] <= rows:
            return be.scored_top_k(x, weight, bias, k, scoring, scaling, chosen)
        parts = [be.scored_top_k(x[a:b], weight, bias, k, scoring, scaling, None if chosen is None else chosen[a:b])
                 for a, b in _chunks(x.shape[0], rows)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def grouped_linear(self, x, weight, groups):
        be = self.backend
        pieces = _chunks(x.shape[0], be.batch_invariant_rows("linear", [weight]))
        return self._concat([be.grouped_linear(x[a:b], weight, groups) for a, b in pieces])

    def routed_experts(self, x, indices, weights, fetch, window=8, ready=None):
        be = self.backend
        t = indices.shape[0]
        if t == 1:
            return be.routed_experts(x, indices, weights, fetch, window, ready)
        # every expert of the step fetched once (batch-union), then computed in pieces the
        # backend computes row-independently
        fetched = {e: fetch(e) for e in sorted(set(indices.ravel().tolist()))}
        rows = be.batch_invariant_rows("experts", list(fetched.values()))
        # all at hand: no reads to overlap, so no window (each row's sum keeps its order)
        window = max(window, len(fetched))
        if t <= rows:
            return be.routed_experts(x, indices, weights, fetched.__getitem__, window, None)
        return self._concat([be.routed_experts(x[a:b], indices[a:b], weights[a:b], fetched.__getitem__, window, None)
                             for a, b in _chunks(t, rows)])

    def routed_glu_experts(self, x, indices, weights, fetch, act, window=8, ready=None):
        be = self.backend
        t = indices.shape[0]
        if t == 1:
            return be.routed_glu_experts(x, indices, weights, fetch, act, window, ready)
        fetched = {e: fetch(e) for e in sorted(set(indices.ravel().tolist()))}
        # every product of these experts (their matrices are multiplied by ``linear``; the
        # ``*_bias`` roles are added; prepared weights may be opaque, so roles, not shapes, tell)
        rows = be.batch_invariant_rows("linear", [a for w in fetched.values() for role, a in w.arrays.items()
                                                 if not role.endswith("_bias")])
        return self._concat([be.routed_glu_experts(x[a:b], indices[a:b], weights[a:b], fetched.__getitem__, act,
                                                   window, None)
                             for a, b in _chunks(t, rows)])
