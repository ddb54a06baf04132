"""Chat templates (jinja2, from ``tokenizer_config.json`` or ``chat_template.jinja``),
rendered in a sandbox whose work is bounded.

A template is untrusted code. jinja2's sandbox keeps it from reaching Python objects and
refuses a ``range`` above 100,000 items (with an OverflowError), but lets a template run
nested loops for hours, raise ``9 ** 9 ** 9`` (an integer of 370 million digits) or
repeat a string a billion times. Here:

- the template's own Python lines are counted while it renders (a trace function on its
  frames only, so the rest of colibri runs untraced) and rendering stops after
  MAX_STEPS of them: a real template takes a few hundred per message;
- ``*`` and ``**`` are checked before they run: no sequence longer than MAX_CHARS, no
  integer power above MAX_EXPONENT;
- the output is at most MAX_CHARS characters;

and every failure (a refusal, the sandbox's OverflowError, a template error) is one
error naming the template's file.
"""

from __future__ import annotations

import json
import operator
import sys
from datetime import datetime
from typing import Any

from colibri_core.errors import ModelFormatError, UsageError

MAX_STEPS = 10_000_000  # template lines executed per render (a 1000-message chat needs well under 1%)
MAX_CHARS = 1 << 26  # characters in the output and in any string or list the template builds
MAX_EXPONENT = 256  # largest integer exponent of ``**`` (floats are bounded by themselves)


class _TooMuchWork(Exception):
    pass


def _sandbox():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, op, left, right):
            if op == "**":
                if isinstance(left, int) and isinstance(right, int) and abs(right) > MAX_EXPONENT and abs(left) > 1:
                    raise _TooMuchWork(f"{left} ** {right} is a larger number than a chat template needs")
                return operator.pow(left, right)
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * max(n, 0) > MAX_CHARS:
                    raise _TooMuchWork(f"repeating a {type(seq).__name__} {n} times builds more than {MAX_CHARS} items")
            return operator.mul(left, right)

    return BoundedSandbox


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str], origin: str):
        from jinja2 import TemplateError

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = _sandbox()(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.origin = origin
        self.source = source  # the template's text: servers read its tool-call convention from it
        self.special = special
        try:
            self.template = env.from_string(source)
        except TemplateError as exc:
            raise ModelFormatError(f"{origin}: chat template does not compile: {exc}") from None
        except (RecursionError, MemoryError):
            raise ModelFormatError(f"{origin}: chat template is nested too deeply to compile") from None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra) -> str:
        from jinja2 import TemplateError

        try:
            return self._bounded_render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special, **extra)
        except TemplateError as exc:
            raise UsageError(f"{self.origin}: chat template refused the conversation: {exc}") from None
        except _TooMuchWork as exc:
            raise ModelFormatError(f"{self.origin}: chat template stopped: {exc}") from None
        except OverflowError as exc:  # the sandbox's range limit, or a float overflow
            raise ModelFormatError(f"{self.origin}: chat template stopped: {exc}") from None
        except (RecursionError, MemoryError) as exc:
            raise ModelFormatError(f"{self.origin}: chat template stopped: it ran out of "
                                   f"{'stack' if isinstance(exc, RecursionError) else 'memory'}") from None

    def _bounded_render(self, **variables) -> str:
        code = self.template.root_render_func.__code__.co_filename  # "<template>": the template's own frames
        steps = 0

        def count(frame, event, arg):
            nonlocal steps
            if event == "line":
                steps += 1
                if steps > MAX_STEPS:
                    raise _TooMuchWork(f"it ran more than {MAX_STEPS} steps (an endless or enormous loop)")
            return count

        def enter(frame, event, arg):
            return count if frame.f_code.co_filename == code else None  # other code runs untraced

        previous = sys.gettrace()
        sys.settrace(enter)
        try:
            pieces, size = [], 0
            for piece in self.template.generate(**variables):
                size += len(piece)
                if size > MAX_CHARS:
                    raise _TooMuchWork(f"its output passed {MAX_CHARS} characters")
                pieces.append(piece)
        finally:
            sys.settrace(previous)
        return "".join(pieces)
