"""Integrity manifest: a hash of every tensor's bytes, to catch a copy that changed.

``colibri-integrity.json`` beside the shards records, per shard, its size, a hash of its
header and a hash of each tensor's bytes. ``colibri convert`` writes it for what it
writes; ``colibri doctor --deep --write-manifest`` writes it for any model. Every read
from a mirror is checked against it (and every read from the model directory itself with
``--verify``): a drive whose bytes differ is disabled with one warning and the read is
served by another drive holding the shard.

The hash is xxHash's XXH3-128 (the ``xxhash`` package): it runs at memory speed (tens of
GB/s on one core, several times BLAKE3's single-threaded rate), which is what a check on
every expert read can afford. It guards against accidental change (bit rot, a copy
truncated and re-extended, a drive returning zeros), not against an adversary: the
manifest sits beside the weights it describes, so a cryptographic hash would add cost
and no protection.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import numpy as np
import xxhash

from colibri_core.errors import ModelFormatError, UsageError
from colibri_core.io import smallfile
from colibri_core.warn import warn

MANIFEST_NAME = "colibri-integrity.json"
FORMAT_VERSION = 1
ALGORITHM = "xxh3_128"
MAX_MANIFEST_BYTES = smallfile.MANIFEST_BYTES
HASH_CHUNK = 16 << 20  # bytes hashed per read when hashing whole files (bounded memory)


class IntegrityError(ModelFormatError):
    """Bytes read from a drive differ from the integrity manifest."""


def digest(data) -> str:
    """XXH3-128 of a contiguous buffer (numpy array, memoryview or bytes), as hex."""
    if isinstance(data, np.ndarray):
        data = memoryview(np.ascontiguousarray(data)).cast("B")
    return xxhash.xxh3_128_hexdigest(data)


def _header_digest(sf) -> str:
    """Digest of an open SafetensorsFile's header (read from what was opened, not by name)."""
    return digest(sf.header_bytes())


class Manifest:
    """The manifest of a checkpoint: expected digests of the tensors of every shard whose
    size and header still match what was hashed."""

    def __init__(self, path: Path, digests: dict[str, str]):
        self.path = path
        self.digests = digests  # tensor name -> hex digest

    @classmethod
    def read(cls, checkpoint) -> "Manifest | None":
        """The manifest beside ``checkpoint``'s shards, or None if there is none or it is
        unreadable (with a warning). Shards changed since it was written are left out,
        with one warning naming them."""
        path = checkpoint.model_dir / MANIFEST_NAME
        if not smallfile.present(path):
            return None
        try:
            data = smallfile.read_json(path, MAX_MANIFEST_BYTES, "integrity manifest")
            shards = data["shards"] if isinstance(data, dict) else None
            if data.get("format") != FORMAT_VERSION or data.get("algorithm") != ALGORITHM or not isinstance(shards, dict):
                raise ValueError(f"not a version-{FORMAT_VERSION} {ALGORITHM} manifest")
            for entry in shards.values():
                if not (isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("header"), str)
                        and isinstance(entry.get("tensors"), dict)
                        and all(isinstance(k, str) and isinstance(v, str) for k, v in entry["tensors"].items())):
                    raise ValueError("a shard entry needs size, header and tensors")
        except (ModelFormatError, OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError,
                RecursionError) as exc:
            warn(f"{path}: integrity manifest is unreadable and is ignored ({exc}); "
                 "colibri doctor --deep --write-manifest writes a new one")
            return None
        digests: dict[str, str] = {}
        stale = []
        for shard, sf in checkpoint.files.items():
            entry = shards.get(shard)
            if entry is None or entry["size"] != sf.file_size or entry["header"] != _header_digest(sf):
                stale.append(shard)
                continue
            digests.update((name, entry["tensors"][name]) for name in sf.tensors if name in entry["tensors"])
        if stale:
            warn(f"{path}: integrity manifest does not describe {', '.join(stale[:3])}"
                 + (f" and {len(stale) - 3} more shards" if len(stale) > 3 else "")
                 + " (changed since it was written): their reads are not verified; "
                   "colibri doctor --deep --write-manifest rewrites it")
        return cls(path, digests)

    def check(self, info, data, where: str) -> None:
        """Raise IntegrityError if ``data`` (the bytes of tensor ``info`` read from
        ``where``) differs from the manifest; tensors it does not describe pass."""
        expected = self.digests.get(info.name)
        if expected is not None and digest(data) != expected:
            raise IntegrityError(f"{where}: tensor {info.name!r} does not match the integrity manifest "
                                 f"({MANIFEST_NAME}, {ALGORITHM})")


def tensor_digests(sf, progress: Callable[[int], None] | None = None) -> dict[str, str]:
    """Digest of every tensor of one open SafetensorsFile, hashed in bounded chunks."""
    out = {}
    buf = np.empty(HASH_CHUNK, dtype=np.uint8)
    for info in sorted(sf.tensors.values(), key=lambda t: t.offset):
        h = xxhash.xxh3_128()
        done = 0
        while done < info.nbytes:
            n = min(HASH_CHUNK, info.nbytes - done)
            view = memoryview(buf)[:n]
            sf.read_into(info.offset + done, view)
            h.update(view)
            done += n
            if progress:
                progress(n)
        sf.drop_cache(info.offset, info.nbytes)
        out[info.name] = h.hexdigest()
    return out


def build(checkpoint, progress: Callable[[int], None] | None = None) -> dict:
    """The manifest of ``checkpoint`` as it is on disk now (reads every tensor once)."""
    shards = {}
    for shard, sf in sorted(checkpoint.files.items()):
        shards[shard] = {"size": sf.file_size, "header": _header_digest(sf), "tensors": tensor_digests(sf, progress)}
    return {"format": FORMAT_VERSION, "algorithm": ALGORITHM, "shards": shards}


def write(checkpoint, progress: Callable[[int], None] | None = None) -> Path:
    """Hash every tensor of ``checkpoint`` and write the manifest beside its shards,
    atomically. A read-only model directory is a UsageError."""
    path = checkpoint.model_dir / MANIFEST_NAME
    text = json.dumps(build(checkpoint, progress), indent=1, sort_keys=True)
    try:
        smallfile.write_atomic(path, text)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None
    return path


def mismatches(checkpoint, manifest: Manifest, progress: Callable[[int], None] | None = None) -> list[str]:
    """Names of the tensors whose bytes on disk differ from ``manifest`` (reads them all)."""
    bad = []
    for sf in checkpoint.files.values():
        for name, value in tensor_digests(sf, progress).items():
            expected = manifest.digests.get(name)
            if expected is not None and value != expected:
                bad.append(name)
    return bad
