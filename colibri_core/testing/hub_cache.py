"""A Hugging Face hub cache laid out as ``huggingface_hub`` leaves it after a download,
for tests of ``--model ORG/NAME`` and of snapshot directories: ``models--ORG--NAME/``
with ``blobs/HASH``, ``snapshots/REV/NAME -> ../../blobs/HASH`` and ``refs/main``."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

REVISION = "0123456789abcdef0123456789abcdef01234567"


def make_hub_repo(model_dir: Path, cache: Path, repo_id: str = "org/name", revision: str = REVISION) -> tuple[Path, Path]:
    """Put the files of ``model_dir`` into the hub cache ``cache`` as ``repo_id`` at
    ``revision`` (which ``refs/main`` names); returns (repo root, snapshot directory)."""
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for f in sorted(Path(model_dir).iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / digest)
        os.symlink(f"../../blobs/{digest}", snapshot / f.name)
    return repo, snapshot


def hub_env(cache: Path, **extra) -> dict[str, str]:
    """Environment for a colibri process that finds repos in ``cache`` and could not
    download: HF_ENDPOINT names a closed local port, and HF_HUB_OFFLINE stays unset so
    that only colibri's own offline lookup keeps it from trying."""
    return {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": "http://127.0.0.1:9", **extra}
