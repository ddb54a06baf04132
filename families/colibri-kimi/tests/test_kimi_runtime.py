"""Kimi beyond token agreement: both checkpoint namings, lm_head tying, the vision tower
never loaded, image and video placeholders refused, the latent KV cache, config errors."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import colibri_core
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.testing import DELETE, edit_config

import test_kimi_oracle as suites


def fixture(tmp_path_factory, suite, name):
    return suite.oracle(name, tmp_path_factory)


def copy(src, dst, rename=None, **changes):
    """Copy a model directory, renaming tensors (old prefix -> new prefix) and changing config keys."""
    shutil.copytree(src, dst)
    if rename:
        from safetensors.torch import load_file, save_file

        def new(name):
            for old, replacement in rename.items():
                if name.startswith(old):
                    return replacement + name[len(old):]
            return name

        for file in dst.glob("*.safetensors"):
            save_file({new(k): v for k, v in load_file(file).items()}, file, metadata={"format": "pt"})
        index = dst / "model.safetensors.index.json"
        if index.exists():
            data = json.loads(index.read_text())
            data["weight_map"] = {new(k): v for k, v in data["weight_map"].items()}
            index.write_text(json.dumps(data))
    edit_config(dst, **changes)
    return dst


def test_k25_and_k2_load_through_the_kimi_family(tmp_path_factory):
    k25 = fixture(tmp_path_factory, suites.TestKimiK25Oracle, "tied")
    k2 = fixture(tmp_path_factory, suites.TestKimiK2Oracle, "k2")
    with colibri_core.load(k25.path) as a, colibri_core.load(k2.path) as b:
        assert a.family.spec.name == b.family.spec.name == "kimi"
        assert a.model_type == "kimi_k25" and b.model_type == "kimi_k2"
        layers = a.config["text_config"]["num_hidden_layers"]
        text = a.config["text_config"]
        stats = a.generate(token_ids=k25.prompt, max_tokens=3, ignore_eos=True).stats
    assert stats.kv_bytes_per_token == layers * (text["kv_lora_rank"] + text["qk_rope_head_dim"]) * 4


def test_only_text_weights_are_resident(tmp_path_factory):
    fx = fixture(tmp_path_factory, suites.TestKimiK25Oracle, "tied")
    with colibri_core.load(fx.path) as model:
        text_bytes = sum(t.nbytes for n, t in model.checkpoint.tensors.items()
                         if n.startswith("language_model.") and ".experts." not in n)
        assert model.dense_bytes_read == text_bytes
        assert any(n.startswith("vision_tower.") for n in model.checkpoint.tensors)


@pytest.mark.parametrize("naming", ["hub", "transformers"])
def test_both_checkpoint_namings_give_the_same_logits(tmp_path_factory, tmp_path, naming):
    fx = fixture(tmp_path_factory, suites.TestKimiK25Oracle, "untied_yarn_sharded")
    rename = ({"language_model.model.blocks.": "language_model.model.layers."} if naming == "hub" else
              {"language_model.model.blocks.": "model.language_model.layers.",
               "language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head."})
    renamed = copy(fx.path, tmp_path / naming, rename=rename)
    ids = fx.prompt + fx.tokens[:-1]
    with colibri_core.load(fx.path) as a, colibri_core.load(renamed) as b:
        assert not any(".blocks." in n for n in b.checkpoint.tensors if "language_model" in n)
        np.testing.assert_array_equal(a.logits(ids), b.logits(ids))


def test_lm_head_tying(tmp_path_factory, tmp_path):
    untied = fixture(tmp_path_factory, suites.TestKimiK25Oracle, "untied_yarn_sharded")
    # no top-level flag (transformers would default to tying): a stored lm_head is kept
    no_flag = copy(untied.path, tmp_path / "no-flag", tie_word_embeddings=DELETE)
    with colibri_core.load(untied.path) as a, colibri_core.load(no_flag) as b:
        np.testing.assert_array_equal(a.logits(untied.prompt), b.logits(untied.prompt))
    # tied by the top-level flag: transformers saved no lm_head, the embeddings serve
    tied = fixture(tmp_path_factory, suites.TestKimiK25Oracle, "tied")
    with colibri_core.load(tied.path) as model:
        assert not any("lm_head" in n for n in model.checkpoint.tensors)
        assert model.lm.lm_head.weight is model.lm.embed.weight
    broken = copy(tied.path, tmp_path / "untied-without-head", tie_word_embeddings=False)
    with pytest.raises(ModelFormatError, match="tie_word_embeddings is false but there is no lm_head"):
        colibri_core.load(broken)


def test_image_and_video_placeholders_are_refused(tmp_path_factory, tmp_path):
    fx = fixture(tmp_path_factory, suites.TestKimiK25Oracle, "tied")
    model_dir = copy(fx.path, tmp_path / "media", image_token_id=120, video_token_id=121, media_placeholder_token_id=122)
    with colibri_core.load(model_dir) as model:
        for token, what in ((120, "image"), (121, "video"), (122, "media")):
            with pytest.raises(UnsupportedModelError, match=f"token {token}: Kimi K2.5's {what} placeholder.*text model only"):
                model.generate(token_ids=[5, token, 7], max_tokens=2)
            with pytest.raises(UnsupportedModelError, match="image and video input are not supported"):
                model.logits([token])
        assert len(model.generate(token_ids=[5, 6, 7], max_tokens=2, ignore_eos=True).token_ids) == 2


@pytest.mark.parametrize("changes,error,match", [
    ({"text_config": "deepseek"}, ModelFormatError, "text_config must be an object"),
    ({"text_config": {"model_type": "qwen3_moe"}}, UnsupportedModelError, "text_config model_type 'qwen3_moe'"),
])
def test_bad_text_configs_are_refused(tmp_path_factory, tmp_path, changes, error, match):
    fx = fixture(tmp_path_factory, suites.TestKimiK25Oracle, "tied")
    with pytest.raises(error, match=match):
        colibri_core.load(copy(fx.path, tmp_path / "bad", **changes))


def test_text_config_errors_name_the_nested_field(tmp_path_factory, tmp_path):
    fx = fixture(tmp_path_factory, suites.TestKimiK25Oracle, "tied")
    text = json.loads((fx.path / "config.json").read_text())["text_config"]
    with pytest.raises(ModelFormatError, match=r"config.json: text_config: field 'kv_lora_rank'"):
        colibri_core.load(copy(fx.path, tmp_path / "bad", text_config=dict(text, kv_lora_rank=-1)))


def test_list_families_shows_the_kimi_model_types():
    out = subprocess.run([sys.executable, "-m", "colibri_core", "list-families", "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    families = {f["family"]: f for f in json.loads(out)}
    assert families["kimi"]["model_types"] == ["kimi_k2", "kimi_k25"]
