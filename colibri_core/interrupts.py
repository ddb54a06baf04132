"""Ctrl-C that is never lost.

Python raises KeyboardInterrupt in whatever Python code runs when SIGINT arrives. When
that code is a finalizer (a ``__del__``, a weakref callback: colibri's own, a library's),
Python prints "Exception ignored" and drops the exception, and the run goes on as if no
key had been pressed. (The expert buffers, released on every eviction, run no Python
code when they die, see ``io.buffers``; other finalizers remain.) The command line
installs ``install()``'s handler, which also records the signal; the generation loop
calls ``check()`` once per step, which raises the KeyboardInterrupt a finalizer
swallowed, also one swallowed while the model loaded. Without the handler (colibri used
as a library) ``check()`` does nothing."""

from __future__ import annotations

import signal
import threading

_pending = False


def _on_sigint(signum, frame):
    global _pending
    _pending = True
    raise KeyboardInterrupt


def install() -> None:
    """Handle SIGINT as Python does, and remember it (main thread only, as signals are)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _on_sigint)


def clear() -> None:
    """Forget a Ctrl-C already dealt with (its KeyboardInterrupt was caught)."""
    global _pending
    _pending = False


def check() -> None:
    """Raise the KeyboardInterrupt of a Ctrl-C that never arrived as one."""
    if _pending and threading.current_thread() is threading.main_thread():
        clear()
        raise KeyboardInterrupt
