"""Demo models (``colibri_core.cli.demo``: OLMoE-shaped, random, built without
transformers) that several test suites build alike."""

from colibri_core.cli.demo import DemoSpec

# 8 experts, top 2, a 64-token context: the small random model of the core runtime and
# bad-input tests and of colibri-serve's tests (its greedy text is noise, but stable)
SMALL_RANDOM = DemoSpec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts=8,
                        num_experts_per_tok=2, intermediate_size=16, tokenizer_vocab=320, max_position_embeddings=64,
                        shard_bytes=40_000, router_std=1.0, cached_experts_per_layer=2)
