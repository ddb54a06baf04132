"""Constrained decoding: output that fits a JSON Schema, a regular expression or a
grammar, through llguidance (the library llama.cpp and vLLM use).

A ``ConstraintSpec`` says what the output must fit; ``Model.constraint(spec)`` compiles it
for the model's tokenizer once; each sequence gets its own ``Constraint`` (a matcher).
Before a token is sampled, the tokens the grammar forbids get -inf logits (``mask``); the
sampled token advances the matcher (``advance``); a sequence whose grammar can take no
further token stops (``finished``: finish reason "stop"). The grammar allows the model's
end-of-sequence tokens only where the output is complete.

Why llguidance over xgrammar: llguidance is a self-contained wheel (no dependencies; its
Rust core reads the tokenizer.json colibri already has), computes a mask in ~11 µs
median on an 8k vocabulary, ~21 µs on 150k (docs/benchmarks.md), and takes JSON Schema, regular
expressions, Lark and (converted) GBNF grammars; xgrammar's wheel requires torch, triton
and transformers at import.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from colibri_core.errors import UsageError

KINDS = ("json_object", "json_schema", "regex", "lark", "gbnf")
# JSON as json.dumps writes it (", " and ": " between items): no free whitespace, which a
# model could otherwise spend its whole budget on; a schema's "x-guidance" options override
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
GREEDY_TRIES = 8  # greedy decoding checks this many likeliest tokens before computing a whole mask


def _llguidance():
    try:
        import llguidance
    except ImportError:  # a dependency of colibri-core: only a broken install lacks it
        raise UsageError("constrained decoding needs the llguidance package: pip install llguidance") from None
    return llguidance


@dataclass(frozen=True)
class ConstraintSpec:
    """What the output must fit: ``kind`` one of ``KINDS``; ``source`` the JSON Schema (a
    dict, or its JSON text), the regular expression or the grammar's text (``json_object``:
    any JSON object, no source). ``name`` says where it came from, for error messages."""

    kind: str
    source: Any = None
    name: str = ""

    @classmethod
    def json_schema(cls, schema: dict | str, name: str = "JSON schema") -> "ConstraintSpec":
        return cls("json_schema", schema, name)

    @classmethod
    def json_object(cls) -> "ConstraintSpec":
        return cls("json_object", None, "JSON object")

    @classmethod
    def regex(cls, pattern: str, name: str = "regex") -> "ConstraintSpec":
        return cls("regex", pattern, name)

    @classmethod
    def grammar(cls, text: str, kind: str = "lark", name: str = "grammar") -> "ConstraintSpec":
        return cls(kind, text, name)

    def grammar_text(self) -> str:
        """The llguidance grammar; a UsageError naming ``name`` when the source is not one."""
        llg = _llguidance()
        what = self.name or self.kind
        try:
            if self.kind == "json_object":
                return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
            if self.kind == "json_schema":
                schema = self.source
                if isinstance(schema, str):
                    try:
                        schema = json.loads(schema)
                    except json.JSONDecodeError as exc:
                        raise UsageError(f"{what}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
                if not isinstance(schema, (dict, bool)):
                    raise UsageError(f"{what}: a JSON Schema is an object, not {type(schema).__name__}")
                return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
            if not isinstance(self.source, str) or not self.source:
                raise UsageError(f"{what}: empty")
            if self.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(self.source)
            if self.kind == "lark":
                return llg.LLMatcher.grammar_from_lark(self.source)
            if self.kind == "gbnf":
                from llguidance.gbnf_to_lark import gbnf_to_lark

                return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(self.source))
        except UsageError:
            raise
        except Exception as exc:  # llguidance reports a bad source as ValueError / RuntimeError
            raise UsageError(f"{what}: {_one_line(exc)}") from None
        raise UsageError(f"constraint kind {self.kind!r}: choose one of {', '.join(KINDS)}")


def _one_line(exc) -> str:
    """llguidance's message on one line: its first, and the detail a regex error puts on
    an ``error:`` line below its drawing of the source."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    detail = next((line for line in lines[1:] if line.startswith("error:")), None)
    return lines[0] + (f" {detail.removeprefix('error:').strip()}" if detail else "")


class CompiledConstraint:
    """A ``ConstraintSpec`` checked and compiled for one model's tokenizer: makes each
    sequence's ``Constraint``."""

    def __init__(self, tokenizer, grammar: str, vocab_size: int, name: str):
        self.tokenizer, self.grammar, self.vocab_size, self.name = tokenizer, grammar, vocab_size, name

    def new(self) -> "Constraint":
        return Constraint(_llguidance().LLMatcher(self.tokenizer, self.grammar), self.vocab_size, self.name)


def compile_constraint(spec: ConstraintSpec, tokenizer, vocab_size: int) -> CompiledConstraint:
    """``spec`` for the llguidance tokenizer ``tokenizer`` (``grammar_tokenizer``)."""
    llg = _llguidance()
    grammar = spec.grammar_text()
    try:
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    except Exception as exc:
        raise UsageError(f"{spec.name or spec.kind}: {_one_line(exc)}") from None
    if is_error:
        raise UsageError(f"{spec.name or spec.kind}: {_one_line(messages[0]) if messages else 'not a usable grammar'}")
    return CompiledConstraint(tokenizer, grammar, vocab_size, spec.name or spec.kind)


def for_model(model, spec: ConstraintSpec) -> CompiledConstraint:
    """``spec`` compiled for a loaded model (its llguidance tokenizer built once)."""
    return compile_constraint(spec, model_grammar_tokenizer(model, spec.name or spec.kind), model.lm.vocab_size)


def model_grammar_tokenizer(model, what: str = "constrained decoding") -> Any:
    """A loaded model's llguidance tokenizer, built once (a grammar that names a special
    token by id looks its id up here); a UsageError naming ``what`` without a tokenizer."""
    tokenizer = getattr(model, "_grammar_tokenizer", None)
    if tokenizer is None:
        if model.tokenizer is None:
            raise UsageError(f"{what}: constrained decoding needs the model's tokenizer "
                             f"(tokenizer.json in {model.model_dir})")
        tokenizer = grammar_tokenizer(model.tokenizer.to_json(), model.lm.vocab_size, model.eos_ids)
        model._grammar_tokenizer = tokenizer
    return tokenizer


def grammar_tokenizer(tokenizer_json: str, vocab_size: int, eos_ids) -> Any:
    """llguidance's view of a model's tokenizer (tokenizer.json's text): ``vocab_size``
    rows of logits, the end-of-sequence tokens the grammar allows where output may end."""
    eos = [int(e) for e in eos_ids] or None
    return _llguidance().LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)


class Constraint:
    """One sequence's matcher (see the module docstring). The mask is computed when the
    logits are there, on the sampling thread: computed ahead on a worker thread while
    the forward pass ran, it measured slower (the worker waits for the interpreter lock
    the forward pass holds between its kernels; docs/benchmarks.md)."""

    def __init__(self, matcher, vocab_size: int, name: str):
        self.matcher, self.vocab_size, self.name = matcher, vocab_size, name
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._ninf = np.float32(-np.inf)

    def allowed(self) -> np.ndarray:
        """A bool array over the vocabulary: the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self.matcher.is_error():
            raise RuntimeError(f"{self.name}: {self.matcher.get_error()}")
        return np.unpackbits(self._bits.view(np.uint8), count=self.vocab_size, bitorder="little").view(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with -inf where the grammar forbids the token (a copy)."""
        return np.where(self.allowed(), logits, self._ninf)

    def choose(self, sampler, logits: np.ndarray):
        """The sampler's (token, logprob) from ``logits`` with the grammar's mask applied,
        and the matcher moved past the token (no ``advance`` after it).

        Plain greedy decoding first tries the likeliest tokens one by one (``_greedy``):
        checking a token costs ~2 us against ~35-55 us for the whole vocabulary's mask
        inside a JSON string (docs/benchmarks.md). Any other sampling (temperature,
        penalties, bias, logprobs of the masked distribution) samples the masked logits."""
        if sampler.plain_greedy:
            token = self._greedy(logits)
            if token is not None:
                return token, None
        token, logprob = sampler.sample(self.mask(logits))
        self.advance(token)
        return token, logprob

    def _greedy(self, logits: np.ndarray) -> int | None:
        """The masked logits' argmax, consumed, found among the ``GREEDY_TRIES`` likeliest
        tokens; None (nothing consumed) when the grammar allows none of them or forces
        text here. A mask only
        lowers forbidden tokens, so the first allowed token in order of (logit, lower id
        first), as ``np.argmax`` breaks ties, is the masked argmax, provided every token
        outside the tried ones scores lower: a tie with the last tried one is left to the mask."""
        if self.matcher.compute_ff_bytes():
            # text the grammar forces: the mask allows only its canonical tokenization,
            # which a token-by-token check would not (it takes any prefix of that text)
            return None
        token = int(np.argmax(logits))
        if self.matcher.try_consume_tokens([token]):
            return token
        if logits.size <= GREEDY_TRIES:
            return None
        tried = np.argpartition(logits, -GREEDY_TRIES)[-GREEDY_TRIES:]
        scores = logits[tried]
        floor = scores.min()
        for t in tried[np.lexsort((tried, -scores))].tolist():
            if logits[t] <= floor:
                return None
            if t != token and self.matcher.try_consume_tokens([t]):
                return t
        return None

    def advance(self, token: int) -> None:
        """The sampled ``token`` (one the mask allowed) moves the matcher on."""
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"{self.name}: the grammar refused token {token} after allowing it: "
                               f"{self.matcher.get_error()}")

    def forced(self) -> list[int]:
        """Tokens that are the grammar's only way on from here (fast-forward)."""
        return [int(t) for t in self.matcher.compute_ff_tokens()]

    @property
    def finished(self) -> bool:
        """The grammar can take no further token: the output is complete."""
        return self.matcher.is_stopped()
