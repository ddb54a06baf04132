"""Parsing untrusted JSON: every failure, nesting too deep for the parser included, is a
ModelFormatError naming the file.

Python's json module recurses once per nesting level, so an array nested tens of
thousands deep raises RecursionError, not a JSONDecodeError; no config, index, header
or history we read nests more than a handful of levels.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from colibri_core.errors import ModelFormatError


def parse_json(text: str | bytes, where: str, *, object_pairs_hook: Callable | None = None,
               parse_int: Callable | None = None) -> Any:
    """``text`` parsed; ``where`` (a path, or "path: header") names it in errors. The hooks
    are json.loads's; one raising ValueError makes the text invalid JSON."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, object_pairs_hook=object_pairs_hook, parse_int=parse_int)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError among them
        raise ModelFormatError(f"{where}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ModelFormatError(f"{where}: JSON nested too deeply to be a real file (damaged or hostile)") from None
