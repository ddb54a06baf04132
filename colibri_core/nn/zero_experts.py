"""Zero-computation experts (LongCat-Flash): router slots beyond a MoE layer's real
experts whose output is the token itself times the routing weight. ``SparseMoE``'s
``zero_experts`` option splits a routing here, on the host, before any expert is read:
the real experts go to the expert store, the zero ones never do."""

from __future__ import annotations

import numpy as np


def split_zero_experts(indices: np.ndarray, weights: np.ndarray, real: int):
    """A routing (T, k) over ``real`` experts followed by zero-computation ones, split:

    - the real experts' slots as (T, k') indices and weights, k' the most real slots of
      any token; a token with fewer is padded with weight-0 slots of other experts the
      step uses anyway (distinct within the token, so nothing more is read and the sums
      are unchanged: 0 * y adds nothing);
    - the real experts' ids as chosen, token after token (1-D, no padding): what the
      routing statistics count;
    - each token's summed weight of its zero-computation slots (T,) float32: the
      multiple of the token itself that those slots add.
    """
    indices = np.asarray(indices)
    weights = np.asarray(weights, dtype=np.float32)
    is_real = indices < real
    counted = indices[is_real].astype(np.int64)
    identity = np.where(is_real, np.float32(0), weights).sum(axis=1, dtype=np.float32)
    per_token = is_real.sum(axis=1)
    width = int(per_token.max()) if per_token.size else 0
    t = indices.shape[0]
    padded = np.empty((t, width), dtype=np.int64)
    padded_weights = np.zeros((t, width), dtype=np.float32)
    if width == 0:
        return padded, padded_weights, counted, identity
    union = np.unique(counted)
    for row in range(t):
        mine = indices[row][is_real[row]]
        n = mine.size
        padded[row, :n] = mine
        padded_weights[row, :n] = weights[row][is_real[row]]
        if n < width:  # the union holds at least ``width`` experts, ``n`` of them this token's
            padded[row, n:] = union[~np.isin(union, mine)][: width - n]
    return padded, padded_weights, counted, identity
