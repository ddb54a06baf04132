"""Our own safetensors reader and writer.

The reader parses and validates a file's header before anything is allocated: the header
length fits the file, the tensors tile the data section exactly (from its first byte to
its last, no gap, no overlap, nothing after them), and dtype x shape equals the byte
length. Errors name the file and the tensor. It accepts no file that the safetensors
library refuses (``tests/test_safetensors_differential.py`` fuzzes both), and refuses a
few that the library accepts, on purpose: a key named twice (the library keeps one of
them silently), dtypes no colibri weight format reads (F4, F6, C64, ...: refused at the
header, naming the tensor, not later), more than MAX_TENSOR_RANK dimensions and JSON
nested deeper than MAX_HEADER_DEPTH (no weight has such a shape or header).
Tensors are then read with positioned reads (``preadv`` straight into the destination
buffer), never mmap, so resident memory stays honest.

The writers put a file in place atomically (a temporary file, fsync, rename), so a file
we write is either complete or absent. ``StreamWriter`` streams tensors, and pieces of
one tensor, in an order fixed up front: ``colibri convert`` writes a fused tensor of
hundreds of experts one expert at a time, which the safetensors library cannot (its
serializer takes every tensor of the file, whole, at once). ``save_file`` writes tensors
held in memory with the safetensors library's own serializer (the demo model's shards);
``write_safetensors`` keeps the order it is given (tests place tensors deliberately).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from colibri_core.errors import ModelFormatError
from colibri_core.io.jsontext import parse_json
from colibri_core.io.pagecache import forget
from colibri_core.io.smallfile import check_regular

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's limit
MAX_TENSOR_RANK = 8
MAX_HEADER_DEPTH = 64  # a header nests 3 levels (entries, their fields, a shape); the library allows 128
_USIZE_MAX = 2**64 - 1  # the library's integers: anything larger is a float to it, and refused

# safetensors dtype -> (numpy storage dtype, bytes per element). BF16 and the 8-bit
# floats have no numpy dtype: they are read as unsigned integers and decoded by a quant format.
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("<f8", 8),
    "F32": ("<f4", 4),
    "F16": ("<f2", 2),
    "BF16": ("<u2", 2),
    "F8_E4M3": ("u1", 1),
    "F8_E5M2": ("u1", 1),
    "F8_E8M0": ("u1", 1),
    "I64": ("<i8", 8),
    "I32": ("<i4", 4),
    "I16": ("<i2", 2),
    "I8": ("i1", 1),
    "U64": ("<u8", 8),
    "U32": ("<u4", 4),
    "U16": ("<u2", 2),
    "U8": ("u1", 1),
    "BOOL": ("u1", 1),
}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: ``offset`` is absolute in the file."""

    name: str
    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _fail(path: str, message: str, tensor: str | None = None) -> ModelFormatError:
    where = f"{path}: tensor {tensor!r}: " if tensor is not None else f"{path}: "
    return ModelFormatError(where + message)


class SafetensorsFile:
    """One validated safetensors file, open for positioned reads."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._fd = -1
        # stat before opening: opening a FIFO blocks, and a device is no weight file
        check_regular(self.path, "safetensors file")
        try:
            # non-blocking: a file swapped for a FIFO since the stat cannot hang the open
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise ModelFormatError(f"{self.path}: file not found") from None
        except OSError as exc:
            raise ModelFormatError(f"{self.path}: cannot open: {exc.strerror}") from None
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise ModelFormatError(f"{self.path}: not a regular file")
            self.stat = st  # of what was opened: size and times identify this version of the file
            self.file_size = st.st_size
            self.metadata, self.tensors = self._parse_header()
        except BaseException:
            self.close()  # marks the fd closed, so __del__ cannot close a reused fd number
            raise

    def _parse_header(self) -> tuple[dict[str, str], dict[str, TensorInfo]]:
        path, size = self.path, self.file_size
        if size < 8:
            raise _fail(path, f"file is {size} bytes, too short for a safetensors header (truncated?)")
        (header_len,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
        if header_len > size - 8:
            raise _fail(path, f"header length {header_len} runs past the end of the {size}-byte file (truncated?)")
        if header_len > MAX_HEADER_BYTES:
            raise _fail(path, f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
        self.header_length = header_len
        raw = self._read_exact(8, header_len)
        try:
            header = parse_json(raw, f"{path}: header", object_pairs_hook=_refuse_duplicate_keys, parse_int=_header_int)
        except _DuplicateKey as dup:
            raise _fail(path, f"key {str(dup)!r} appears twice in the header; refusing to guess") from None
        if not isinstance(header, dict):
            raise _fail(path, "header is not a JSON object")
        _check_json_values(path, header)
        data_start = 8 + header_len
        data_size = size - data_start

        metadata = header.pop("__metadata__", None)
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise _fail(path, "__metadata__ must map strings to strings")

        tensors: dict[str, TensorInfo] = {}
        spans: list[tuple[int, int, str]] = []
        for name, entry in header.items():
            if not isinstance(entry, dict):
                raise _fail(path, "entry is not an object", name)
            dtype = entry.get("dtype")
            shape = entry.get("shape")
            offsets = entry.get("data_offsets")
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise _fail(path, f"unknown dtype {dtype!r}", name)
            if (
                not isinstance(shape, list)
                or len(shape) > MAX_TENSOR_RANK
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            ):
                raise _fail(path, f"bad shape {shape!r}", name)
            if (
                not isinstance(offsets, list)
                or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            ):
                raise _fail(path, f"bad data_offsets {offsets!r}", name)
            begin, end = offsets
            if not 0 <= begin <= end:
                raise _fail(path, f"data_offsets {offsets} are not an increasing pair", name)
            if end > data_size:
                raise _fail(path, f"data_offsets {offsets} run past the {data_size}-byte data section (truncated file?)", name)
            numel = 1
            for d in shape:  # in order, as the library multiplies: past 64 bits is refused even if a later 0 ends it
                numel *= d
                if numel > _USIZE_MAX:
                    raise _fail(path, f"shape {shape} overflows 64 bits", name)
            if numel * 8 * DTYPES[dtype][1] > _USIZE_MAX:  # the library counts bits
                raise _fail(path, f"{dtype} x {shape} overflows 64 bits", name)
            expected = numel * DTYPES[dtype][1]
            if expected != end - begin:
                raise _fail(path, f"{dtype} x {shape} is {expected} bytes but data_offsets span {end - begin}", name)
            tensors[name] = TensorInfo(name, path, dtype, tuple(shape), data_start + begin, end - begin)
            spans.append((begin, end, name))
        # the tensors tile the data section: sorted by offsets, each begins where the one
        # before ends (empty ones included), and the last ends with the file
        spans.sort()
        reach = (0, 0, None)  # the span reaching furthest so far
        for begin, end, name in spans:
            if begin < reach[1]:
                raise _fail(path, f"bytes [{reach[0]}, {reach[1]}) overlap tensor {name!r} at [{begin}, {end})", reach[2])
            reach = (begin, end, name)
        covered = 0
        for begin, end, name in spans:
            if begin > covered:
                raise _fail(path, f"bytes [{covered}, {begin}) of the data section before it belong to no tensor", name)
            covered = end
        if covered != data_size:
            raise _fail(path, f"the last {data_size - covered} bytes of the data section belong to no tensor "
                              "(trailing bytes: a damaged or foreign file)")
        return metadata, tensors

    def _read_exact(self, offset: int, nbytes: int) -> bytes:
        data = os.pread(self._fd, nbytes, offset)
        if len(data) != nbytes:
            raise _fail(self.path, f"short read at offset {offset}: file changed or truncated")
        return data

    def header_bytes(self) -> bytes:
        """The 8-byte header length and the JSON header: what fixes every tensor's name,
        dtype, shape and place in the file."""
        return self._read_exact(0, 8 + self.header_length)

    def changed_since_open(self) -> bool:
        """Whether the opened file's size or modification time differs from when it was
        opened (written to in place meanwhile)."""
        now = os.fstat(self._fd)
        return (now.st_size, now.st_mtime_ns) != (self.stat.st_size, self.stat.st_mtime_ns)

    def read_into(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the file's bytes starting at ``offset``."""
        done, total = 0, len(out)
        while done < total:
            view = out[done:]
            n = os.preadv(self._fd, [view], offset + done) if hasattr(os, "preadv") else _pread_copy(self._fd, view, offset + done)
            if n <= 0:
                raise _fail(self.path, f"unexpected end of file at offset {offset + done}: file changed or truncated")
            done += n

    def drop_cache(self, offset: int, nbytes: int) -> None:
        """Tell the kernel these bytes need not stay in the page cache."""
        if self._fd >= 0:
            forget(self._fd, offset, nbytes)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _DuplicateKey(Exception):
    pass


def _refuse_duplicate_keys(pairs):
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen[key] = value
    return seen


def _header_int(text: str):
    """An integer of the header as the safetensors library reads it: "-0" and values past
    64 bits are floats to it (and so refused where an integer belongs)."""
    value = int(text)
    return float(value) if text.startswith("-0") or value > _USIZE_MAX else value


def _check_json_values(path: str, header) -> None:
    """What the library's JSON parser refuses and Python's accepts: strings that are not
    Unicode (a lone UTF-16 surrogate escape), NaN, Infinity and numbers too large for a
    float (1e400), and nesting deeper than MAX_HEADER_DEPTH."""
    stack = [(header, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_HEADER_DEPTH:
            raise _fail(path, f"header nests deeper than {MAX_HEADER_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
            strings = value.keys()
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
            continue
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise _fail(path, f"header holds {value}, which is not a JSON number")
            continue
        elif isinstance(value, str):
            strings = (value,)
        else:
            continue
        for text in strings:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise _fail(path, f"header string {text[:40]!r} holds a lone UTF-16 surrogate (not Unicode)") from None


def _pread_copy(fd: int, view: memoryview, offset: int) -> int:
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


def as_array(info: TensorInfo, raw: np.ndarray) -> np.ndarray:
    """View raw bytes (uint8) as the tensor's storage dtype and shape."""
    storage = DTYPES[info.dtype][0]
    if raw.ctypes.data % np.dtype(storage).itemsize:
        raw = raw.copy()  # unaligned tensors get an aligned copy
    return raw.view(storage).reshape(info.shape)


# -- writing ---------------------------------------------------------------------------
_NUMPY_TO_ST = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("<f8"): "F64", np.dtype("<i8"): "I64",
                np.dtype("<i4"): "I32", np.dtype("<i2"): "I16", np.dtype("i1"): "I8", np.dtype("u1"): "U8",
                np.dtype("<u2"): "U16", np.dtype("<u4"): "U32", np.dtype("<u8"): "U64", np.dtype("bool"): "BOOL"}


def _typed(name: str, value) -> tuple[str, np.ndarray]:
    """(safetensors dtype, little-endian contiguous array) of a value to write."""
    if isinstance(value, tuple):
        dtype, array = value
        array = np.asarray(array)
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: unknown safetensors dtype {dtype!r}")
    else:
        array = np.asarray(value)
        dtype = _NUMPY_TO_ST.get(array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype)
        if dtype is None:
            raise ValueError(f"tensor {name!r}: no safetensors dtype for numpy {array.dtype}")
    if array.dtype.itemsize != DTYPES[dtype][1]:
        raise ValueError(f"tensor {name!r}: {dtype} needs {DTYPES[dtype][1]}-byte elements, got {array.dtype}")
    return dtype, array


# our dtype names -> the safetensors library's (it takes framework-style names)
_LIBRARY_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
                   "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu", "I64": "int64", "I32": "int32", "I16": "int16",
                   "I8": "int8", "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool"}


def save_file(path: str | os.PathLike, tensors: Mapping[str, np.ndarray | tuple[str, np.ndarray]],
              metadata: Mapping[str, str] | None = None) -> int:
    """Write tensors held in memory with the safetensors library, atomically. Values as
    for ``write_safetensors``; the library orders them in the file (by alignment, then
    name). Returns the file size."""
    from safetensors import TensorSpec, serialize_file

    path = os.fspath(path)
    arrays, specs = [], {}
    for name, value in tensors.items():
        dtype, array = _typed(name, value)
        shape = list(array.shape)  # before ascontiguousarray, which makes a 0-d array 1-d
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        arrays.append(array)  # the library reads each array through its address: it must stay alive
        specs[name] = TensorSpec(dtype=_LIBRARY_DTYPES[dtype], shape=shape, data_ptr=array.ctypes.data,
                                 data_len=array.nbytes)
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("metadata must map strings to strings")
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        serialize_file(specs, tmp, dict(metadata) if metadata else None)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return size


class StreamWriter:
    """Writes one safetensors file atomically, tensor by tensor.

    The tensors (name, dtype, shape) are declared up front, so the header can be written
    first; their data then arrive one at a time in that order, and memory holds one
    tensor, never the file. ``commit`` fsyncs and renames the temporary file into place;
    leaving the ``with`` block by an exception removes it.
    """

    def __init__(self, path: str | os.PathLike, specs: Iterable[tuple[str, str, tuple[int, ...]]],
                 metadata: Mapping[str, str] | None = None):
        self.path = os.fspath(path)
        header: dict[str, object] = {}
        if metadata:
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
                raise ValueError("metadata must map strings to strings")
            header["__metadata__"] = dict(metadata)
        self._pending: list[tuple[str, str, tuple[int, ...], int]] = []
        offset = 0
        for name, dtype, shape in specs:
            if name in header or name == "__metadata__":
                raise ValueError(f"tensor {name!r}: duplicate or reserved name")
            if dtype not in DTYPES:
                raise ValueError(f"tensor {name!r}: unknown safetensors dtype {dtype!r}")
            nbytes = DTYPES[dtype][1]
            for d in shape:
                nbytes *= d
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._pending.append((name, dtype, tuple(shape), nbytes))
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.size = 8 + len(blob) + offset
        self._tmp = f"{self.path}.tmp-{os.getpid()}"
        self._file = open(self._tmp, "wb")
        self._file.write(struct.pack("<Q", len(blob)))
        self._file.write(blob)
        self._next = 0

    def write(self, name: str, value) -> None:
        expected, dtype, shape, nbytes = self._pending[self._next]
        if name != expected:
            raise ValueError(f"tensor {name!r} written out of order: {expected!r} comes next")
        got_dtype, array = _typed(name, value)
        if got_dtype != dtype or tuple(array.shape) != shape:
            raise ValueError(f"tensor {name!r}: declared {dtype} {list(shape)}, got {got_dtype} {list(array.shape)}")
        array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        self._file.write(memoryview(array.reshape(-1).view(np.uint8)))
        self._next += 1

    def write_parts(self, name: str, parts: Iterable) -> None:
        """Write the next tensor from pieces along its first axis (one expert of a fused
        tensor at a time: memory holds a piece, never the tensor)."""
        expected, dtype, shape, nbytes = self._pending[self._next]
        if name != expected:
            raise ValueError(f"tensor {name!r} written out of order: {expected!r} comes next")
        rows = 0
        for value in parts:
            got_dtype, array = _typed(name, value)
            if got_dtype != dtype or tuple(array.shape[1:]) != shape[1:] or rows + array.shape[0] > shape[0]:
                raise ValueError(f"tensor {name!r}: declared {dtype} {list(shape)}, got a piece {got_dtype} "
                                 f"{list(array.shape)} after {rows} rows")
            array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
            self._file.write(memoryview(array.reshape(-1).view(np.uint8)))
            rows += array.shape[0]
        if rows != shape[0]:
            raise ValueError(f"tensor {name!r}: declared {shape[0]} rows, got {rows}")
        self._next += 1

    def commit(self) -> int:
        if self._next != len(self._pending):
            raise ValueError(f"{self.path}: {len(self._pending) - self._next} declared tensors were never written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self._tmp, self.path)
        return self.size

    def abort(self) -> None:
        if not self._file.closed:
            try:
                self._file.close()
            except OSError:  # e.g. the disk is full: closing flushes, and fails again
                pass
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None:
            self.abort()


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray | tuple[str, np.ndarray]] | Iterable[tuple[str, np.ndarray | tuple[str, np.ndarray]]],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write tensors atomically. A value is an array, or (safetensors dtype, array of its
    storage type), e.g. ("BF16", uint16 array). Returns the file size."""
    items = [(name, _typed(name, value)) for name, value in (tensors.items() if isinstance(tensors, Mapping) else tensors)]
    with StreamWriter(path, [(name, dtype, array.shape) for name, (dtype, array) in items], metadata) as writer:
        for name, typed in items:
            writer.write(name, typed)
        return writer.commit()
