"""Per-sequence state: one entry per layer plus the number of positions seen.

Attention layers keep a ``KVCache``, which grows with every position; recurrent layers
(linear attention, state-space models) keep a ``RecurrentState``, whose size is fixed.
Any layer may bring its own state object: ``Cache`` only asks each for ``nbytes`` and
``bytes_per_token()``."""

from __future__ import annotations

from colibri_core.engine.backend import ITEMSIZE


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
        dtype = self.backend.cache_dtype
        k, v = self.backend.zeros((h, new_cap, dk), dtype), self.backend.zeros((h, new_cap, dv), dtype)
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
        return 0 if self._k is None else self.backend.nbytes(self._k) + self.backend.nbytes(self._v)

    def bytes_per_token(self) -> int:
        h, dk, dv = self.shape
        return h * (dk + dv) * ITEMSIZE[self.backend.cache_dtype]


class RecurrentState:
    """The fixed-size state of one recurrent layer: named arrays (e.g. a convolution's
    last inputs and a recurrent matrix per head), zeros at the start of a sequence and
    replaced as positions are absorbed. Its size never depends on the sequence length."""

    def __init__(self, backend, shapes: dict[str, tuple[int, ...]]):
        self.backend = backend
        # float32 whatever the cache dtype: the recurrence accumulates over the whole sequence
        self.arrays = {name: backend.zeros(tuple(shape), "float32") for name, shape in shapes.items()}
        self.length = 0  # positions absorbed

    def __getitem__(self, name: str):
        return self.arrays[name]

    def update(self, positions: int, **arrays) -> None:
        """Replace the named arrays (same shapes) after absorbing ``positions`` more."""
        for name, value in arrays.items():
            if tuple(value.shape) != tuple(self.arrays[name].shape):
                raise ValueError(f"recurrent state {name!r}: shape {tuple(value.shape)} != {tuple(self.arrays[name].shape)}")
            self.arrays[name] = value
        self.length += positions

    @property
    def nbytes(self) -> int:
        return sum(self.backend.nbytes(a) for a in self.arrays.values())

    def bytes_per_token(self) -> int:
        return 0


class Cache:
    """The state of one sequence across all layers (KV caches, recurrent states, ...)."""

    def __init__(self, layers: list):
        self.layers = layers
        self.length = 0

    @property
    def nbytes(self) -> int:
        return sum(getattr(layer, "nbytes", 0) for layer in self.layers if layer is not None)

    def bytes_per_token(self) -> int:
        return sum(layer.bytes_per_token() for layer in self.layers if layer is not None)
