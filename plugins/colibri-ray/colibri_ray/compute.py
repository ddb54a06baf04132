"""Each expert's output, computed exactly as the backend's ``routed_experts`` /
``routed_glu_experts`` computes it, on a worker or (for a failed worker) on the
coordinator: one function for both, so the fallback gives the same bits.

A request names its experts (ascending), for each the rows of ``x`` routed to it, and
whether the step is a batched decode step (``RowInvariantOps``). The local path computes
an expert's rows in one product, or, in a batched decode step, at most
``batch_invariant_rows`` rows at a time (each row as it would be alone); this does the
same per expert. Outputs are unweighted: the coordinator weights and sums them in
ascending expert order with ``ops.add_rows`` (``colibri_core.experts.tiers.routed_output``),
as the local path does."""

from __future__ import annotations

import numpy as np


def _one(backend, decl, x, w):
    if decl.glu:
        return backend.glu_expert(x, w, decl.activation)
    return backend.swiglu_expert(x, w["gate"], w["up"], w["down"])


def _piece_rows(backend, decl, w) -> int:
    """Rows the backend computes row-independently for this expert (``RowInvariantOps``'
    pieces, for this expert alone: any piece at most that size gives the same rows)."""
    if decl.glu:
        return backend.batch_invariant_rows("linear", [a for a in w.arrays.values() if len(a.shape) == 2])
    return backend.batch_invariant_rows("experts", [w])


def expert_outputs(backend, decl, fetch, x: np.ndarray, experts: np.ndarray, offsets: np.ndarray, rows: np.ndarray,
                   invariant: bool) -> np.ndarray:
    """(offsets[-1], hidden) float32: expert ``experts[i]``'s output for rows
    ``rows[offsets[i]:offsets[i + 1]]`` of ``x`` (host float32), one expert after another."""
    xb = backend.asarray(np.ascontiguousarray(x, dtype=np.float32), backend.activation_dtype)
    out = []
    for i, e in enumerate(experts.tolist()):
        r = rows[offsets[i] : offsets[i + 1]]
        w = fetch(e)
        xe = backend.take_rows(xb, r)
        n = len(r)
        size = max(1, _piece_rows(backend, decl, w)) if invariant and n > 1 else n
        for a in range(0, n, size):
            out.append(backend.to_host(_one(backend, decl, xe if size >= n else xe[a : a + size], w)))
    if not out:
        return np.zeros((0, x.shape[-1]), dtype=np.float32)
    return np.ascontiguousarray(np.concatenate(out, axis=0), dtype=np.float32)
