"""Reading the small files of a model directory and of colibri's own state: config.json,
generation_config.json, the safetensors index, tokenizer.json, tokenizer_config.json,
chat templates, colibri's manifests and routing histories.

Every one is read through ``read_bytes`` (or ``read_text`` / ``read_json``), which takes
only a regular file and never more than a limit chosen per kind of file. A model
directory is untrusted: ``config.json`` linked to /dev/zero would be read until the
kernel kills the process, a FIFO would block the open forever, and a directory or a
symlink loop would raise an OSError no caller expects. So the path is stat-ed (links
followed) before anything opens it, opened non-blocking (a file swapped for a FIFO
between the two cannot hang the open), checked again on the open descriptor, and read to
at most the limit plus one byte (a file that grows past its size, or a /proc file whose
size reads 0, is still bounded).

colibri's own small files (manifests, routing histories) are written with
``write_atomic``: whole or not at all.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any, Callable

from colibri_core.errors import ModelFormatError
from colibri_core.io.jsontext import parse_json

# limits per kind of file: generous for real files, far below what would hurt
CONFIG_BYTES = 16 << 20  # config.json, generation_config.json, tokenizer_config.json
INDEX_BYTES = 64 << 20  # model.safetensors.index.json: one line per tensor
TOKENIZER_BYTES = 256 << 20  # tokenizer.json: the largest vocabularies are tens of MB
TEMPLATE_BYTES = 4 << 20  # chat_template.jinja
MANIFEST_BYTES = 256 << 20  # colibri's own manifests: a digest per tensor

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def present(path: str | os.PathLike) -> bool:
    """Whether anything is at ``path``, a broken or looping symlink included: such a name is
    read (and refused with a reason), not silently taken for an absent optional file as
    ``Path.exists`` would."""
    return os.path.lexists(path)


def check_regular(path: str | os.PathLike, what: str = "file") -> os.stat_result:
    """``path``'s stat (links followed) if it is a regular file; else a ModelFormatError
    naming it and saying what it is. Opens nothing."""
    st, problem = _stat(path)
    if problem is not None:
        raise ModelFormatError(f"{path}: {what} {problem}")
    return st


def why_not_regular(path: str | os.PathLike) -> str | None:
    """None if ``path`` is a regular file (links followed), else why not, as a predicate:
    "is a named pipe (FIFO), not a regular file", "not found", ... Opens nothing."""
    return _stat(path)[1]


def read_bytes(path: str | os.PathLike, limit: int, what: str = "file") -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them (a larger file
    is a ModelFormatError naming it)."""
    st = check_regular(path, what)
    if st.st_size > limit:
        raise _too_large(path, what, limit)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ModelFormatError(f"{path}: {what} {_os_problem(exc)}") from None
    try:
        problem = _mode_problem(path, os.fstat(fd).st_mode)  # what was opened, should the name have changed meanwhile
        if problem is not None:
            raise ModelFormatError(f"{path}: {what} {problem}")
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(limit + 1 - total, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    except OSError as exc:
        raise ModelFormatError(f"{path}: {what} {_os_problem(exc)}") from None
    finally:
        os.close(fd)
    if total > limit:
        raise _too_large(path, what, limit)
    return b"".join(chunks)


def read_text(path: str | os.PathLike, limit: int, what: str = "file") -> str:
    """``read_bytes`` decoded as UTF-8 (an error naming the file otherwise)."""
    data = read_bytes(path, limit, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelFormatError(f"{path}: {what} is not UTF-8 text (byte {exc.start})") from None


def read_json(path: str | os.PathLike, limit: int, what: str = "file", *,
              object_pairs_hook: Callable | None = None) -> Any:
    """``read_bytes`` parsed as JSON (any value; callers check its shape)."""
    return parse_json(read_bytes(path, limit, what), str(path), object_pairs_hook=object_pairs_hook)


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all: into ``.NAME.tmp-PID``
    beside it, synced to the disk, then renamed over it, so a reader never sees half a
    file; the temporary file is removed if anything fails (the exception is raised)."""
    path = Path(path)
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


def _stat(path) -> tuple[os.stat_result | None, str | None]:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            return None, f"is a broken symlink (to {os.readlink(path)})"
        return None, "not found"
    except OSError as exc:
        return None, _os_problem(exc)
    return st, _mode_problem(path, st.st_mode)


def _mode_problem(path, mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "a special file")
    target = f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else ""
    return f"is {kind}{target}, not a regular file"


def _os_problem(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "is a symlink loop (too many levels of symbolic links)"
    if exc.errno == errno.ENOTDIR:
        return "not found (a parent is not a directory)"
    return f"cannot be read: {exc.strerror or exc}"


def _too_large(path, what: str, limit: int) -> ModelFormatError:
    return ModelFormatError(f"{path}: {what} is larger than {limit} bytes, too large to be real (damaged or hostile)")
