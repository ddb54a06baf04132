"""Tokenizer (``tokenizer.json`` through the tokenizers library) and chat template
(``tokenizer_config.json`` or ``chat_template.jinja``, rendered with jinja2)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from colibri_core.model.config import read_json
from colibri_core.errors import ModelFormatError, UsageError


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str], origin: str):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
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

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra) -> str:
        from jinja2 import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special, **extra)
        except TemplateError as exc:
            raise UsageError(f"{self.origin}: chat template refused the conversation: {exc}") from None


class Tokenizer:
    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = model_dir / "tokenizer.json"
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises its own exception types
            raise ModelFormatError(f"{path}: cannot load tokenizer: {exc}") from None
        config_path = model_dir / "tokenizer_config.json"
        self.config = read_json(config_path, "tokenizer config") if config_path.exists() else {}
        self.special = {k: _token_text(self.config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.special = {k: v for k, v in self.special.items() if v is not None}
        self.chat_template = self._load_template(model_dir)

    @classmethod
    def from_dir(cls, model_dir: Path) -> "Tokenizer | None":
        return cls(model_dir) if (model_dir / "tokenizer.json").exists() else None

    def _load_template(self, model_dir: Path) -> ChatTemplate | None:
        jinja_path = model_dir / "chat_template.jinja"
        if jinja_path.exists():
            return ChatTemplate(jinja_path.read_text(encoding="utf-8"), self.special, str(jinja_path))
        source = self.config.get("chat_template")
        origin = str(model_dir / "tokenizer_config.json")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        if source is None:
            return None
        if not isinstance(source, str):
            raise ModelFormatError(f"{origin}: chat_template must be a string")
        return ChatTemplate(source, self.special, origin)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise UsageError("this model has no chat template (tokenizer_config.json chat_template or chat_template.jinja)")
        return self.chat_template.render(messages, add_generation_prompt)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class StreamDecoder:
    """Turns a growing list of token ids into text deltas. Text is emitted only once
    it is complete: a multi-byte character split across tokens waits for its end."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the window decoded for context
        self.read = 0  # ids before this have been emitted

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        now = self.tokenizer.decode(self.ids[self.prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before) :]
        return ""

    def flush(self) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        now = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(before) :]
