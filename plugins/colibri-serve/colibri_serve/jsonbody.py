"""Request bodies read by colibri rather than by FastAPI: JSON whether or not the request
says so, with errors that say what is wrong (not valid JSON and where, a lone surrogate
and in which field, a body that is not JSON at all) in the calling API's error shape."""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute

from colibri_serve.service import ApiError

# JSON may escape a lone UTF-16 surrogate ("\ud800"); it is no Unicode character, so
# text that holds one can be neither encoded nor tokenised
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value: Any) -> tuple[str, int] | None:
    """The first place in a decoded JSON value with a lone surrogate, as the APIs name
    fields ("messages[0].content"; "" for the whole body), and the surrogate; else None."""
    stack = [("", value)]
    while stack:  # not recursive: the nesting is as deep as the client made it
        where, item = stack.pop()
        if isinstance(item, str):
            found = _SURROGATE.search(item)
            if found:
                return where, ord(found.group())
        elif isinstance(item, dict):
            for key in item:
                found = _SURROGATE.search(key)
                if found:
                    return where, ord(found.group())
            stack.extend((f"{where}.{key}" if where else key, v) for key, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(item))))
    return None


def parse_body(body: bytes) -> Any:
    """The request body as JSON, or an ApiError that says what is wrong with it."""
    if not body.strip():
        raise ApiError("bad_request", "the request body is empty: send a JSON object")
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        raise ApiError("bad_request", f"the body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except UnicodeDecodeError as exc:
        raise ApiError("bad_request", f"the body is not valid JSON: not UTF-8 text (byte {exc.start})") from None
    except RecursionError:
        raise ApiError("bad_request", "the body is not valid JSON: nested too deeply") from None
    found = lone_surrogate(value)
    if found is not None:
        where, code = found
        raise ApiError("bad_request", f"{where or 'the body'}: a lone surrogate (\\u{code:04x}) is not valid Unicode text",
                       param=where or None)
    return value


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


class _JsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_parsed"):
            self._parsed = parse_body(await self.body())
        return self._parsed


class JsonRoute(APIRoute):
    """A route whose body colibri parses: FastAPI would read a body without a
    Content-Type as bytes ("Input should be a valid dictionary"), report bad JSON as
    "1: JSON decode error", and pass a lone surrogate on to fail in the tokenizer."""

    def get_route_handler(self):
        handle = super().get_route_handler()
        if self.body_field is None:
            return handle

        async def route(request: Request):
            content_type = request.headers.get("content-type")
            if content_type and not _is_json(content_type):
                # a browser sends form and text/plain bodies to any site without asking it
                # first (no CORS preflight): reading them as JSON would let any web page
                # run the model on a server on this machine
                raise ApiError("bad_request", f"the body must be JSON sent with Content-Type: application/json, "
                                              f"not {content_type.split(';', 1)[0].strip()}")
            scope = request.scope
            if not content_type:  # a JSON API: a body without a type is JSON (FastAPI would not parse it)
                scope = {**scope, "headers": [*scope["headers"], (b"content-type", b"application/json")]}
            request = _JsonRequest(scope, request.receive)
            # parsed now, so that its errors are raised here, in the API's shape
            if not isinstance(await request.json(), dict):
                raise ApiError("bad_request", "the body must be a JSON object")
            return await handle(request)

        return route
