"""Routing history: how often each (MoE layer, expert) was chosen.

It is what the pinned hot set and ``colibri plan`` learn from. It is saved as
``colibri-usage.json`` next to the model, or, when the model directory is read-only, in
the user cache dir; always atomically (temporary file, fsync, rename). A history whose
family or shape does not match the model is refused with a warning, and a corrupt one is
ignored with a warning: neither ever stops a run.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from colibri_core.warn import warn

FILENAME = "colibri-usage.json"
FORMAT_VERSION = 1


def cache_path(model_dir: Path) -> Path:
    import platformdirs

    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:20]
    return Path(platformdirs.user_cache_dir("colibri")) / "usage" / f"{key}.json"


class RoutingHistory:
    def __init__(self, model_dir: Path, family: str, model_type: str | None, layers: int, experts: int):
        self.model_dir = Path(model_dir)
        self.family, self.model_type = family, model_type
        self.shape = (layers, experts)
        self.counts = np.zeros(self.shape, dtype=np.float64)  # saved counts (decayed)
        self.session = np.zeros(self.shape, dtype=np.float64)  # counted since loading
        self.tokens = 0.0  # saved token count (decayed like the counts)
        self.session_tokens = 0
        self.path: Path | None = None  # where the history was read from

    # -- loading -----------------------------------------------------------------------
    @classmethod
    def open(cls, model_dir: Path, family: str, model_type: str | None, layers: int, experts: int) -> "RoutingHistory":
        history = cls(model_dir, family, model_type, layers, experts)
        for candidate in (Path(model_dir) / FILENAME, cache_path(Path(model_dir))):
            if candidate.exists():
                history._read(candidate)
                break
        return history

    def _read(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
                raise ValueError(f"not a version-{FORMAT_VERSION} colibri usage file")
            counts = np.asarray(data["counts"], dtype=np.float64)
            tokens = float(data["tokens"])
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as exc:
            warn(f"{path}: routing history is unreadable and is ignored ({exc})")
            return
        if data.get("family") != self.family or counts.shape != self.shape:
            warn(f"{path}: routing history is for family {data.get('family')!r} with shape "
                 f"{list(counts.shape)}, not {self.family!r} {list(self.shape)}; refused")
            return
        if not np.all(np.isfinite(counts)) or (counts < 0).any() or not np.isfinite(tokens) or tokens < 0:
            warn(f"{path}: routing history holds negative or non-finite counts and is ignored")
            return
        self.counts, self.tokens, self.path = counts, tokens, path

    # -- counting ----------------------------------------------------------------------
    def record(self, layer: int, indices: np.ndarray) -> None:
        self.session[layer] += np.bincount(indices.ravel(), minlength=self.shape[1])[: self.shape[1]]

    def record_tokens(self, n: int) -> None:
        self.session_tokens += n

    def scores(self) -> np.ndarray:
        return self.counts + self.session

    @property
    def total_tokens(self) -> float:
        return self.tokens + self.session_tokens

    # -- saving ------------------------------------------------------------------------
    def save(self, decay: float = 1.0) -> Path | None:
        """Fold this session into the saved counts (old counts x decay + new) and write
        atomically. Returns the path written, or None if nothing could be written."""
        if not self.session_tokens:
            return self.path
        counts = self.counts * decay + self.session
        tokens = self.tokens * decay + self.session_tokens
        payload = json.dumps({
            "format": FORMAT_VERSION, "family": self.family, "model_type": self.model_type,
            "layers": self.shape[0], "experts": self.shape[1], "tokens": tokens,
            "counts": [[round(float(c), 4) for c in row] for row in counts],
        })
        for target in (self.model_dir / FILENAME, cache_path(self.model_dir)):
            try:
                _atomic_write(target, payload)
            except OSError:
                continue
            self.counts, self.tokens, self.path = counts, tokens, target
            self.session = np.zeros(self.shape, dtype=np.float64)
            self.session_tokens = 0
            return target
        warn(f"could not save the routing history next to {self.model_dir} nor in the cache dir")
        return None


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
