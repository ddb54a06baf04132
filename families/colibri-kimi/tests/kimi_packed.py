"""What the suites of Kimi K2.5 with 4-bit routed experts read natively (compressed-tensors
int4, MXFP4 blocks) share: the oracle model and the check of its greedy tokens and logits
against transformers running the same model dequantised."""

import numpy as np
import pytest

import colibri_core
from colibri_core.model.blueprint import inspect_model
from colibri_core.testing.backends import backend_params
from colibri_core.testing.oracle import OracleCase, OracleFixture, oracle_fixture

MODEL_CLASS = "Kimi_K25ForConditionalGeneration"
# the CPU kernels quantise activations to int8 per 64 inputs for 4-bit weights
# (docs/formats.md): logits then differ from float32 by up to this share of their
# magnitude, tokens not at all
PACKED_LOGITS = 2e-2

on_every_backend = pytest.mark.parametrize("backend", backend_params())
# every expert resident, or one cached expert per layer (each read from the container)
resident_or_cap1 = pytest.mark.parametrize("options", [{"history": False}, {"cap": 1, "history": False}],
                                           ids=["resident", "cap1"])


def packed_oracle(name: str, case: OracleCase, tmp_path_factory) -> OracleFixture:
    """The oracle model of ``case`` (built once per session)."""
    root = tmp_path_factory.getbasetemp() / "oracles"
    root.mkdir(exist_ok=True)
    return oracle_fixture(name, "experts", case, MODEL_CLASS, root)


def expert_slices(path) -> list[tuple[str, str]]:
    """(format, name) of every routed expert matrix of the model at ``path``."""
    bp = inspect_model(path)
    try:
        return [(bp.resolver.format_for(i).name, i.name) for d in bp.moe for m in d.matrices for i in m.values()]
    finally:
        bp.close()


def check_greedy_tokens(oracle: OracleFixture, backend: str, options: dict, kernel: str) -> None:
    """On ``backend`` with load ``options``, transformers' tokens (at least 32) and logits
    within the backend's tolerance (1e-4 at least), or within ``PACKED_LOGITS`` of their
    magnitude where the backend's ``kernel`` takes the CPU kernels' integer path (AVX2;
    their float path stays within 1e-4)."""
    with colibri_core.load(oracle.path, backend=backend, **options) as model:
        result = model.generate(token_ids=oracle.prompt, max_tokens=len(oracle.tokens), ignore_eos=True,
                                return_logits=True)
        rounded = model.backend.has_kernel(kernel) and getattr(getattr(model.backend, "kernels", None),
                                                               "INT4_INTEGER_PATH", 0)
        bound = max(model.backend.logits_tolerance, 1e-4)
    if rounded:
        bound = max(bound, PACKED_LOGITS * float(np.abs(oracle.step_logits).max()))
    assert len(oracle.tokens) >= 32 and result.token_ids == oracle.tokens
    worst = float(np.abs(np.stack(result.logits) - oracle.step_logits).max())
    assert worst < bound, f"logits differ by {worst:.2e}"
