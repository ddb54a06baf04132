"""A tiny OLMoE-shaped model whose greedy output is scripted, for the tests that need a
real engine to produce a tool call.

Every attention output projection and every expert's down projection is zero, so the
residual stream at the last position is the embedding of the last token, and the model
is a bigram table: ``lm_head`` row ``s`` points along the embedding of each token that
should be followed by ``s``. The chat template ends its generation prompt with a
different token depending on the conversation, so the same weights answer:

- a plain conversation ("\\n" last): "Hello there." then end of text;
- a conversation with tools ("<|call|>" last): ``<tool_call>{get_weather Paris}</tool_call>``;
- a conversation whose last message is a tool result ("<|answer|>" last): "Warm, 21C";
- a raw prompt ending in "<loop>": that token again, until max_tokens (holds a slot).

Nothing is stubbed: tokenizer, template, loader, scheduler and sampler are the real ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from colibri_core.cli.demo import DemoSpec, build_demo_model
from colibri_core.io.safetensors import write_safetensors

SPEC = DemoSpec(hidden_size=128, num_hidden_layers=1, num_attention_heads=4, num_experts=4, num_experts_per_tok=2,
                intermediate_size=16, tokenizer_vocab=300, max_position_embeddings=2048, shard_bytes=1 << 30,
                router_std=1.0, cached_experts_per_layer=4)

PLAIN_REPLY = "Hello there."
TOOL_ARGS = {"city": "Paris"}
TOOL_BODY = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
TOOL_REPLY = "Warm, 21C"
EXTRA_SPECIAL = ["<|tool|>", "<|call|>", "<|answer|>"]
LOOP = "<loop>"  # follows itself: a prompt ending in it generates until max_tokens (a request that holds its slot)
TOOL_TOKENS = ["<tool_call>", TOOL_BODY, "</tool_call>"]
PLAIN_TOKENS = TOOL_TOKENS + [LOOP]  # added tokens that decode as text

TEMPLATE = (
    "{% if tools %}<|system|>\ntools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|endoftext|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n{% for c in m.tool_calls %}<tool_call>"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}<|endoftext|>\n"
    "{% elif m.role == 'tool' %}<|tool|>\n{{ m.content }}<|endoftext|>\n"
    "{% else %}<|{{ m.role }}|>\n{{ m.content }}<|endoftext|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if messages[-1].role == 'tool' %}<|answer|>{% elif tools %}<|call|>{% else %}{{ '\\n' }}{% endif %}{% endif %}"
)

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                                "required": ["city"]}}}


def build_scripted_model(out: Path) -> Path:
    from tokenizers import AddedToken, Tokenizer

    build_demo_model(out, SPEC)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens(EXTRA_SPECIAL)
    tok.add_tokens([AddedToken(t, normalized=False) for t in PLAIN_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    assert tok.get_vocab_size() <= SPEC.vocab_size

    def ids(text):
        return tok.encode(text, add_special_tokens=False).ids

    eos = tok.token_to_id("<|endoftext|>")
    [newline] = ids("\n")
    paths = [[newline] + ids(PLAIN_REPLY) + [eos],
             [tok.token_to_id("<|call|>")] + [tok.token_to_id(t) for t in TOOL_TOKENS] + [eos],
             [tok.token_to_id("<|answer|>")] + ids(TOOL_REPLY) + [eos],
             [tok.token_to_id(LOOP), tok.token_to_id(LOOP)]]
    successor: dict[int, int] = {}
    for path in paths:
        for a, b in zip(path, path[1:]):
            assert successor.setdefault(a, b) == b, f"token {a} has two successors in the script"

    rng = np.random.default_rng(7)
    h, v, i, e = SPEC.hidden_size, SPEC.vocab_size, SPEC.intermediate_size, SPEC.num_experts
    embed = rng.standard_normal((v, h)).astype(np.float32)
    unit = embed / np.linalg.norm(embed, axis=1, keepdims=True)
    lm_head = rng.standard_normal((v, h)).astype(np.float32) * 0.01
    for a, b in successor.items():
        lm_head[b] += 4.0 * unit[a]
    tensors = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head, "model.norm.weight": np.ones(h, np.float32)}
    for layer in range(SPEC.num_hidden_layers):
        p = f"model.layers.{layer}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{p}.self_attn.{proj}.weight"] = np.zeros((h, h), np.float32)
        for norm in ("self_attn.q_norm", "self_attn.k_norm", "input_layernorm", "post_attention_layernorm"):
            tensors[f"{p}.{norm}.weight"] = np.ones(h, np.float32)
        tensors[f"{p}.mlp.gate.weight"] = rng.standard_normal((e, h)).astype(np.float32)
        for x in range(e):
            tensors[f"{p}.mlp.experts.{x}.gate_proj.weight"] = rng.standard_normal((i, h)).astype(np.float32) * 0.1
            tensors[f"{p}.mlp.experts.{x}.up_proj.weight"] = rng.standard_normal((i, h)).astype(np.float32) * 0.1
            tensors[f"{p}.mlp.experts.{x}.down_proj.weight"] = np.zeros((h, i), np.float32)
    for old in out.glob("*.safetensors"):
        old.unlink()
    (out / "model.safetensors.index.json").unlink()
    write_safetensors(out / "model.safetensors", [(k, ("F32", t)) for k, t in tensors.items()], metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
