"""The backend's array: a strided view of a device range, implementing exactly the core's
array protocol (docs/backends.md): shape, reshape, transpose, basic indexing, assignment
into a basic slice, and + - * / with arrays (broadcasting) and Python numbers. Views cost
nothing; arithmetic, slice assignment and reshapes of non-contiguous views run the
``eltwise`` shader. Anything else (fancy indexing, reductions, numpy functions) is refused.
"""

from __future__ import annotations

import numbers

import numpy as np

ITEMSIZE = {"float32": 4, "int32": 4, "int64": 8}


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def _operator(op: str):
    """The methods of the binary operator ``op`` (``__add__``, ``__radd__``, ...): x op y
    and, reflected, y op x."""

    def forward(self, other):
        return self._binary(other, op)

    def reflected(self, other):
        return self._binary(other, op, True)

    return forward, reflected


class VulkanArray:
    """``shape``/``strides``/``offset`` count elements of ``dtype`` in ``alloc``."""

    __slots__ = ("backend", "alloc", "shape", "strides", "offset", "dtype_name")
    __array_ufunc__ = None  # numpy hands mixed operations to us (and refuses its functions)

    def __init__(self, backend, alloc, shape, dtype_name="float32", strides=None, offset=0):
        self.backend, self.alloc, self.dtype_name = backend, alloc, dtype_name
        self.shape = tuple(int(n) for n in shape)
        self.strides = tuple(strides) if strides is not None else contiguous_strides(self.shape)
        self.offset = int(offset)

    # -- attributes ----------------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.dtype_name)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype_name]

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def is_dense(self) -> bool:
        """Contiguous from the start of its range (what most shaders read)."""
        return self.offset == 0 and self.is_contiguous()

    def is_contiguous(self) -> bool:
        want = contiguous_strides(self.shape)
        return all(n == 1 or s == w for n, s, w in zip(self.shape, self.strides, want))

    def __repr__(self) -> str:
        return f"VulkanArray(shape={self.shape}, dtype={self.dtype_name})"

    def __len__(self) -> int:
        return self.shape[0]

    # -- views ---------------------------------------------------------------------------
    def _view(self, shape, strides, offset) -> "VulkanArray":
        return VulkanArray(self.backend, self.alloc, shape, self.dtype_name, strides, offset)

    def reshape(self, *shape) -> "VulkanArray":
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = list(int(n) for n in shape)
        if -1 in shape:
            known = int(np.prod([n for n in shape if n != -1], dtype=np.int64))
            shape[shape.index(-1)] = self.size // known if known else 0
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ValueError(f"cannot reshape {self.shape} into {tuple(shape)}")
        base = self if self.is_contiguous() else self.backend.copy(self)
        return base._view(tuple(shape), contiguous_strides(tuple(shape)), base.offset)

    def transpose(self, *axes) -> "VulkanArray":
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        if not axes:
            axes = tuple(reversed(range(self.ndim)))
        axes = tuple(a % self.ndim for a in axes)
        if sorted(axes) != list(range(self.ndim)):
            raise ValueError(f"axes {axes} do not permute {self.ndim} dimensions")
        return self._view(tuple(self.shape[a] for a in axes), tuple(self.strides[a] for a in axes), self.offset)

    @property
    def T(self) -> "VulkanArray":
        return self.transpose()

    def __getitem__(self, key) -> "VulkanArray":
        if not isinstance(key, tuple):
            key = (key,)
        for k in key:
            if not (k is None or k is Ellipsis or isinstance(k, (slice, numbers.Integral))) or isinstance(k, bool):
                raise TypeError(f"only basic indexing (ints, slices, ..., None) is part of the array protocol, not {k!r}")
        if sum(k is Ellipsis for k in key) > 1:
            raise IndexError("an index can only have a single ellipsis")
        used = sum(k is not None and k is not Ellipsis for k in key)
        if used > self.ndim:
            raise IndexError(f"too many indices for an array of {self.ndim} dimensions")
        if Ellipsis in key:
            i = key.index(Ellipsis)
            key = key[:i] + (slice(None),) * (self.ndim - used) + key[i + 1:]
        else:
            key = key + (slice(None),) * (self.ndim - used)
        shape, strides, offset, dim = [], [], self.offset, 0
        for k in key:
            if k is None:
                shape.append(1)
                strides.append(0)
                continue
            n, s = self.shape[dim], self.strides[dim]
            if isinstance(k, slice):
                start, stop, step = k.indices(n)
                count = len(range(start, stop, step))
                shape.append(count)
                strides.append(s * step)
                if count:
                    offset += start * s
            else:
                i = int(k)
                if not -n <= i < n:
                    raise IndexError(f"index {i} is out of bounds for axis {dim} with size {n}")
                offset += (i % n) * s
            dim += 1
        return self._view(tuple(shape), tuple(strides), offset)

    def __setitem__(self, key, value) -> None:
        self.backend.assign(self[key], value)

    # -- arithmetic ----------------------------------------------------------------------
    def _binary(self, other, op: str, reflected: bool = False):
        if isinstance(other, VulkanArray):
            return self.backend.binary(op, other, self) if reflected else self.backend.binary(op, self, other)
        if isinstance(other, numbers.Real) and not isinstance(other, bool):
            return self.backend.scalar(op, self, float(other), reflected)
        return NotImplemented

    __add__, __radd__ = _operator("+")
    __sub__, __rsub__ = _operator("-")
    __mul__, __rmul__ = _operator("*")
    __truediv__, __rtruediv__ = _operator("/")

    def __neg__(self):
        return self.backend.unary("neg", self)
