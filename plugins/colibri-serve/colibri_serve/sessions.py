"""Saved chat sessions: ``colibri chat --session NAME`` resumes a conversation warm.

A session is two files in the sessions directory (``--sessions-dir``, default colibri's
data dir): ``NAME.json``, the conversation (its messages, the model's identity, and the
digest the state file records over its content), and ``NAME.state``, the conversation's cache as a saved
sequence state (colibri_core.engine.state: every layer's keys, values, latents or
recurrent states, checked on reading). Resuming binds the state to the model and the
next turn continues it: only the new message is computed, and the replies are those
the chat would have given had it never stopped.

Each file is written atomically, the state first; a lock file (``NAME.lock``, held while
a chat has the session open) keeps two chats from writing one session. A conversation
whose state file is missing, damaged or of another model is refused with one line naming
the file: never a continuation on the wrong state.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from colibri_core.errors import ModelFormatError, UsageError

FORMAT = "colibri-chat-session"
VERSION = 1
CONVERSATION_BYTES = 64 << 20  # NAME.json: the messages' text, far below what would hurt
ROLES = ("system", "user", "assistant")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def default_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_data_dir("colibri")) / "sessions"


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise UsageError(f"--session {name!r}: a session name is 1 to 100 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return name


@dataclass
class SavedConversation:
    """What ``NAME.json`` holds, checked."""

    system: str | None
    messages: list[dict]
    model: dict  # colibri_core.engine.state.model_identity
    state_sha256: str | None  # the digest NAME.state records (document + data), None without a state


class SessionStore:
    """One named session in a directory: ``lock`` it, ``read`` the conversation, ``bind``
    its state to the loaded model, ``save`` both."""

    def __init__(self, directory: str | os.PathLike | None, name: str):
        self.name = check_name(name)
        self.dir = Path(directory).expanduser() if directory is not None else default_dir()
        self.conversation_path = self.dir / f"{name}.json"
        self.state_path = self.dir / f"{name}.state"
        self._lock_fd: int | None = None

    # -- the lock -------------------------------------------------------------------
    def lock(self) -> None:
        """Hold ``NAME.lock`` until ``close``: a second chat on the session is refused."""
        import fcntl

        if self.dir.exists() and not self.dir.is_dir():
            raise UsageError(f"--sessions-dir {self.dir}: not a directory")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir / f"{self.name}.lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as exc:
            raise UsageError(f"--sessions-dir {self.dir}: cannot keep sessions there: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise UsageError(f"session {self.name!r} is open in another colibri chat ({self.dir / self.name}.lock)") from None
        self._lock_fd = fd

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the lock
            self._lock_fd = None

    # -- reading --------------------------------------------------------------------
    def read(self) -> SavedConversation | None:
        """The saved conversation, checked; None for a new session."""
        from colibri_core.io import smallfile

        path = self.conversation_path
        if not smallfile.present(path):
            return None
        doc = smallfile.read_json(path, CONVERSATION_BYTES, "saved chat session")
        return _check(doc, path)

    def bind(self, saved: SavedConversation, model):
        """The saved state as a KeptSequence of ``model`` (its identity, the file's digest,
        every layer's shapes checked), or None when the conversation has none."""
        from colibri_core.engine.scheduler import KeptSequence
        from colibri_core.engine.state import bind, model_identity, read_state

        mine = model_identity(model)
        if saved.model["sha256"] != mine["sha256"]:
            raise UsageError(f"{self.conversation_path}: session {self.name!r} was saved with another model "
                             f"({saved.model['dir']}, model_type {saved.model['model_type']}); continue it with that "
                             f"model or choose another --session name")
        if saved.state_sha256 is None:
            return None
        from colibri_core.engine.state import file_digest
        from colibri_core.io import smallfile

        if not smallfile.present(self.state_path):
            raise ModelFormatError(f"{self.state_path}: the session's saved state is missing: remove the session's "
                                   ".json to start anew")
        if file_digest(self.state_path) != saved.state_sha256:
            raise ModelFormatError(f"{self.state_path}: does not match {self.conversation_path.name} (another "
                                   "session's state, or changed since): remove both files to start the session anew")
        state = read_state(self.state_path)
        cache = bind(state, model)
        return KeptSequence(cache, list(state.token_ids))

    # -- writing --------------------------------------------------------------------
    def save(self, model, system: str | None, messages: list[dict], kept, sampling) -> int:
        """Write the conversation and (when ``kept``, a KeptSequence) its state; returns the
        bytes written."""
        import json

        from colibri_core.engine.sampling import Sampler
        from colibri_core.engine.state import capture, file_digest, model_identity
        from colibri_core.errors import write_error
        from colibri_core.io import smallfile

        size, digest = 0, None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if kept is not None:
                ids = kept.token_ids
                state = capture(model, kept.cache, ids, len(ids) - 1, sampling, False, Sampler(sampling))
                size = state.save(self.state_path)  # its own errors are one line already
                digest = file_digest(self.state_path)
            elif self.state_path.exists():
                self.state_path.unlink()
            text = json.dumps({"format": FORMAT, "version": VERSION, "model": model_identity(model), "system": system,
                               "messages": messages, "state_sha256": digest}, ensure_ascii=False, indent=1)
            smallfile.write_atomic(self.conversation_path, text)
        except OSError as exc:  # a full disk: one line, not a traceback (the conversation so far is still on screen)
            raise write_error(exc, exc.filename or self.conversation_path, f"session {self.name!r}") from None
        return size + len(text.encode("utf-8"))


def _check(doc, path: Path) -> SavedConversation:
    def fail(what: str):
        return ModelFormatError(f"{path}: saved chat session {what}")

    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise fail(f"is not a {FORMAT} document")
    if doc.get("version") != VERSION:
        raise fail(f"has version {doc.get('version')!r}; this colibri reads version {VERSION}")
    keys = {"format", "version", "model", "system", "messages", "state_sha256"}
    if set(doc) != keys:
        raise fail(f"has keys {sorted(doc)}, expected {sorted(keys)}")
    model = doc["model"]
    if not (isinstance(model, dict) and set(model) == {"sha256", "model_type", "dir"}
            and all(isinstance(v, str) for v in model.values())):
        raise fail("model must be {sha256, model_type, dir} strings")
    system = doc["system"]
    if system is not None and not isinstance(system, str):
        raise fail("system must be a string or null")
    messages = doc["messages"]
    if not isinstance(messages, list):
        raise fail("messages must be a list")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in ROLES
                and isinstance(m["content"], str)):
            raise fail(f"message {i} must be {{role: {'|'.join(ROLES)}, content: a string}}")
    digest = doc["state_sha256"]
    if digest is not None and not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        raise fail("state_sha256 must be a SHA-256 in hex or null")
    return SavedConversation(system, messages, model, digest)
