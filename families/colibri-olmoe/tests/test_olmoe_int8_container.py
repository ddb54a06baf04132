"""An int8 container of an OLMoE oracle model, reported against its float32 source:
greedy agreement with transformers and logit cosine (issue #4's quality check)."""

import numpy as np

import colibri_core
from colibri_core.cli.convert import convert, quality_report
from colibri_core.testing.oracle import OracleCase, build_oracle
from transformers import OlmoeConfig


def test_int8_container_agrees_with_the_float32_oracle(tmp_path, capsys):
    case = OracleCase(lambda: OlmoeConfig(vocab_size=128, eos_token_id=None, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                          num_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
                                          initializer_range=0.1), seed=7)
    fx = build_oracle(case, "OlmoeForCausalLM", tmp_path / "f32")
    container = tmp_path / "int8"
    convert(fx.path, container, experts="int8", dense="int8")
    with colibri_core.load(container, cap=1, history=False) as model:
        assert model.lm.layers[0].attn.q.weight.value.kind == "q8"
        result = model.generate(token_ids=fx.prompt, max_tokens=len(fx.tokens), ignore_eos=True, return_logits=True)
    ours = np.stack(result.logits)
    agreement = float(np.mean(np.array(result.token_ids) == np.array(fx.tokens)))
    first_divergence = next((i for i, (a, b) in enumerate(zip(result.token_ids, fx.tokens)) if a != b), len(fx.tokens))
    # compare the distributions while the sequences still agree (after that, contexts differ)
    n = max(1, first_divergence)
    cosine = np.sum(ours[:n] * fx.step_logits[:n], axis=1) / (
        np.linalg.norm(ours[:n], axis=1) * np.linalg.norm(fx.step_logits[:n], axis=1))
    report = quality_report(fx.path, container)
    with capsys.disabled():
        print(f"\nint8 container vs float32 oracle: greedy agreement {agreement:.0%} ({first_divergence} tokens before the "
              f"first difference), logit cosine mean {cosine.mean():.5f} min {cosine.min():.5f}; teacher-forced report {report}")
    # a near-tie in a router can pick another expert: a few positions move further
    assert cosine.mean() > 0.995 and cosine.min() > 0.9
    assert report["cosine_mean"] > 0.998 and report["greedy_agreement"] > 0.9
    assert first_divergence >= 8
