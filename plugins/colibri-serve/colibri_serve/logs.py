"""The server's log, through the ``logging`` module: a line when the model has loaded
(``colibri.serve``) and one per request (``colibri.serve.access``: method, path, status,
tokens, time), both at info, on stderr. ``--log-level`` (or ``COLIBRI_LOG_LEVEL``) sets
the level."""

from __future__ import annotations

import logging
import sys
from contextvars import ContextVar

LEVELS = ("debug", "info", "warning", "error")
log = logging.getLogger("colibri.serve")
access_log = logging.getLogger("colibri.serve.access")

# the request being answered: what the route learnt of it for its access line (its tokens).
# A dict the gate sets per request; tasks the request starts share it (contexts are copied,
# the dict is not).
REQUEST: ContextVar[dict | None] = ContextVar("colibri_serve_request", default=None)


def configure(level: str) -> None:
    """Send the server's log lines to stderr at ``level`` and above."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False  # an embedding application's root handlers would print each line twice


def uvicorn_level(level: str) -> str:
    """uvicorn's own level: its info lines ("Started server process", "Uvicorn running
    on") repeat what colibri says, so they show at debug only."""
    return level if level in ("debug", "error") else "warning"


def note_tokens(prompt: int, completion: int) -> None:
    """Record the tokens of the request being answered, for its access line."""
    record = REQUEST.get()
    if record is not None:
        record["tokens"] = (prompt, completion)


def access(scope, status: int, seconds: float, record: dict) -> None:
    if not access_log.isEnabledFor(logging.INFO):
        return
    client = scope.get("client")
    who = f"{client[0]}:{client[1]}" if client else "-"
    tokens = record.get("tokens")
    counted = f" prompt_tokens={tokens[0]} completion_tokens={tokens[1]}" if tokens else ""
    access_log.info('%s "%s %s" %d%s time=%.3fs', who, scope["method"], scope["path"], status, counted, seconds)
