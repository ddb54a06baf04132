"""Models in the Hugging Face hub cache.

``huggingface_hub`` keeps a repository as ``models--ORG--NAME/`` holding ``blobs/``
(files named by their hash), ``snapshots/REV/`` (the repository's file names, each a
symlink to ``../../blobs/HASH``) and ``refs/main`` (the revision ``main`` points at). A
snapshot directory is an ordinary model directory whose files are symlinks; the repo
root is accepted as ``--model`` too and stands for the snapshot ``refs/main`` names.
"""

from __future__ import annotations

import re
from pathlib import Path

from colibri_core.errors import ModelFormatError

_REVISION = re.compile(r"^[0-9A-Za-z._-]{1,128}$")


def model_directory(path: str | Path) -> Path:
    """``path`` itself, or, for a hub cache repo root (``refs/main`` and ``snapshots/``, no
    ``config.json``), the snapshot directory ``refs/main`` names."""
    path = Path(path)
    ref = path / "refs" / "main"
    if (path / "config.json").exists() or not ref.is_file() or not (path / "snapshots").is_dir():
        return path
    try:
        revision = ref.read_text(encoding="utf-8", errors="strict").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{ref}: unreadable ({exc})") from None
    if not _REVISION.match(revision) or revision in (".", ".."):
        raise ModelFormatError(f"{ref}: {revision[:80]!r} is not a revision")
    snapshot = path / "snapshots" / revision
    if not snapshot.is_dir():
        raise ModelFormatError(f"{ref} names revision {revision} but {snapshot} is missing: download that revision again")
    return snapshot
