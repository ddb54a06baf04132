"""A backend that offers exactly the contract and nothing more, to prove the core needs
nothing more.

Its arrays are ``Box`` objects: the documented array protocol (``shape``, ``ndim``,
``dtype``, ``reshape``, ``transpose``, basic indexing and assignment into a basic slice,
``+ - * /`` and unary ``-`` with boxes and Python numbers) and nothing else: no
``astype``, no ``nbytes``, no fancy indexing, no iteration, no truth value, no numpy
scalars or host arrays as operands. Every refusal is a ``ProtocolError`` (a TypeError,
also for a missing attribute, so that ``getattr(x, name, default)`` cannot hide one). ``__array__`` refuses, so numpy cannot wrap a box as
an object array behind the core's back. Prepared linear and embedding weights are
opaque (``Sealed``): a block that reads one as an array fails.

Every operation unwraps its arguments, checks that backend arrays are boxes and host
arrays are numpy (the contract says which is which), and delegates to
``ReferenceBackend``. The routines the contract itself implements (``linears``,
``swiglu_expert``, ``routed_experts``, the routers) and every composite op (MLA, DSA,
the delta rule, ... : ``colibri_core.compute.composites``) are inherited from ``Backend``
unchanged, so they are proved contract-only too.

Registered in-process as backend "boxed" by the tests (``colibri_register_backends``
below).
"""

from __future__ import annotations

import numpy as np

from colibri_core import hookimpl
from colibri_core.compute.backend import Backend
from colibri_core.compute.reference import ReferenceBackend
from colibri_core.formats.base import QuantTensor
from colibri_core.plugins.registry import BackendSpec


class ProtocolError(TypeError):
    """The core used a backend array beyond the contract's array protocol."""


def _int(value, what: str) -> int:
    if type(value) is not int:  # not bool, not numpy integers
        raise ProtocolError(f"{what} must be a Python int, got {type(value).__name__}")
    return value


def _basic_key(key):
    parts = key if isinstance(key, tuple) else (key,)
    for part in parts:
        if part is None or part is Ellipsis:
            continue
        if isinstance(part, slice):
            for bound in (part.start, part.stop, part.step):
                if bound is not None:
                    _int(bound, "a slice bound")
            continue
        _int(part, "an index (only basic indexing: ints, slices, ..., None)")
    return key


def _operand(other):
    if isinstance(other, Box):
        return other.value
    if isinstance(other, np.generic) or isinstance(other, bool) or not isinstance(other, (int, float)):
        raise ProtocolError(f"arithmetic with a {type(other).__name__}: only boxes and Python int / float are allowed")
    return other


class Box:
    """A backend array: the contract's array protocol over a numpy array."""

    __slots__ = ("value",)
    __array_ufunc__ = None  # numpy ufuncs and numpy's operators refuse boxes
    __hash__ = object.__hash__

    def __init__(self, value: np.ndarray):
        self.value = value

    def __getattr__(self, name):  # a TypeError, not an AttributeError: getattr(x, name, default) must not hide it
        raise ProtocolError(f"backend arrays have no attribute {name!r} in the contract's array protocol")

    def __array__(self, *args, **kwargs):
        raise ProtocolError("np.asarray of a backend array: use Backend.to_host")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.value.shape)

    @property
    def ndim(self) -> int:
        return self.value.ndim

    @property
    def dtype(self) -> str:
        return self.value.dtype.name

    def reshape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], tuple):
            shape = shape[0]
        return Box(self.value.reshape(tuple(_int(d, "a reshape size") for d in shape)))

    def transpose(self, *axes):
        return Box(self.value.transpose(tuple(_int(a, "a transpose axis") for a in axes)))

    def __getitem__(self, key):
        return Box(np.asarray(self.value[_basic_key(key)]))

    def __setitem__(self, key, rows):
        if not isinstance(rows, Box):
            raise ProtocolError(f"assigning a {type(rows).__name__} into a backend array: only backend arrays")
        self.value[_basic_key(key)] = rows.value

    def __add__(self, other):
        return Box(self.value + _operand(other))

    def __radd__(self, other):
        return Box(_operand(other) + self.value)

    def __sub__(self, other):
        return Box(self.value - _operand(other))

    def __rsub__(self, other):
        return Box(_operand(other) - self.value)

    def __mul__(self, other):
        return Box(self.value * _operand(other))

    def __rmul__(self, other):
        return Box(_operand(other) * self.value)

    def __truediv__(self, other):
        return Box(self.value / _operand(other))

    def __rtruediv__(self, other):
        return Box(_operand(other) / self.value)

    def __neg__(self):
        return Box(-self.value)

    def _refuse(self, *args, **kwargs):
        raise ProtocolError("backend arrays have no truth value, length, iteration or comparison")

    __bool__ = __len__ = __iter__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _refuse

    def __repr__(self) -> str:
        return f"Box({self.value.dtype.name}{list(self.value.shape)})"


class Sealed:
    """A prepared linear / embedding weight: opaque to everything but the backend."""

    __slots__ = ("value",)

    def __init__(self, value: np.ndarray):
        self.value = value


def _array(x, what: str = "a backend array"):
    if not isinstance(x, Box):
        raise ProtocolError(f"expected {what}, got {type(x).__name__}")
    return x.value


def _optional(x):
    return None if x is None else _array(x)


def _host(x, what: str = "a host (numpy) array"):
    if not isinstance(x, np.ndarray):
        raise ProtocolError(f"expected {what}, got {type(x).__name__}")
    return x


def _weight(w):
    if isinstance(w, (Sealed, Box)):
        return w.value
    raise ProtocolError(f"expected a prepared weight, got {type(w).__name__}")


class BoxedBackend(Backend):
    name = "boxed"

    def __init__(self):
        super().__init__()
        self.ref = ReferenceBackend()

    # -- memory ------------------------------------------------------------------------
    def asarray(self, host, dtype="float32"):
        return Box(np.array(self.ref.asarray(_host(host), dtype), copy=True))  # never aliases host memory

    def zeros(self, shape, dtype="float32"):
        return Box(self.ref.zeros(tuple(_int(d, "a zeros size") for d in shape), dtype))

    def _to_host(self, x):
        return np.array(_array(x), copy=True)  # the core may not write through it

    def nbytes(self, x):
        return int(_weight(x).nbytes) if isinstance(x, (Box, Sealed)) else int(x.nbytes)

    def prepare_weight(self, w, use="linear"):
        if not isinstance(w, (np.ndarray, QuantTensor)):
            raise ProtocolError(f"prepare_weight takes a host weight, got {type(w).__name__}")
        value = np.array(self.ref.prepare_weight(w, use), copy=True)
        return Box(value) if use == "array" else Sealed(value)

    # -- dense operations --------------------------------------------------------------
    def embedding(self, table, ids):
        return Box(self.ref.embedding(_weight(table), _host(ids)))

    def linear(self, x, weight, bias=None):
        return Box(self.ref.linear(_array(x), _weight(weight), _optional(bias)))

    def rms_norm(self, x, weight, eps):
        return Box(self.ref.rms_norm(_array(x), _optional(weight), eps))

    def layer_norm(self, x, weight, bias, eps):
        return Box(self.ref.layer_norm(_array(x), _optional(weight), _optional(bias), eps))

    def rope(self, x, cos, sin, rotary_dim):
        return Box(self.ref.rope(_array(x), _array(cos), _array(sin), rotary_dim))

    def attention(self, q, k, v, start, scale):
        return Box(self.ref.attention(_array(q), _array(k), _array(v), _int(start, "start"), scale))

    def clip(self, x, limit):
        return Box(self.ref.clip(_array(x), limit))

    def silu(self, x):
        return Box(self.ref.silu(_array(x)))

    def silu_mul(self, gate, up):
        return Box(self.ref.silu_mul(_array(gate), _array(up)))

    def sigmoid(self, x):
        return Box(self.ref.sigmoid(_array(x)))

    def softplus(self, x):
        return Box(self.ref.softplus(_array(x)))

    def softmax(self, x):
        return Box(self.ref.softmax(_array(x)))

    def l2_norm(self, x, eps):
        return Box(self.ref.l2_norm(_array(x), eps))

    def concat(self, arrays, axis):
        return Box(self.ref.concat([_array(a) for a in arrays], axis))

    def take_rows(self, x, rows):
        return Box(self.ref.take_rows(_array(x), _host(rows)))

    def add_rows(self, out, rows, y, scale):
        return Box(self.ref.add_rows(_array(out), _host(rows), _array(y), _host(scale)))

    def top_k(self, scores, k):
        return Box(self.ref.top_k(_array(scores), k))

    # -- primitives ----------------------------------------------------------------------
    def exp(self, x):
        return Box(self.ref.exp(_array(x)))

    def maximum(self, x, floor):
        if type(floor) is not float:
            raise ProtocolError(f"maximum's floor must be a Python float, got {type(floor).__name__}")
        return Box(self.ref.maximum(_array(x), floor))

    def matmul(self, a, b):
        a, b = _array(a), _array(b)
        if b.ndim != 2 and a.shape[:-2] != b.shape[:-2]:
            raise ProtocolError(f"matmul's leading axes differ: {a.shape} @ {b.shape} (the contract does not broadcast them)")
        return Box(self.ref.matmul(a, b))

    def reduce_sum(self, x):
        return Box(self.ref.reduce_sum(_array(x)))

    def reduce_max(self, x):
        return Box(self.ref.reduce_max(_array(x)))


@hookimpl
def colibri_register_backends(register):
    register(BackendSpec("boxed", "boxed_backend:BoxedBackend",
                         description="the contract and nothing more, over the reference (tests only)"))
