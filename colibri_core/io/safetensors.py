"""Our own safetensors reader and writer.

The reader parses and validates a file's header before anything is allocated: the header
length fits the file, every tensor's offsets lie inside the data section, no two tensors
overlap, and dtype x shape equals the byte length. Errors name the file and the tensor.
Tensors are then read with positioned reads (``preadv`` straight into the destination
buffer), never mmap, so resident memory stays honest.

The writer streams tensors to a temporary file and renames it into place, so a file we
write is either complete or absent.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from colibri_core.errors import ModelFormatError
from colibri_core.io.jsontext import parse_json
from colibri_core.io.pagecache import forget

MAX_HEADER_BYTES = 100 << 20  # the safetensors library refuses larger headers too
MAX_TENSOR_RANK = 8

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
        n = 1
        for d in self.shape:
            n *= d
        return n


def _fail(path: str, message: str, tensor: str | None = None) -> ModelFormatError:
    where = f"{path}: tensor {tensor!r}: " if tensor is not None else f"{path}: "
    return ModelFormatError(where + message)


class SafetensorsFile:
    """One validated safetensors file, open for positioned reads."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise ModelFormatError(f"{self.path}: file not found") from None
        except OSError as exc:
            raise ModelFormatError(f"{self.path}: cannot open: {exc.strerror}") from None
        try:
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                raise ModelFormatError(f"{self.path}: not a regular file")
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
        raw = self._read_exact(8, header_len)
        try:
            header = parse_json(raw, f"{path}: header", object_pairs_hook=_refuse_duplicate_keys)
        except _DuplicateKey as dup:
            raise _fail(path, "appears twice in the header; refusing to guess", str(dup)) from None
        if not isinstance(header, dict):
            raise _fail(path, "header is not a JSON object")
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
            for d in shape:
                numel *= d
            expected = numel * DTYPES[dtype][1]
            if expected != end - begin:
                raise _fail(path, f"{dtype} x {shape} is {expected} bytes but data_offsets span {end - begin}", name)
            tensors[name] = TensorInfo(name, path, dtype, tuple(shape), data_start + begin, end - begin)
            if end > begin:
                spans.append((begin, end, name))
        spans.sort()
        for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
            if b1 < e0:
                raise _fail(path, f"bytes [{b0}, {e0}) overlap tensor {n1!r} at [{b1}, {e1})", n0)
        return metadata, tensors

    def _read_exact(self, offset: int, nbytes: int) -> bytes:
        data = os.pread(self._fd, nbytes, offset)
        if len(data) != nbytes:
            raise _fail(self.path, f"short read at offset {offset}: file changed or truncated")
        return data

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
