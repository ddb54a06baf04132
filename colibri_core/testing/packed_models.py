"""The OLMoE oracle model the backends' whole-model checks run and convert to packed
containers (int4, MXFP4, int8, bfloat16): every matrix's inputs a multiple of 64 (whole
int4 groups and MXFP4 blocks), grouped-query attention, q, k and v clipped (clip_qkv).
A backend's packed products on a container are checked against float32 products with
the container's decoded weights (``packed_and_decoded``)."""

from __future__ import annotations

from pathlib import Path

from colibri_core.testing.oracle import OracleCase, OracleFixture, build_oracle


def packed_olmoe_oracle(path: Path, new_tokens: int) -> OracleFixture:
    """The model saved at ``path`` with transformers' ``new_tokens`` greedy tokens."""

    def config():
        from transformers import OlmoeConfig

        return OlmoeConfig(vocab_size=128, eos_token_id=None, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                           num_experts_per_tok=2, max_position_embeddings=128, initializer_range=0.1, clip_qkv=3.0)

    return build_oracle(OracleCase(config, seed=3, new_tokens=new_tokens), "OlmoeForCausalLM", path)


def packed_and_decoded(fx: OracleFixture, tmp_path: Path, target: str) -> tuple[Path, Path]:
    """``fx``'s model converted to ``target`` (experts and dense weights), and that
    container converted to float32: the same numbers, decoded."""
    from colibri_core.cli.convert import convert

    container, decoded = tmp_path / target, tmp_path / f"{target}-decoded"
    convert(fx.path, container, experts=target, dense=target)
    convert(container, decoded, experts="f32", dense="f32")
    return container, decoded
