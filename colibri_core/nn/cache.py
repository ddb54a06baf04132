"""Per-sequence state: one entry per layer (a KV cache for attention layers; other
layer kinds bring their own state objects) plus the number of positions seen."""

from __future__ import annotations


class KVCache:
    """Keys and values of one attention layer, stored (heads, positions, dim) and grown
    by doubling up to the context length, so appending a token copies nothing."""

    def __init__(self, backend, n_kv_heads: int, k_dim: int, v_dim: int, max_len: int):
        self.backend = backend
        self.shape = (n_kv_heads, k_dim, v_dim)
        self.max_len = max_len
        self.length = 0
        self._k = self._v = None

    def _grow(self, needed: int) -> None:
        capacity = 0 if self._k is None else self._k.shape[1]
        if needed <= capacity:
            return
        new_cap = min(max(needed, 2 * capacity, 64), max(self.max_len, needed))
        h, dk, dv = self.shape
        k, v = self.backend.zeros((h, new_cap, dk)), self.backend.zeros((h, new_cap, dv))
        if self._k is not None and self.length:
            k[:, : self.length] = self._k[:, : self.length]
            v[:, : self.length] = self._v[:, : self.length]
        self._k, self._v = k, v

    def append(self, k, v):
        """Add (T, heads, dim) keys and values; return all keys and values so far."""
        t = k.shape[0]
        end = self.length + t
        self._grow(end)
        self._k[:, self.length : end] = k.transpose(1, 0, 2)
        self._v[:, self.length : end] = v.transpose(1, 0, 2)
        self.length = end
        return self._k[:, :end], self._v[:, :end]

    @property
    def nbytes(self) -> int:
        return 0 if self._k is None else int(self._k.nbytes + self._v.nbytes)

    def bytes_per_token(self) -> int:
        h, dk, dv = self.shape
        return h * (dk + dv) * 4


class Cache:
    """The state of one sequence across all layers."""

    def __init__(self, layers: list):
        self.layers = layers
        self.length = 0

    @property
    def nbytes(self) -> int:
        return sum(getattr(layer, "nbytes", 0) for layer in self.layers if layer is not None)

    def bytes_per_token(self) -> int:
        return sum(layer.bytes_per_token() for layer in self.layers if layer is not None)
