"""A random-weights model whose chat template writes tool calls in the Hermes convention
(``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, as Qwen2.5 / Qwen3 do; or
with ``CODER_TEMPLATE`` a block per parameter, as Qwen3-Coder does), for
the tests of forced and strict tool calls: its replies are garbage, so a call that parses
and fits its tool's schema is the grammar's doing. ``<tool_call>`` and ``</tool_call>``
are tokens of its vocabulary (plain added tokens, as in Qwen's), and its context holds
512 tokens."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from colibri_core.cli.demo import build_demo_model
from colibri_core.testing.demo_specs import SMALL_RANDOM

SPEC = dataclasses.replace(SMALL_RANDOM, tokenizer_vocab=300, max_position_embeddings=512)
CALL_TOKENS = ["<tool_call>", "</tool_call>"]

TEMPLATE = (
    "{% if tools %}<|system|>\ntools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|endoftext|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|endoftext|>\n"
    "{% elif m.role == 'tool' %}<|user|>\n{{ m.content }}<|endoftext|>\n"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}<|endoftext|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Qwen3-Coder's convention: a block per parameter, string values bare
CODER_TEMPLATE = TEMPLATE.replace(
    "<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>",
    "<tool_call>\n<function={{ c.function.name }}>\n{% for k, v in c.function.arguments.items() %}"
    "<parameter={{ k }}>\n{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}</function>\n</tool_call>")


def build_tool_model(out: Path, template: str = TEMPLATE) -> Path:
    from tokenizers import AddedToken, Tokenizer

    build_demo_model(out, SPEC)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, normalized=False) for t in CALL_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    assert tok.get_vocab_size() <= SPEC.vocab_size
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


def call_token(model_dir: Path) -> int:
    """The id of the ``<tool_call>`` token."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id("<tool_call>")
