"""Per-sequence state: one entry per layer plus the number of positions seen.

Attention layers keep a ``KVCache``, which grows with every position; recurrent layers
(linear attention, state-space models) keep a ``RecurrentState``, whose size is fixed.
Any layer may bring its own state object: ``Cache`` only asks each for ``nbytes`` and
``bytes_per_token()`` (and, for a state bounded otherwise, ``bytes_for(tokens)``,
as a sliding window's ``SlidingKVCache``)."""

from __future__ import annotations

from colibri_core.compute.backend import ITEMSIZE


# -- saved states (colibri_core.engine.state) ---------------------------------------------
# Every state kind says what it holds with ``export_state() -> (meta, arrays)`` (meta: a few
# JSON integers, arrays: the backend arrays of the positions in use, by name) and takes it
# back into a fresh state of the same layer with ``import_state(meta, arrays)`` (host numpy
# arrays), which checks everything against the layer first and raises ValueError saying
# what does not fit. ``state_kind`` names the kind in the file.


def saved_length(meta, limit: int) -> int:
    """The ``length`` of a saved state's meta: the only key, an integer in [0, limit]."""
    if not isinstance(meta, dict) or set(meta) != {"length"}:
        raise ValueError(f"its meta must be {{'length': N}}, got {meta!r}")
    n = meta["length"]
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= limit:
        raise ValueError(f"length {n!r} is not an integer from 0 to {limit}")
    return n


def check_saved_arrays(arrays: dict, expected: dict) -> None:
    """The saved arrays are exactly ``expected`` (name -> shape): no other, none missing,
    each of its shape and a float dtype."""
    missing, extra = sorted(set(expected) - set(arrays)), sorted(set(arrays) - set(expected))
    if missing or extra:
        raise ValueError(f"arrays {sorted(arrays)} where this model's layer holds {sorted(expected)}")
    for name, shape in expected.items():
        a = arrays[name]
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"array {name!r} has shape {list(a.shape)} where this model's layer holds {list(shape)}")
        if a.dtype.kind != "f":
            raise ValueError(f"array {name!r} is {a.dtype}, not a float dtype")


def to_backend(backend, host, dtype: str):
    """A saved host array on ``backend`` as ``dtype`` (float32 goes bit for bit), from a
    copy: a backend may keep the host array it is given, and the saved one may be used again."""
    import numpy as np

    if host.size == 0:  # an empty stream (NoPE MLA's rotary keys): not every backend uploads nothing
        return backend.zeros(tuple(host.shape), dtype)
    return backend.asarray(np.array(host, dtype=np.float32, order="C"), dtype)


def check_saved_dtype(arrays: dict, dtype: str) -> None:
    """Keys and values saved from a cache of another dtype (``--kv-cache``) would continue
    differently: refused."""
    for name, a in arrays.items():
        if a.dtype.name != dtype and {a.dtype.name, dtype} <= {"float32", "float16"}:
            raise ValueError(f"array {name!r} was saved from a {a.dtype.name} KV cache, and this one is {dtype} "
                             f"(--kv-cache {a.dtype.name} resumes it)")


class _KVArrays:
    """What both attention caches hold: keys and values in two backend arrays ``_k`` and
    ``_v``, stored (heads, positions, dim) in the backend's ``kv_cache_dtype``."""

    def __init__(self, backend, n_kv_heads: int, k_dim: int, v_dim: int):
        self.backend = backend
        self.shape = (n_kv_heads, k_dim, v_dim)
        self._k = self._v = None

    def _zeros(self, positions: int):
        """New key and value arrays of ``positions`` positions, zeros."""
        h, dk, dv = self.shape
        dtype = self.backend.kv_cache_dtype
        return self.backend.zeros((h, positions, dk), dtype), self.backend.zeros((h, positions, dv), dtype)

    @property
    def nbytes(self) -> int:
        return 0 if self._k is None else self.backend.nbytes(self._k) + self.backend.nbytes(self._v)

    def bytes_per_token(self) -> int:
        """The bytes of one position (for a sliding window, an upper bound: while the
        sequence is shorter than the window)."""
        h, dk, dv = self.shape
        return h * (dk + dv) * ITEMSIZE[self.backend.kv_cache_dtype]


class KVCache(_KVArrays):
    """Keys and values of one attention layer, stored (heads, positions, dim) and grown
    by doubling up to the context length, so appending a token copies nothing."""

    def __init__(self, backend, n_kv_heads: int, k_dim: int, v_dim: int, max_len: int):
        super().__init__(backend, n_kv_heads, k_dim, v_dim)
        self.max_len = max_len
        self.length = 0

    def _grow(self, needed: int) -> None:
        capacity = 0 if self._k is None else self._k.shape[1]
        if needed <= capacity:
            return
        new_cap = min(max(needed, 2 * capacity, 64), max(self.max_len, needed))
        k, v = self._zeros(new_cap)
        if self._k is not None and self.length:
            k[:, : self.length] = self._k[:, : self.length]
            v[:, : self.length] = self._v[:, : self.length]
        self._k, self._v = k, v

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` positions (at most the context) at once: growing by doubling
        later copies the whole cache, mid-decode (512 -> 1024 positions: ~0.5 s over the
        full OLMoE shape's 16 layers)."""
        self._grow(min(tokens, self.max_len))

    def append(self, k, v):
        """Add (T, heads, dim) keys and values; return all keys and values so far."""
        t = k.shape[0]
        end = self.length + t
        self._grow(end)
        self._k[:, self.length : end] = k.transpose(1, 0, 2)
        self._v[:, self.length : end] = v.transpose(1, 0, 2)
        self.length = end
        return self._k[:, :end], self._v[:, :end]

    def copy_prefix(self, dst: "KVCache", n: int, snapshot=None) -> None:
        """Give ``dst`` (empty) this cache's first ``n`` positions (prefix reuse)."""
        if n:
            dst.append(self._k[:, :n].transpose(1, 0, 2), self._v[:, :n].transpose(1, 0, 2))

    def snapshot(self):
        """Nothing: the rows of earlier positions never change, so any prefix can be copied."""
        return None

    def rewind(self, n: int) -> None:
        """Forget the positions from ``n`` on (drafted tokens a verification rejected):
        their rows stay where they are and the next append overwrites them."""
        self.length = min(self.length, n)

    state_kind = "kv"

    def export_state(self) -> tuple[dict, dict]:
        """The positions in use: keys and values (heads, length, dim)."""
        n = self.length
        return {"length": n}, ({"k": self._k[:, :n], "v": self._v[:, :n]} if n else {})

    def import_state(self, meta: dict, arrays: dict) -> None:
        n = saved_length(meta, self.max_len)
        h, dk, dv = self.shape
        check_saved_arrays(arrays, {"k": (h, n, dk), "v": (h, n, dv)} if n else {})
        dtype = self.backend.kv_cache_dtype
        check_saved_dtype(arrays, dtype)
        if n:
            self._grow(n)
            self._k[:, :n] = to_backend(self.backend, arrays["k"], dtype)
            self._v[:, :n] = to_backend(self.backend, arrays["v"], dtype)
        self.length = n


class SlidingKVCache(_KVArrays):
    """Keys and values of a sliding-window attention layer: only the last ``window - 1``
    positions are kept between steps (each new position sees itself and those), so its
    size is bounded by the window, not the sequence. ``append`` returns the kept
    positions followed by the new ones; ``offset`` is how many of them precede the new
    ones (the ``start`` of the attention op). Earlier positions are gone, so a prefix is
    resumed from a ``snapshot`` taken at its length (the kept positions, at most the
    window's), as a recurrent state is."""

    snapshot_needed = True  # positions before the window are dropped as the sequence grows

    def __init__(self, backend, n_kv_heads: int, k_dim: int, v_dim: int, window: int):
        if window < 1:
            raise ValueError(f"sliding window must be >= 1, got {window}")
        super().__init__(backend, n_kv_heads, k_dim, v_dim)
        self.window = int(window)
        self.length = 0  # positions seen
        self.kept = 0  # positions held at the front of the buffers
        self.offset = 0

    def append(self, k, v):
        """Add (T, heads, dim) keys and values; return (heads, kept + T, dim) keys and values."""
        keep = min(self.kept, self.window - 1)
        if keep < self.kept:  # drop what the previous step's queries needed and no later one will
            a = self.kept - keep
            self._k[:, :keep] = self._k[:, a : self.kept] * 1.0  # * 1.0: a copy, the ranges may overlap
            self._v[:, :keep] = self._v[:, a : self.kept] * 1.0
        t = k.shape[0]
        end = keep + t
        capacity = 0 if self._k is None else self._k.shape[1]
        if end > capacity:
            new_k, new_v = self._zeros(end)
            if keep:
                new_k[:, :keep], new_v[:, :keep] = self._k[:, :keep], self._v[:, :keep]
            self._k, self._v = new_k, new_v
        self._k[:, keep:end] = k.transpose(1, 0, 2)
        self._v[:, keep:end] = v.transpose(1, 0, 2)
        self.offset, self.kept = keep, end
        self.length += t
        return self._k[:, :end], self._v[:, :end]

    def snapshot(self) -> dict:
        """Copies of what the next step reads (the last ``window - 1`` kept positions) and
        the length: what ``copy_prefix`` needs to resume this cache here later."""
        keep = min(self.kept, self.window - 1)
        if not keep:
            return {"k": None, "v": None, "length": self.length}
        a = self.kept - keep
        return {"k": self._k[:, a : self.kept] * 1.0, "v": self._v[:, a : self.kept] * 1.0, "length": self.length}

    def copy_prefix(self, dst: "SlidingKVCache", n: int, snapshot=None) -> None:
        """Give ``dst`` (fresh) this cache as it was after ``n`` positions: from
        ``snapshot`` taken then (or from this cache when it holds exactly n). The next
        append then sees the same keys and values, in the same order, as it would have."""
        if n == 0:
            return
        if snapshot is None:
            if self.length != n:
                raise ValueError(f"sliding KV cache holds {self.length} positions, not {n}, and no snapshot was kept")
            snapshot = self.snapshot()
        if snapshot["length"] != n:
            raise ValueError(f"the sliding KV snapshot was taken at {snapshot['length']} positions, not {n}")
        if snapshot["k"] is None:
            dst.kept = 0
        else:
            dst._k, dst._v = snapshot["k"] * 1.0, snapshot["v"] * 1.0
            dst.kept = int(dst._k.shape[1])
        dst.offset, dst.length = 0, n

    def snapshot_bytes(self) -> int:
        """What one ``snapshot`` holds at most: the window's positions."""
        return (self.window - 1) * self.bytes_per_token()

    state_kind = "sliding_kv"

    def export_state(self) -> tuple[dict, dict]:
        """What the next step reads: the last min(length, window - 1) keys and values."""
        snap = self.snapshot()
        return {"length": self.length}, ({} if snap["k"] is None else {"k": snap["k"], "v": snap["v"]})

    def import_state(self, meta: dict, arrays: dict) -> None:
        n = saved_length(meta, 1 << 62)
        keep = min(n, self.window - 1)
        h, dk, dv = self.shape
        check_saved_arrays(arrays, {"k": (h, keep, dk), "v": (h, keep, dv)} if keep else {})
        dtype = self.backend.kv_cache_dtype
        check_saved_dtype(arrays, dtype)
        if keep:
            self._k = to_backend(self.backend, arrays["k"], dtype)
            self._v = to_backend(self.backend, arrays["v"], dtype)
        self.kept, self.offset, self.length = keep, 0, n

    def bytes_for(self, tokens: int) -> int:
        """What the layer holds while decoding after ``tokens`` positions: at most the window."""
        return min(tokens, self.window) * self.bytes_per_token()


def attention_cache(backend, n_kv_heads: int, k_dim: int, v_dim: int, max_len: int, window: int | None = None):
    """An attention layer's KV cache: a ``SlidingKVCache`` when its ``window`` is shorter
    than the context, else a ``KVCache`` for the whole context."""
    if window is not None and window < max_len:
        return SlidingKVCache(backend, n_kv_heads, k_dim, v_dim, window)
    return KVCache(backend, n_kv_heads, k_dim, v_dim, max_len)


class RecurrentState:
    """The fixed-size state of one recurrent layer: named arrays (e.g. a convolution's
    last inputs and a recurrent matrix per head), zeros at the start of a sequence and
    replaced as positions are absorbed. Its size never depends on the sequence length."""

    def __init__(self, backend, shapes: dict[str, tuple[int, ...]]):
        self.backend = backend
        # float32 whatever the cache dtype: the recurrence accumulates over the whole sequence
        self.arrays = {name: backend.zeros(tuple(shape), "float32") for name, shape in shapes.items()}
        self.length = 0  # positions absorbed
        self._kept: dict[int, dict] | None = None  # length -> arrays, while ``keep_states`` asks

    def __getitem__(self, name: str):
        return self.arrays[name]

    def update(self, positions: int, **arrays) -> None:
        """Replace the named arrays (same shapes) after absorbing ``positions`` more."""
        for name, value in arrays.items():
            if tuple(value.shape) != tuple(self.arrays[name].shape):
                raise ValueError(f"recurrent state {name!r}: shape {tuple(value.shape)} != {tuple(self.arrays[name].shape)}")
        # a new dict: a state kept by ``keep_states`` holds the old one
        self.arrays = {**self.arrays, **arrays}
        self.length += positions
        if self._kept is not None:
            self._kept[self.length] = self.arrays

    def keep_states(self) -> None:
        """Remember the state after every position from now on, until ``rewind``: what a
        speculative verification needs to go back to the last accepted token. Updates
        replace the arrays, so remembering costs references, not copies."""
        self._kept = {self.length: self.arrays}

    def rewind(self, n: int) -> None:
        """Go back to the state after ``n`` positions, remembered since ``keep_states``;
        stop remembering."""
        kept, self._kept = self._kept, None
        if n == self.length:
            return
        if kept is None or n not in kept:
            raise ValueError(f"recurrent state: no state kept at {n} positions (it holds {self.length})")
        self.arrays, self.length = kept[n], n

    @property
    def nbytes(self) -> int:
        return sum(self.backend.nbytes(a) for a in self.arrays.values())

    def bytes_per_token(self) -> int:
        return 0

    snapshot_needed = True  # each update replaces the arrays

    def snapshot_bytes(self) -> int:
        return self.nbytes

    def snapshot(self) -> dict:
        """Copies of the arrays as they are now (after ``length`` positions): the only way
        to resume this state at an earlier position later, since each update replaces it."""
        return {name: a * 1.0 for name, a in self.arrays.items()}  # * 1.0: an exact copy (-0.0 kept)

    def copy_prefix(self, dst: "RecurrentState", n: int, snapshot=None) -> None:
        """Give ``dst`` (fresh) the state after ``n`` positions: ``snapshot`` taken at n
        (or this state itself when it has absorbed exactly n)."""
        if n == 0:
            return
        if snapshot is None:
            if self.length != n:
                raise ValueError(f"recurrent state holds {self.length} positions, not {n}, and no snapshot was kept")
            snapshot = self.arrays
        dst.arrays = {name: a * 1.0 for name, a in snapshot.items()}
        dst.length = n

    state_kind = "recurrent"

    def export_state(self) -> tuple[dict, dict]:
        return {"length": self.length}, dict(self.arrays)

    def import_state(self, meta: dict, arrays: dict) -> None:
        n = saved_length(meta, 1 << 62)
        check_saved_arrays(arrays, {name: tuple(a.shape) for name, a in self.arrays.items()})
        self.arrays = {name: to_backend(self.backend, arrays[name], "float32") for name in self.arrays}
        self.length, self._kept = n, None


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

    def bytes_for(self, tokens: int) -> int:
        """What the state of a sequence of ``tokens`` positions takes: per layer its
        ``bytes_for`` when it has one (a sliding window's bounded cache), else
        ``bytes_per_token() * tokens`` plus its fixed size."""
        total = 0
        for layer in self.layers:
            if layer is None:
                continue
            if hasattr(layer, "bytes_for"):
                total += layer.bytes_for(tokens)
            elif layer.bytes_per_token():
                total += layer.bytes_per_token() * tokens
            else:  # a fixed-size state (recurrent)
                total += getattr(layer, "nbytes", 0)
        return total

    def reserve(self, tokens: int) -> None:
        """Make room for ``tokens`` positions in the states that grow with the sequence
        (those with a ``reserve``), so that none grows, and copies itself, mid-decode."""
        for layer in self.layers:
            reserve = getattr(layer, "reserve", None)
            if reserve is not None:
                reserve(tokens)

    def reusable(self) -> bool:
        """Whether every layer's state can give a prefix to another cache (prefix reuse)."""
        return all(layer is None or _reusable(layer) for layer in self.layers)

    def snapshot_bytes(self) -> int:
        """What one ``snapshot`` holds at most: the states whose earlier positions are not
        kept in place (recurrent states, sliding windows); 0 when none are."""
        return sum(_snapshot_bytes(layer) for layer in self.layers if layer is not None)

    def snapshot(self) -> list:
        """Per layer, what ``copy_prefix`` needs to resume at the current length later
        (None for layers whose earlier positions stay in place)."""
        return [None if layer is None else layer.snapshot() for layer in self.layers]

    def copy_prefix(self, dst: "Cache", n: int, snapshot: list | None = None) -> None:
        """Fill ``dst`` (a fresh cache) with this cache's first ``n`` positions;
        ``snapshot``: from ``snapshot()`` taken when this cache held exactly n."""
        for i, (src, into) in enumerate(zip(self.layers, dst.layers)):
            if src is not None:
                src.copy_prefix(into, n, None if snapshot is None else snapshot[i])
        dst.length = n

    # -- going back (speculative decoding) --------------------------------------------
    def rewindable(self) -> bool:
        """Whether every layer's state can go back to an earlier length by itself
        (``rewind``): KV caches and MLA latents forget rows, recurrent states keep each
        position's state while asked. Others (a sliding window, DeepSeek-V4's compressed
        caches) go back through a snapshot and a replay of the tokens kept."""
        return all(layer is None or _rewindable(layer) for layer in self.layers)

    def restorable(self) -> bool:
        """Whether every layer's state can go back through a ``snapshot`` (``restore``)."""
        return all(layer is None or _restorable(layer) for layer in self.layers)

    def keep_states(self) -> None:
        """Before a verification: states that replace themselves remember each position's."""
        for layer in self.layers:
            if layer is not None:
                _keep_states(layer)

    def rewind(self, n: int) -> None:
        """Back to the first ``n`` positions (at least the length before ``keep_states``)."""
        for layer in self.layers:
            if layer is not None:
                layer.rewind(n)
        self.length = n

    def restore(self, n: int, snapshot: list) -> None:
        """Back to ``n`` positions through ``snapshot`` (taken at n) where a layer keeps
        nothing in place, by forgetting rows where it does."""
        for layer, snap in zip(self.layers, snapshot):
            if layer is not None:
                _restore(layer, n, snap)
        self.length = n


def _snapshot_bytes(state) -> int:
    """A layer's part of ``Cache.snapshot_bytes`` (a composite adds its parts')."""
    if hasattr(state, "snapshot_bytes"):
        return state.snapshot_bytes()
    return 0


def _rewindable(state) -> bool:
    if hasattr(state, "rewindable"):
        return state.rewindable()
    return hasattr(state, "rewind")


def _restore(state, n: int, snapshot) -> None:
    if isinstance(state, LayerStates):
        for name, part in state.parts.items():
            _restore(part, n, snapshot[name])
    elif snapshot is None and hasattr(state, "rewind"):
        state.rewind(n)
    elif hasattr(state, "restore"):
        state.restore(n, snapshot)
    else:
        state.copy_prefix(state, n, snapshot)


def _restorable(state) -> bool:
    if isinstance(state, LayerStates):
        return all(_restorable(part) for part in state.parts.values())
    return hasattr(state, "snapshot") and (hasattr(state, "restore") or hasattr(state, "copy_prefix"))


def _keep_states(state) -> None:
    keep = getattr(state, "keep_states", None)
    if keep is not None:
        keep()


def _reusable(state) -> bool:
    """Whether a layer's state can give a prefix to another (``copy_prefix`` and ``snapshot``;
    a composite asks its parts)."""
    if hasattr(state, "reusable"):
        return state.reusable()
    return hasattr(state, "copy_prefix") and hasattr(state, "snapshot")


class LayerStates:
    """The state of a layer whose blocks each keep their own (Inkling: the KV cache of its
    attention beside the states of four short convolutions), by name: a block reads
    ``step.cache.layers[i][name]``. Sizes, snapshots and prefix copies are its parts'."""

    def __init__(self, parts: dict):
        self.parts = dict(parts)

    def __getitem__(self, name: str):
        return self.parts[name]

    @property
    def nbytes(self) -> int:
        return sum(getattr(part, "nbytes", 0) for part in self.parts.values())

    def bytes_per_token(self) -> int:
        return sum(part.bytes_per_token() for part in self.parts.values())

    def bytes_for(self, tokens: int) -> int:
        """As ``Cache.bytes_for``, part by part."""
        return Cache([*self.parts.values()]).bytes_for(tokens)

    def reusable(self) -> bool:
        return all(_reusable(part) for part in self.parts.values())

    def snapshot_bytes(self) -> int:
        return sum(_snapshot_bytes(part) for part in self.parts.values())

    def snapshot(self) -> dict:
        return {name: part.snapshot() for name, part in self.parts.items()}

    def copy_prefix(self, dst: "LayerStates", n: int, snapshot: dict | None = None) -> None:
        for name, part in self.parts.items():
            part.copy_prefix(dst.parts[name], n, None if snapshot is None else snapshot[name])

    def rewindable(self) -> bool:
        return all(_rewindable(part) for part in self.parts.values())

    def keep_states(self) -> None:
        for part in self.parts.values():
            _keep_states(part)

    def rewind(self, n: int) -> None:
        for part in self.parts.values():
            part.rewind(n)
