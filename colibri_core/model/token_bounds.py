"""At most how many characters of a text one token can stand for, read from a
``tokenizer.json``: with it a text too long for the context is refused without
tokenizing it (a text of N characters has at least N / bound tokens).

The bound holds only where no step of the tokenizer drops text: a normalizer that
strips or removes characters, a pre-tokenizer that splits off whitespace and drops it, an
unknown character fused with its neighbours into one token, an added token that absorbs
the spaces beside it, truncation. For those there is no bound (None), and a text is only
refused once tokenized. Where steps shrink text by a known factor (Unicode composition:
up to four characters make one) the bound includes it. Every other token covers at most
its own length: for byte-level BPE a token of k characters is k bytes of input, so at
most k characters.
"""

from __future__ import annotations

import math
from typing import Any

from tokenizers.pre_tokenizers import ByteLevel

# canonical composition (NFC, NFKC) turns at most this many characters into one: the
# longest canonical decomposition of a character (U+1F82, four code points)
COMPOSITION = 4
_BYTE_FALLBACK = [f"<0x{b:02X}>" for b in range(256)]


def max_chars_per_token(spec: dict[str, Any]) -> int | None:
    """The bound for the tokenizer described by ``spec`` (tokenizer.json as parsed), or
    None where no step of it is known to keep every character."""
    if spec.get("truncation") is not None:
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    pre = _pre_tokenizer_steps(spec.get("pre_tokenizer"))
    if shrink is None or pre is None:
        return None
    longest = _model_longest(spec.get("model") or {}, byte_level="ByteLevel" in pre)
    if longest is None:
        return None
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip"):  # it takes the whitespace beside it too
            return None
        longest = max(longest, len(added.get("content") or ""))
    return max(1, math.ceil(shrink * longest))


def _normalizer_shrink(normalizer) -> float | None:
    """How many characters of input at most make one of the normalizer's output."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1.0
        for step in normalizer.get("normalizers") or []:
            step_factor = _normalizer_shrink(step)
            if step_factor is None:
                return None
            factor *= step_factor
        return factor
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"):  # each character becomes one or more
        return 1.0
    if kind in ("NFC", "NFKC"):
        return float(COMPOSITION)
    if kind == "Replace":
        pattern, content = (normalizer.get("pattern") or {}).get("String"), normalizer.get("content")
        if not isinstance(pattern, str) or not pattern or not isinstance(content, str) or not content:
            return None  # a regular expression (may match any length), or a deletion
        return max(1.0, len(pattern) / len(content))
    if kind == "BertNormalizer":
        strips = normalizer.get("strip_accents")
        if strips is None:
            strips = normalizer.get("lowercase")
        return None if normalizer.get("clean_text") or strips else 1.0
    return None  # Strip, StripAccents, Precompiled, Nmt and unknown kinds may remove characters


def _pre_tokenizer_steps(pre) -> list[str] | None:
    """The kinds of the pre-tokenizer's steps, or None if one of them drops text."""
    if pre is None:
        return []
    kind = pre.get("type")
    if kind == "Sequence":
        kinds = []
        for step in pre.get("pretokenizers") or []:
            step_kinds = _pre_tokenizer_steps(step)
            if step_kinds is None:
                return None
            kinds += step_kinds
        return kinds
    if kind in ("ByteLevel", "Metaspace", "Digits"):
        return [kind]
    if kind in ("Split", "Punctuation") and pre.get("behavior", "Isolated") != "Removed":
        return [kind]
    return None  # Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit ... drop what they split on


def _model_longest(model: dict, byte_level: bool) -> int | None:
    """The longest token of the model's vocabulary, in characters, if every character of
    the input is covered by tokens no longer than it (no unknown character fused with
    others, or dropped)."""
    kind = model.get("type")
    if kind == "BPE":
        vocab = model.get("vocab") or {}
        pieces = vocab.keys()
    elif kind == "Unigram":
        pieces = [entry[0] for entry in model.get("vocab") or [] if entry]
        vocab = set(pieces)
    else:  # WordPiece, WordLevel: an unknown word is one token, however long
        return None
    if not pieces:
        return None
    if byte_level and kind == "BPE" and all(c in vocab for c in ByteLevel.alphabet()):
        pass  # every byte has its token: no character is unknown
    elif model.get("byte_fallback") and all(b in vocab for b in _BYTE_FALLBACK):
        pass  # an unknown character becomes the tokens of its bytes
    elif kind == "BPE" and model.get("unk_token") in vocab and not model.get("fuse_unk"):
        pass  # one unknown token per unknown character
    else:
        return None  # unknown characters dropped, or fused into one token
    return max(len(piece) for piece in pieces)
