"""Models in the Hugging Face hub cache.

``huggingface_hub`` keeps a repository as ``models--ORG--NAME/`` holding ``blobs/``
(files named by their hash), ``snapshots/REV/`` (the repository's file names, each a
symlink to ``../../blobs/HASH``) and ``refs/main`` (the revision ``main`` points at). A
snapshot directory is an ordinary model directory whose files are symlinks; the repo
root is accepted as ``--model`` too and stands for the snapshot ``refs/main`` names (or
``--revision``'s). A repo id (``org/name``) is looked up in the local hub cache through
``huggingface_hub``, never downloaded. Snapshot files belong to ``huggingface_hub``:
colibri keeps its own state for them (the routing history) in its cache dir.
"""

from __future__ import annotations

import re
from pathlib import Path

from colibri_core.errors import ModelFormatError, UsageError

_REVISION = re.compile(r"^[0-9A-Za-z._-]{1,128}$")


def model_directory(path: str | Path) -> Path:
    """``path`` itself, or, for a hub cache repo root (``refs/main`` and ``snapshots/``, no
    ``config.json``), the snapshot directory ``refs/main`` names."""
    path = Path(path)
    ref = path / "refs" / "main"
    if (path / "config.json").exists() or not ref.is_file() or not (path / "snapshots").is_dir():
        return path
    return _snapshot_for_ref(path, ref)


def _snapshot_for_ref(root: Path, ref: Path) -> Path:
    """The snapshot directory the ref file ``ref`` of the repo ``root`` names."""
    try:
        revision = ref.read_text(encoding="utf-8", errors="strict").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{ref}: unreadable ({exc})") from None
    if not _REVISION.match(revision) or revision in (".", ".."):
        raise ModelFormatError(f"{ref}: {revision[:80]!r} is not a revision")
    snapshot = root / "snapshots" / revision
    if not snapshot.is_dir():
        raise ModelFormatError(f"{ref} names revision {revision} but {snapshot} is missing: download that revision again")
    return snapshot


# what huggingface_hub accepts as a repo id: NAME or ORG/NAME, no "..", no leading "."
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9_][A-Za-z0-9_.-]{0,95}$")


def is_repo_root(path: Path) -> bool:
    """Whether ``path`` is a hub cache repo root (``models--ORG--NAME``)."""
    return not (path / "config.json").exists() and (path / "refs").is_dir() and (path / "snapshots").is_dir()


def _revision_snapshot(root: Path, revision: str) -> Path:
    """The snapshot of the hub cache repo ``root`` at a branch or tag (``refs/REVISION``)
    or a downloaded commit (``snapshots/REVISION``)."""
    if not is_repo_root(root):
        raise UsageError(f"--revision {revision}: {root} is a model directory; --revision picks a snapshot of a Hugging "
                         "Face repo id or of a hub cache repo (models--ORG--NAME)")
    if not _REVISION.match(revision) or revision in (".", ".."):
        raise UsageError(f"--revision: {revision[:80]!r} is not a revision")
    if (root / "refs" / revision).is_file():
        return _snapshot_for_ref(root, root / "refs" / revision)
    snapshot = root / "snapshots" / revision
    if not snapshot.is_dir():
        raise UsageError(f"--revision {revision}: {root} has no branch, tag or downloaded commit of that name "
                         f"(downloaded: {', '.join(sorted(p.name for p in (root / 'snapshots').iterdir())) or 'none'})")
    return snapshot


def resolve_model(value: str | Path, revision: str | None = None) -> Path:
    """The local directory ``--model VALUE [--revision REV]`` names: a path that exists
    (with ``revision``, a hub cache repo root's snapshot), else, for a repo id, its
    snapshot in the local Hugging Face cache (``HF_HUB_CACHE``). Never downloads: a repo
    that is not in the cache is a UsageError saying how to fetch it. Other paths come
    back as given, for the caller to report missing."""
    path = Path(value)
    if path.exists() or path.is_symlink():
        return _revision_snapshot(path, revision) if revision is not None else path
    if not _REPO_ID.match(str(value)) or ".." in str(value):
        if revision is not None:
            raise UsageError(f"--revision {revision}: --model {value} does not exist")
        return path
    return cached_snapshot(str(value), revision)


def cached_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot directory of ``repo_id`` at ``revision`` (default: main) in the local
    Hugging Face cache, looked up offline."""
    from huggingface_hub import constants, errors, snapshot_download

    at = f" at revision {revision}" if revision else ""
    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True)
    except (errors.LocalEntryNotFoundError, errors.HFValidationError, OSError) as exc:
        incomplete = isinstance(exc, getattr(errors, "IncompleteSnapshotError", ()))  # newer huggingface_hub only
        problem = (f"its snapshot{at} in the Hugging Face cache ({constants.HF_HUB_CACHE}) is incomplete"
                   if incomplete else
                   f"no such directory, and no snapshot of the Hugging Face repo {repo_id}{at} in the local cache "
                   f"({constants.HF_HUB_CACHE})")
        raise UsageError(f"--model {repo_id}: {problem}; colibri does not download models: fetch it with "
                         f"`hf download {repo_id}" + (f" --revision {revision}" if revision else "") + "`") from None
    return Path(folder)


def hub_repo_id(path: str | Path) -> str | None:
    """The repo id (``org/name``) whose snapshot directory ``path`` is
    (``models--ORG--NAME/snapshots/REV``, as given or with links resolved), else None."""
    path = Path(path)
    candidates = [path.absolute()]
    try:
        candidates.append(path.resolve())
    except (OSError, RuntimeError):  # a symlink loop: not a snapshot then
        pass
    for p in candidates:
        repo = p.parent.parent.name
        if p.parent.name == "snapshots" and repo.startswith("models--") and len(repo) > len("models--"):
            return repo.removeprefix("models--").replace("--", "/")  # repo ids never hold "--"
    return None
