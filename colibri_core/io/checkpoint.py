"""A model's weights across one or many safetensors shards.

With ``model.safetensors.index.json`` the index names each tensor's shard; without it,
every ``*.safetensors`` file in the directory is read. Every shard's header is validated
on open, and a tensor name found in two shards is refused rather than silently resolved.

A shard is named by a relative path inside the model directory: an index entry that is
absolute or climbs out (``../x``) is refused. The file it names may be a symlink to
anywhere (the Hugging Face hub cache links ``snapshots/REV/NAME`` to ``../../blobs/HASH``):
containment is a property of the name, not of where the bytes live.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

import numpy as np

from colibri_core.errors import ModelFormatError
from colibri_core.io import smallfile
from colibri_core.io.safetensors import DTYPES, SafetensorsFile, TensorInfo, as_array

INDEX_NAME = "model.safetensors.index.json"
MAX_INDEX_BYTES = smallfile.INDEX_BYTES
# Reads of tensors closer than this on disk are merged into one pread: a few wasted
# bytes cost less than another round trip to the drive.
MERGE_GAP_BYTES = 256 << 10


class ShardOutsideModelError(ModelFormatError):
    """An index names a shard by a path outside the model directory."""


class Checkpoint:
    """Validated tensor directory of a model, with range reads."""

    def __init__(self, model_dir: str | os.PathLike):
        self.model_dir = Path(model_dir)
        self.files: dict[str, SafetensorsFile] = {}  # shard name -> open file
        self._by_path: dict[str, SafetensorsFile] = {}
        self.tensors: dict[str, TensorInfo] = {}
        self.bytes_read = 0
        self.reads = 0
        self.drop_cache = True  # weights we read are decoded into our memory: the page cache copy is waste
        self.integrity = None  # a Manifest every read is checked against (``--verify``), or None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        index_path = self.model_dir / INDEX_NAME
        if smallfile.present(index_path):
            weight_map = self._read_index(index_path)
            shard_names = sorted(set(weight_map.values()))
        else:
            weight_map = None
            shard_names = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
            if not shard_names:
                raise ModelFormatError(f"{self.model_dir}: no *.safetensors weight files (and no {INDEX_NAME})")
        where = index_path if weight_map is not None else self.model_dir
        for shard in shard_names:
            path = self._shard_path(shard, where)
            sf = SafetensorsFile(path)
            self.files[shard] = sf
            self._by_path[sf.path] = sf
        owner: dict[str, str] = {}
        for shard, sf in self.files.items():
            for name, info in sf.tensors.items():
                if name in owner:
                    raise ModelFormatError(
                        f"{self.model_dir}: tensor {name!r} appears in two shards, {owner[name]} and {shard}; refusing to guess"
                    )
                owner[name] = shard
                self.tensors[name] = info
        if weight_map is not None:
            for name, shard in weight_map.items():
                if owner.get(name) != shard:
                    where = f"is in {owner[name]}" if name in owner else "is in no shard"
                    raise ModelFormatError(f"{index_path}: tensor {name!r} is mapped to {shard} but {where}")

    def _read_index(self, index_path: Path) -> dict[str, str]:
        return read_index(index_path)

    def _shard_path(self, shard: str, where: Path) -> Path:
        name = PurePosixPath(shard)
        if not shard or name.is_absolute() or "\\" in shard or ".." in name.parts or name.parts in ((), (".",)):
            raise ShardOutsideModelError(f"{where}: shard {shard!r} lies outside the model directory")
        # not resolved: a symlink named inside the directory is the shard (mirrors match by this name)
        path = Path(os.path.abspath(self.model_dir / name))
        if not smallfile.present(path):
            raise ModelFormatError(f"{where}: shard {shard!r} is missing from {self.model_dir}")
        problem = smallfile.why_not_regular(path)  # a FIFO would block the open, a device is no shard
        if problem is not None:
            raise ModelFormatError(f"{where}: shard {shard!r} in {self.model_dir} {problem}")
        return path

    # -- lookups ---------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelFormatError(f"{self.model_dir}: missing tensor {name!r}") from None

    def metadata_for(self, path: str) -> dict[str, str]:
        """The ``__metadata__`` of the shard at ``path``."""
        return self._by_path[path].metadata

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    # -- reads -----------------------------------------------------------------------
    def read(self, name: str) -> np.ndarray:
        """One tensor in its storage dtype (BF16 as uint16)."""
        return self.read_many([self.info(name)])[name]

    def read_many(self, infos: list[TensorInfo], buffer=None) -> dict[str, np.ndarray]:
        """Several tensors with as few reads as possible: tensors lying close together in
        one file are fetched by a single pread into one buffer (``buffer(nbytes)`` makes
        it, a plain numpy array by default). The arrays returned view that buffer."""
        out: dict[str, np.ndarray] = {}
        for group in merge_ranges(infos):
            path = group[0].path
            start = group[0].offset
            end = max(t.offset + t.nbytes for t in group)
            buf = buffer(end - start) if buffer is not None else np.empty(end - start, dtype=np.uint8)
            sf = self._by_path[path]
            sf.read_into(start, memoryview(buf))
            if self.drop_cache:
                sf.drop_cache(start, end - start)
            self.bytes_read += end - start
            self.reads += 1
            for t in group:
                if self.integrity is not None:
                    self.integrity.check(t, buf[t.offset - start : t.offset - start + t.nbytes], path)
                out[t.name] = as_array(t, buf[t.offset - start : t.offset - start + t.nbytes])
        return out

    def read_chunks(self, info: TensorInfo, chunk_bytes: int):
        """One tensor's elements, a slice of at most ``chunk_bytes`` at a time: yields
        (first element, 1-D array of the storage dtype viewing a scratch buffer that the
        next slice overwrites). Memory stays one chunk however large the tensor is."""
        storage = np.dtype(DTYPES[info.dtype][0])
        step = max(storage.itemsize, chunk_bytes // storage.itemsize * storage.itemsize)
        scratch = np.empty(min(step, info.nbytes), dtype=np.uint8)
        sf = self._by_path[info.path]
        for start in range(0, info.nbytes, step):
            n = min(step, info.nbytes - start)
            sf.read_into(info.offset + start, memoryview(scratch[:n]))
            if self.drop_cache:
                sf.drop_cache(info.offset + start, n)
            self.bytes_read += n
            self.reads += 1
            yield start // storage.itemsize, scratch[:n].view(storage)

    def close(self) -> None:
        for sf in self.files.values():
            sf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_index(index_path: Path) -> dict[str, str]:
    """The validated ``weight_map`` of a ``model.safetensors.index.json``: tensor name ->
    shard file name, both strings."""
    index = smallfile.read_json(index_path, MAX_INDEX_BYTES, "safetensors index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ModelFormatError(f"{index_path}: 'weight_map' must map tensor names to shard file names")
    if not weight_map:
        raise ModelFormatError(f"{index_path}: 'weight_map' is empty")
    return weight_map


def merge_ranges(infos: list[TensorInfo], gap: int = MERGE_GAP_BYTES) -> list[list[TensorInfo]]:
    """Group tensors of one file lying within ``gap`` bytes of each other: one read each."""
    groups: list[list[TensorInfo]] = []
    group_end = 0
    for t in sorted(infos, key=lambda t: (t.path, t.offset)):
        if groups and groups[-1][0].path == t.path and t.offset - group_end <= gap:
            groups[-1].append(t)
            group_end = max(group_end, t.offset + t.nbytes)
        else:
            groups.append([t])
            group_end = t.offset + t.nbytes
    return groups
