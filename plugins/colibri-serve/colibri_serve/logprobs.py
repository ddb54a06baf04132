"""OpenAI's logprobs, logit_bias, frequency / presence penalties and response_format in
the serving APIs: a request's fields checked (a 400 naming the field) and turned into the
engine's sampling parameters (colibri_core.engine.sampling), and the engine's
``TokenLogprob``s written in the chat and the legacy completions shapes."""

from __future__ import annotations

import codecs
from typing import Any, Callable

from colibri_serve.service import ApiError

def logit_bias(raw: dict[str, Any] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids written as strings -> a bias from -100 to 100)
    as the engine takes it."""
    if not raw:
        return None
    out = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit()):
            raise ApiError("bad_request", f"logit_bias: keys are token ids written as strings of digits, got {key!r}",
                           param="logit_bias")
        if len(key) > 12 or int(key) >= vocab_size:  # 12 digits: int() of a huge key costs time
            raise ApiError("bad_request", f"logit_bias: token id {key} is outside the vocabulary (0..{vocab_size - 1})",
                           param="logit_bias")
        # a range check, not math.isfinite: JSON's 1e999 is inf, its 10**400 an int no float holds; NaN fails it too
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise ApiError("bad_request", f"logit_bias: the bias of token {key} must be a number from -100 to 100, "
                                          f"got {value!r}", param="logit_bias")
        out[int(key)] = float(value)
    return out


def chat_logprobs(logprobs: bool | None, top_logprobs: int | None) -> int | None:
    """The engine's ``logprobs`` (alternatives per token, None: none) for a chat request."""
    if top_logprobs is not None and not logprobs:
        raise ApiError("bad_request", "top_logprobs: needs logprobs: true", param="top_logprobs")
    return (top_logprobs or 0) if logprobs else None


def response_constraint(response_format: dict[str, Any] | None):
    """OpenAI's ``response_format`` as what the reply must fit: None for plain text, else a
    ``ConstraintSpec`` (``json_object``: any JSON object; ``json_schema``: its ``schema``)."""
    from colibri_core.engine.constraints import ConstraintSpec

    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ApiError("bad_request", "response_format must be an object", param="response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ConstraintSpec.json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise ApiError("bad_request", "response_format.json_schema must be an object with a 'schema' object",
                           param="response_format")
        name = spec.get("name")
        label = f"response_format.json_schema {name!r}" if isinstance(name, str) and name else "response_format.json_schema"
        # no schema: any JSON value (OpenAI requires one; a missing one is taken as "anything JSON")
        return ConstraintSpec.json_schema(spec.get("schema", {}), name=label)
    raise ApiError("bad_request", f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format")


class LogprobWriter:
    """The engine's TokenLogprobs in OpenAI's shapes, for one choice. Streaming calls it
    once per chunk with the tokens since the last: the legacy shape's ``text_offset``
    runs on across calls."""

    def __init__(self, token_bytes: Callable[[int], bytes | None]):
        self.token_bytes = token_bytes  # None: the model has no tokenizer
        self.offset = 0  # characters of the completion before the next token
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _token(self, token_id: int) -> tuple[str, bytes | None]:
        raw = self.token_bytes(token_id)
        if raw is None:  # vLLM's spelling of a token it has no text for
            return f"token_id:{token_id}", None
        # a token that is part of a character: its bytes escaped, as OpenAI writes them
        return raw.decode("utf-8", errors="backslashreplace"), raw

    def _entry(self, token_id: int, logprob: float) -> dict:
        text, raw = self._token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw) if raw is not None else None}

    def chat(self, entries) -> dict:
        """``choices[].logprobs`` of a chat completion (or chunk)."""
        return {"content": [{**self._entry(e.token_id, e.logprob), "top_logprobs": [self._entry(i, lp) for i, lp in e.top]}
                            for e in entries], "refusal": None}

    def completion(self, entries) -> dict:
        """``choices[].logprobs`` of a legacy completion (or chunk): the tokens, their
        logprobs, the most likely tokens' (and the chosen one's) by text, and where each
        token's text starts in the completion (a token that ends inside a character starts
        where that character does)."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for e in entries:
            text, raw = self._token(e.token_id)
            tokens.append(text)
            token_logprobs.append(e.logprob)
            top = {self._token(i)[0]: lp for i, lp in e.top}
            top.setdefault(text, e.logprob)
            top_logprobs.append(top)
            offsets.append(self.offset)
            if raw is not None:
                self.offset += len(self._utf8.decode(raw))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
