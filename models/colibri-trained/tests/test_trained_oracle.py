"""The trained models against transformers: the family oracle suite (greedy tokens
identical, logits within tolerance, under every placement, on every installed backend)
run on the trained checkpoints instead of random ones, from real text prompts."""

from __future__ import annotations

import shutil
import threading

import pytest

from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase, OracleFixture, transformers_reference

colibri_trained = pytest.importorskip("colibri_trained", reason="colibri-trained is not installed")

PROMPTS = {
    "olmoe": "import os\n\n\ndef read_config(path):\n    \"\"\"Return the",
    "deepseek_v3": "#include <stdlib.h>\n\n/* Return the number of",
}
NEW_TOKENS = 24

_built: dict[str, OracleFixture] = {}
_lock = threading.Lock()


def trained_fixture(name: str, model_class: str, root) -> OracleFixture:
    """A copy of the trained model (tests must not write into the installed one) and
    transformers' reference outputs for its prompt, once per session."""
    with _lock:
        if name not in _built:
            import torch
            import transformers
            from tokenizers import Tokenizer

            try:
                source = colibri_trained.path(name)
            except LookupError as exc:
                pytest.skip(str(exc))
            copy = root / f"trained-{name}"
            shutil.copytree(source, copy)
            model = getattr(transformers, model_class).from_pretrained(copy, dtype=torch.float32,
                                                                      attn_implementation="eager").eval()
            model.generation_config.eos_token_id = None  # the reference runs the full length, as colibri's ignore_eos
            prompt = Tokenizer.from_file(str(copy / "tokenizer.json")).encode(PROMPTS[name]).ids
            tokens, step_logits, full = transformers_reference(model, prompt, NEW_TOKENS)
            config = model.config
            experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts")
            _built[name] = OracleFixture(copy, prompt, tokens, step_logits, full, int(experts))
        return _built[name]


class _TrainedSuite(FamilyOracleSuite):
    trained_name = ""

    @pytest.mark.slow  # every budget x pinning x prefetch x O_DIRECT x mirror on 16 layers: ~45 s per backend
    def test_every_store_option_gives_identical_tokens(self, backend, case_name, tmp_path_factory, tmp_path):
        super().test_every_store_option_gives_identical_tokens(backend, case_name, tmp_path_factory, tmp_path)

    @classmethod
    def oracle(cls, case_name, tmp_path_factory) -> OracleFixture:
        root = tmp_path_factory.getbasetemp() / "oracles"
        root.mkdir(exist_ok=True)
        return trained_fixture(cls.trained_name, cls.model_class, root)


class TestTrainedOlmoe(_TrainedSuite):
    model_class = "OlmoeForCausalLM"
    trained_name = "olmoe"
    cases = {"trained": OracleCase(make_config=lambda: None)}  # the name only: the model is the trained one


class TestTrainedDeepseekV3(_TrainedSuite):
    model_class = "DeepseekV3ForCausalLM"
    trained_name = "deepseek_v3"
    cases = {"trained": OracleCase(make_config=lambda: None)}


def test_the_trained_models_continue_text_sensibly():
    """Not noise: the OLMoE-geometry model continues a Python prompt with Python."""
    import colibri_core

    with colibri_core.load(colibri_trained.path("olmoe"), history=False) as model:
        text = model.generate("import os\nimport sys\n\n\ndef main(", max_tokens=40).text
    assert any(word in text for word in ("self", "return", "args", "path", "def ", "if ", "None")), text
