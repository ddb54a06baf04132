"""Tokenizer (``tokenizer.json`` through the tokenizers library) and where its chat
template comes from (``tokenizer_config.json`` or ``chat_template.jinja``; rendered by
``colibri_core.model.chat_template``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from colibri_core.io import smallfile
from colibri_core.model.chat_template import ChatTemplate
from colibri_core.model.config import read_json
from colibri_core.errors import ModelFormatError, UsageError


class Tokenizer:
    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = model_dir / "tokenizer.json"
        # read by us, not by the library: a FIFO or /dev/zero named tokenizer.json is refused, not read forever
        text = smallfile.read_text(path, smallfile.TOKENIZER_BYTES, "tokenizer")
        try:
            self._tok = HFTokenizer.from_str(text)
        except Exception as exc:  # the tokenizers library raises its own exception types
            raise ModelFormatError(f"{path}: cannot load tokenizer: {exc}") from None
        config_path = model_dir / "tokenizer_config.json"
        self.config = read_json(config_path, "tokenizer config") if smallfile.present(config_path) else {}
        self.special = {k: _token_text(self.config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        self.special = {k: v for k, v in self.special.items() if v is not None}
        self.chat_template = self._load_template(model_dir)

    @classmethod
    def from_dir(cls, model_dir: Path) -> "Tokenizer | None":
        return cls(model_dir) if smallfile.present(model_dir / "tokenizer.json") else None

    def _load_template(self, model_dir: Path) -> ChatTemplate | None:
        jinja_path = model_dir / "chat_template.jinja"
        if smallfile.present(jinja_path):
            source = smallfile.read_text(jinja_path, smallfile.TEMPLATE_BYTES, "chat template")
            return ChatTemplate(source, self.special, str(jinja_path))
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
        check_text(text, "the prompt")
        # the batch call lets go of the GIL while it works (encode holds it: a long prompt
        # would stall every other thread, a server's event loop included); the fast one
        # also skips the offsets nobody reads
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return batch([text], add_special_tokens=add_special_tokens)[0].ids

    def max_chars_per_token(self) -> int | None:
        """At most how many characters of a text one token stands for; None where the
        tokenizer may drop text, so that no such bound holds (``token_bounds``)."""
        import json

        from colibri_core.model.token_bounds import max_chars_per_token

        if "_max_chars_per_token" not in self.__dict__:
            self._max_chars_per_token = max_chars_per_token(json.loads(self._tok.to_str()))
        return self._max_chars_per_token

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json's text (what llguidance reads)."""
        return self._tok.to_str()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's logprobs ``bytes``). Decoding a token
        alone would turn a byte-level token holding part of a character into U+FFFD, so
        byte-level and byte-fallback pieces are mapped back to their bytes."""
        cache = self.__dict__.setdefault("_bytes_of_token", {})
        if token_id not in cache:
            cache[token_id] = self._token_bytes(token_id)
        return cache[token_id]

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if "_added_ids" not in self.__dict__:
            self._added_ids = frozenset(self._tok.get_added_tokens_decoder())
            self._decoder_steps = _decoder_steps(self._tok.decoder)
        if token_id in self._added_ids:  # literal text, whatever the decoder does to pieces
            return piece.encode("utf-8")
        steps = self._decoder_steps
        kinds = {step.get("type") for step in steps}
        if not kinds <= _PIECE_DECODERS:  # WordPiece, BPE suffixes, ...: the decoder's text of the token alone
            return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")
        if "ByteLevel" in kinds and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if "ByteFallback" in kinds and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        for step in steps:
            if step.get("type") == "Replace" and isinstance((step.get("pattern") or {}).get("String"), str):
                piece = piece.replace(step["pattern"]["String"], str(step.get("content", "")))
            elif step.get("type") == "Metaspace":
                piece = piece.replace(str(step.get("replacement") or "\u2581"), " ")
        return piece.encode("utf-8")

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise UsageError("this model has no chat template (tokenizer_config.json chat_template or chat_template.jinja)")
        return self.chat_template.render(messages, add_generation_prompt)

    def stream_decoder(self) -> "StreamDecoder":
        return StreamDecoder(self)


# decoders that map each piece to text on its own (Fuse and Strip only join and trim)
_PIECE_DECODERS = {"ByteLevel", "ByteFallback", "Replace", "Metaspace", "Fuse", "Strip"}


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a byte-level BPE vocabulary
    writes for each byte (printable bytes as themselves, the others shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


_BYTE_OF_CHAR = _byte_of_char()


def _decoder_steps(decoder) -> list[dict]:
    """A tokenizers decoder as the list of its steps (a Sequence flattened), from its JSON."""
    import json

    if decoder is None:
        return []
    try:
        state = json.loads(decoder.__getstate__())
    except (TypeError, ValueError, AttributeError):
        return [{"type": type(decoder).__name__}]
    steps, stack = [], [state]
    while stack:
        step = stack.pop(0)
        if isinstance(step, dict) and step.get("type") == "Sequence":
            stack[:0] = list(step.get("decoders") or [])
        elif isinstance(step, dict):
            steps.append(step)
    return steps


def check_text(text: Any, what: str) -> None:
    """Refuse what the tokenizer cannot take: a non-string, or a string that is not valid
    Unicode (lone surrogates: how Python passes on command-line bytes that are not UTF-8)."""
    if not isinstance(text, str):
        raise UsageError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ord(text[exc.start])
        byte = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"U+{char:04X}"
        raise UsageError(f"{what} is not valid UTF-8 text ({byte} at character {exc.start}); give UTF-8 text") from None


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
