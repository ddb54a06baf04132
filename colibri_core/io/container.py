"""colibri's own quantised containers: safetensors files stamped in their metadata.

A converted file carries ``colibri.format`` (the container version) and
``colibri.tensors``: a JSON object mapping each quantised tensor's name to its format and
logical shape, e.g. ``{"model.layers.0.mlp.experts.3.up_proj.weight": {"fmt":
"int4-gs64", "shape": [1024, 2048]}}`` (three dimensions for experts stored fused,
(experts, rows, cols)). The packed bytes are stored under the tensor's own
name and the scales under ``<name>.qs``. A format claims a tensor only through this stamp
(or, for checkpoints from other tools, through their own evidence), never by guessing
from byte counts.
"""

from __future__ import annotations

import json

from colibri_core.errors import ModelFormatError

FORMAT_KEY = "colibri.format"
TENSORS_KEY = "colibri.tensors"
CONTAINER_VERSION = "1"
SCALES_SUFFIX = ".qs"


def stamps(checkpoint, path: str) -> dict[str, dict]:
    """The stamped tensors of one shard (parsed once and cached on the checkpoint)."""
    cache = checkpoint.__dict__.setdefault("_colibri_stamps", {})
    if path not in cache:
        metadata = checkpoint.metadata_for(path)
        raw = metadata.get(TENSORS_KEY)
        if raw is None:
            cache[path] = {}
        else:
            if metadata.get(FORMAT_KEY) != CONTAINER_VERSION:
                raise ModelFormatError(f"{path}: colibri container version {metadata.get(FORMAT_KEY)!r} is not "
                                       f"supported (this colibri reads version {CONTAINER_VERSION})")
            try:
                table = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise ModelFormatError(f"{path}: metadata {TENSORS_KEY!r} is not valid JSON ({exc})") from None
            if not isinstance(table, dict):
                raise ModelFormatError(f"{path}: metadata {TENSORS_KEY!r} must be an object")
            for name, entry in table.items():
                shape = entry.get("shape") if isinstance(entry, dict) else None
                if (not isinstance(entry, dict) or not isinstance(entry.get("fmt"), str) or not isinstance(shape, list)
                        or len(shape) not in (2, 3) or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
                    raise ModelFormatError(f"{path}: tensor {name!r}: bad colibri stamp {entry!r}")
            cache[path] = table
    return cache[path]


def stamp_of(checkpoint, info) -> dict | None:
    if checkpoint is None:
        return None
    return stamps(checkpoint, info.path).get(info.name)


def metadata(entries: dict[str, dict], extra: dict[str, str] | None = None) -> dict[str, str]:
    """File metadata stamping ``entries`` (name -> {"fmt", "shape"})."""
    out = {"format": "pt", FORMAT_KEY: CONTAINER_VERSION, TENSORS_KEY: json.dumps(entries, sort_keys=True)}
    out.update(extra or {})
    return out
