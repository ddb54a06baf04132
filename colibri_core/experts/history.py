"""Routing history: how often each (MoE layer, expert) was chosen.

It is what the pinned hot set and ``colibri plan`` learn from. It is saved as
``colibri-usage.json`` next to the model, or, when the model directory is read-only, is a
Hugging Face hub cache snapshot (whose files are huggingface_hub's) or holds a
``colibri-read-only`` file (an installed package's model), in the user cache dir; once
the cache copy exists it is the one read and written (a stale copy in a read-only model
directory never shadows what later runs learned). Saving is
atomic (temporary file, fsync, rename) and holds an ``fcntl`` lock on a ``.lock`` file
beside the history while it reads the saved counts, adds this session's and writes:
concurrent runs add up instead of the last writer winning. A temporary file left by a
writer that was killed mid-save is removed by the next save once its PID is gone. A
history whose family or shape does not match the model is refused with a warning, and a
corrupt one is ignored with a warning: neither ever stops a run.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from colibri_core.errors import ColibriError
from colibri_core.io import smallfile
from colibri_core.io.hub_cache import hub_repo_id
from colibri_core.warn import warn

FILENAME = "colibri-usage.json"
# a model directory holding this file is never written to (an installed package's data)
READ_ONLY_MARKER = "colibri-read-only"
FORMAT_VERSION = 1


def cache_path(model_dir: Path) -> Path:
    import platformdirs

    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:20]
    return Path(platformdirs.user_cache_dir("colibri")) / "usage" / f"{key}.json"


def save_targets(model_dir: Path) -> list[Path]:
    """Where the history of ``model_dir`` is saved, in order of preference (the next
    when one cannot be written); the expert atlas is written beside it."""
    cache = cache_path(model_dir)
    # never into a hub snapshot, the lock file neither: those files are huggingface_hub's;
    # nor into a directory that says it is an installed package's (colibri-trained's models)
    cache_only = (cache.exists() or hub_repo_id(model_dir) is not None
                  or smallfile.present(model_dir / READ_ONLY_MARKER))
    return [cache] if cache_only else [model_dir / FILENAME, cache]


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
        source = history._source()
        if source is not None:
            try:
                history.counts, history.tokens = history._parse(source)
                history.path = source
            except ValueError as exc:
                warn(str(exc))
        return history

    def _source(self) -> Path | None:
        """The saved history to read: the cache copy once it exists, else the one next
        to the model, else none."""
        for candidate in (cache_path(self.model_dir), self.model_dir / FILENAME):
            if smallfile.present(candidate):  # a FIFO or a broken link is read, refused and reported
                return candidate
        return None

    def _parse(self, path: Path) -> tuple[np.ndarray, float]:
        """(counts, tokens) saved at ``path``; ValueError with a one-line reason if the
        file is unreadable, corrupt or for another model."""
        try:
            data = smallfile.read_json(path, smallfile.MANIFEST_BYTES, "routing history")
            if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
                raise ValueError(f"not a version-{FORMAT_VERSION} colibri usage file")
            counts = np.asarray(data["counts"], dtype=np.float64)
            tokens = float(data["tokens"])
        except (ColibriError, OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ValueError(f"{path}: routing history is unreadable and is ignored ({exc})") from None
        if data.get("family") != self.family or counts.shape != self.shape:
            raise ValueError(f"{path}: routing history is for family {data.get('family')!r} with shape "
                             f"{list(counts.shape)}, not {self.family!r} {list(self.shape)}; refused")
        if not np.all(np.isfinite(counts)) or (counts < 0).any() or not np.isfinite(tokens) or tokens < 0:
            raise ValueError(f"{path}: routing history holds negative or non-finite counts and is ignored")
        return counts, tokens

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
        """Fold this session into the saved counts (saved counts x decay + new) and write
        atomically. The saved counts are read again under the lock, so what concurrent
        runs saved since this one loaded is kept. Returns the path written, or None if
        nothing could be written."""
        if not self.session_tokens:
            return self.path
        for target in save_targets(self.model_dir):
            try:
                counts, tokens = self._merge_into(target, decay)
            except OSError:
                continue
            self.counts, self.tokens, self.path = counts, tokens, target
            self.session = np.zeros(self.shape, dtype=np.float64)
            self.session_tokens = 0
            return target
        warn(f"could not save the routing history next to {self.model_dir} nor in the cache dir")
        return None

    def _merge_into(self, target: Path, decay: float) -> tuple[np.ndarray, float]:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target):
            _remove_stale_temps(target)
            counts, tokens = self.counts, self.tokens  # what this run read, if nothing valid is saved now
            source = self._source()
            if source is not None:
                try:
                    counts, tokens = self._parse(source)
                except ValueError:
                    pass  # reported when it was opened; this save replaces it
            counts = counts * decay + self.session
            tokens = tokens * decay + self.session_tokens
            smallfile.write_atomic(target, json.dumps({
                "format": FORMAT_VERSION, "family": self.family, "model_type": self.model_type,
                "layers": self.shape[0], "experts": self.shape[1], "tokens": tokens,
                "counts": [[round(float(c), 4) for c in row] for row in counts],
            }))
        return counts, tokens


@contextmanager
def _locked(path: Path):
    """An exclusive ``fcntl`` lock on ``.NAME.lock`` beside ``path``, held for the block
    (released by the kernel if the process dies)."""
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _remove_stale_temps(path: Path) -> None:
    """Remove ``.NAME.tmp-PID`` files of writers that died mid-save (their PID is gone)."""
    prefix = f".{path.name}.tmp-"
    for tmp in path.parent.glob(f"{prefix}*"):
        pid = tmp.name[len(prefix):]
        if pid.isdigit() and not _pid_alive(int(pid)):
            try:
                tmp.unlink()
            except OSError:
                pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True
