"""Whole models on MLX: greedy tokens identical to transformers (an OLMoE oracle model),
and packed containers (int4, MXFP4, bfloat16) computed in MLX's quantised products
giving the tokens of their decoded weights."""

import numpy as np
import pytest

import colibri_core
from colibri_core.testing.packed_models import packed_and_decoded, packed_olmoe_oracle
from colibri_mlx import packed

pytest.importorskip("colibri_olmoe")  # the family the models below belong to


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    return packed_olmoe_oracle(tmp_path_factory.mktemp("olmoe") / "f32", new_tokens=24)


@pytest.mark.parametrize("cap", [None, 1], ids=["all-experts", "one-expert-cached"])
def test_tokens_identical_to_transformers(oracle, cap):
    with colibri_core.load(oracle.path, backend="mlx", cap=cap, history=False) as model:
        assert model.backend.name == "mlx"
        result = model.generate(token_ids=oracle.prompt, max_tokens=len(oracle.tokens), ignore_eos=True,
                                return_logits=True)
        full = model.logits(oracle.prompt + oracle.tokens[:-1])
        tolerance = model.backend.logits_tolerance
    assert result.token_ids == oracle.tokens
    assert np.abs(np.stack(result.logits) - oracle.step_logits).max() <= tolerance
    assert np.abs(full - oracle.full_logits).max() <= tolerance


@pytest.mark.parametrize("target,kind", [("int4", "q4"), ("mxfp4", "mxfp4"), ("bf16", "bf16")])
def test_packed_container_computes_its_decoded_numbers(oracle, tmp_path, target, kind):
    """MLX's packed products on a container give the tokens, and the logits within
    float32 rounding, of float32 products with the container's decoded weights (the same
    container converted to f32, run on the CPU backend's BLAS). The CPU backend's own
    int4 kernels are no yardstick here: they quantise the activations."""
    container, decoded = packed_and_decoded(oracle, tmp_path, target)
    runs = {}
    for name, path, backend in (("packed", container, "mlx"), ("decoded", decoded, "cpu")):
        with colibri_core.load(path, backend=backend, cap=2, history=False) as model:
            weight = model.lm.layers[0].attn.q.weight.value
            if name == "packed":  # kept in MLX's packed form, not decoded
                assert isinstance(weight, packed.Quantized if kind != "bf16" else packed.Bf16)
            else:
                assert isinstance(weight, np.ndarray) and weight.dtype == np.float32
            result = model.generate(token_ids=oracle.prompt, max_tokens=len(oracle.tokens), ignore_eos=True,
                                    return_logits=True)
            runs[name] = (result.token_ids, np.stack(result.logits))
    assert runs["packed"][0] == runs["decoded"][0]
    assert np.abs(runs["packed"][1] - runs["decoded"][1]).max() <= 1e-4
