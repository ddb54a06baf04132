"""GLM-5 Next beyond token agreement: media placeholders (refused in prompts; one the
model generates is embedded as transformers does), the tensor layouts and config
spellings a checkpoint may have, the fixed-size recurrent state counted by the cache and
by ``colibri plan``, config errors naming the field, and the family listed."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

import colibri_core
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.io.safetensors import write_safetensors
from colibri_core.nn.cache import RecurrentState
from colibri_core.nn.mla import MLACache
from colibri_core.testing import copy_model
from colibri_core.testing.oracle import OracleCase, oracle_fixture

import test_glm5_next_oracle as suite
from glm_configs import glm5_next

HYBRID = "hybrid_pooled_shared"
DEFAULTS = "defaults_softplus_clamped_tied"


def fixture(tmp_path_factory, name=HYBRID):
    return suite.TestGlm5NextOracle.oracle(name, tmp_path_factory)


def logits(path, ids):
    with colibri_core.load(path, history=False) as model:
        return model.logits(ids)


def with_text(src, dst, **changes):
    """A copy of a model whose text_config has ``changes`` (None removes a key)."""
    model = copy_model(src, dst)
    config = json.loads((model / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config["text_config"].pop(key, None)
        else:
            config["text_config"][key] = value
    (model / "config.json").write_text(json.dumps(config))
    return model


def tensors(path):
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def rewritten(src, dst, rename, config=None):
    """``src`` with every tensor renamed by ``rename(name, tensors) -> {name: array}`` into
    one shard (and, when given, another config.json)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    old = tensors(src)
    new = {}
    for name, t in old.items():
        new.update(rename(name, t, old))
    write_safetensors(dst / "model.safetensors", new, {"format": "pt"})
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def in_memory_layout(name, t, old):
    """transformers' in-memory names: forget_gate.*, one fused conv1d, attn_hc.fn ..."""
    for part in ("A_log", "dt_bias", "f_a_proj", "f_b_proj"):
        name = name.replace(f".self_attn.{part}", f".self_attn.forget_gate.{part}")
    for site in ("attn", "ffn"):
        for part in ("fn", "base", "scale"):
            name = name.replace(f".hc_{site}_{part}", f".{site}_hc.{part}")
    if name.endswith((".k_conv1d.weight", ".v_conv1d.weight")):
        return {}
    if name.endswith(".q_conv1d.weight"):
        base = name[: -len("q_conv1d.weight")]
        return {f"{base}conv1d.weight": np.concatenate([old[f"{base}{p}_conv1d.weight"] for p in "qkv"])}
    return {name: t}


def test_both_tensor_layouts_give_the_same_logits(tmp_path_factory, tmp_path):
    fx = fixture(tmp_path_factory)
    assert "model.language_model.layers.0.hc_attn_fn" in tensors(fx.path)  # what save_pretrained writes
    ids = fx.prompt + fx.tokens[:-1]
    other = rewritten(fx.path, tmp_path / "memory", in_memory_layout)
    assert "model.language_model.layers.0.attn_hc.fn" in tensors(other)
    np.testing.assert_array_equal(logits(other, ids), logits(fx.path, ids))


def test_a_flat_text_only_checkpoint_reads_the_same(tmp_path_factory, tmp_path):
    """GLM-5.3-Flash text-only checkpoints: the text fields at the top level, the text
    model under ``model.`` (transformers' Glm5NextConfig takes the top level as text_config)."""
    fx = fixture(tmp_path_factory)
    config = json.loads((fx.path / "config.json").read_text())
    flat = {**config["text_config"], "model_type": "glm5_next", "architectures": config["architectures"]}
    flat_dir = rewritten(fx.path, tmp_path / "flat",
                         lambda n, t, old: {} if ".visual." in n else {n.replace("model.language_model.", "model."): t}, flat)
    ids = fx.prompt + fx.tokens[:-1]
    np.testing.assert_array_equal(logits(flat_dir, ids), logits(fx.path, ids))


def test_linear_attn_config_spelling(tmp_path_factory, tmp_path):
    """Kimi's ``linear_attn_config`` spelling overrides the flat fields (transformers'
    __post_init__); a null gate_lower_bound with safe_gate still gets -5."""
    fx = fixture(tmp_path_factory)
    ids = fx.prompt[:20]
    reference = logits(fx.path, ids)
    spelled = with_text(fx.path, tmp_path / "spelled", linear_head_dim=99, linear_num_heads=99, linear_conv_kernel_dim=9,
                        linear_attn_config={"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 4,
                                            "gate_lower_bound": None, "safe_gate": True})
    np.testing.assert_array_equal(logits(spelled, ids), reference)
    softplus = with_text(fx.path, tmp_path / "softplus", linear_lower_bound=None)
    raw = json.loads((softplus / "config.json").read_text())["text_config"]
    assert "linear_lower_bound" not in raw  # absent: transformers' default -5
    np.testing.assert_array_equal(logits(softplus, ids), reference)
    null = with_text(fx.path, tmp_path / "null", linear_lower_bound=0.0)
    config = json.loads((null / "config.json").read_text())
    config["text_config"]["linear_lower_bound"] = None  # an explicit null: the softplus decay
    (null / "config.json").write_text(json.dumps(config))
    assert np.abs(logits(null, ids) - reference).max() > 1e-4


def test_media_placeholders_are_refused(tmp_path_factory, tmp_path):
    fx = fixture(tmp_path_factory)
    model_dir = copy_model(fx.path, tmp_path / "media", image_token_id=120, video_token_id=121)
    with colibri_core.load(model_dir) as model:
        for token, what in ((120, "image"), (121, "video")):
            with pytest.raises(UnsupportedModelError, match=f"token {token}: GLM-5 Next's {what} placeholder.*text model only"):
                model.generate(token_ids=[5, token, 7], max_tokens=2)
            with pytest.raises(UnsupportedModelError, match="image and video input are not supported"):
                model.logits([token])
        # the image start / end markers are ordinary tokens without media
        assert len(model.generate(token_ids=[5, 122, 123, 7], max_tokens=2, ignore_eos=True).token_ids) == 2


PLACEHOLDER_PROMPT = suite.PROMPT[:20]


def placeholder_from_generation(model):
    """``prepare`` hook: the correction bias, then make the model's own third-or-later
    greedy token (not in the prompt) its image placeholder. Without media transformers
    embeds it as its own row, so its continuation is unchanged; colibri must follow."""
    import torch

    suite.BIAS(model)
    prompt = torch.tensor([list(PLACEHOLDER_PROMPT)])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    generated = out[0, len(PLACEHOLDER_PROMPT):].tolist()
    model.config.image_token_id = next(t for t in generated[2:] if t not in PLACEHOLDER_PROMPT)


def test_a_generated_image_placeholder_is_embedded_as_transformers_does(tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "oracles"
    root.mkdir(exist_ok=True)
    case = OracleCase(glm5_next(layer_types=["linear_attention", "indexed_attention", "indexed_attention",
                                             "linear_attention"], indexer_types=["full", "full", "shared", "full"]),
                      seed=5, prompt=PLACEHOLDER_PROMPT, prepare=placeholder_from_generation)
    fx = oracle_fixture("glm5-next-placeholder", "generated", case, suite.TestGlm5NextOracle.model_class, root)
    placeholder = json.loads((fx.path / "config.json").read_text())["image_token_id"]
    assert fx.tokens.index(placeholder) < len(fx.tokens) - 8, "the case needs tokens after the placeholder"
    with colibri_core.load(fx.path, history=False) as model:
        result = model.generate(token_ids=fx.prompt, max_tokens=len(fx.tokens), ignore_eos=True, return_logits=True)
    assert result.token_ids == fx.tokens
    assert float(np.abs(np.stack(result.logits) - fx.step_logits).max()) < 1e-4


def test_recurrent_state_is_fixed_size_and_counted(tmp_path_factory):
    fx = fixture(tmp_path_factory)
    text = json.loads((fx.path / "config.json").read_text())["text_config"]
    h, d, k = text["linear_num_heads"], text["linear_head_dim"], text["linear_conv_kernel_dim"]
    with colibri_core.load(fx.path, history=False) as model:
        cache = model.lm.new_cache(model.backend)
        kinds = [type(layer).__name__ for layer in cache.layers]
        assert kinds == ["RecurrentState", "MLACache", "MLACache", "RecurrentState"]
        fixed = sum(layer.nbytes for layer in cache.layers if isinstance(layer, RecurrentState))
        assert fixed == 2 * 4 * ((k - 1) * 3 * h * d + h * d * d)  # conv inputs and a d x d matrix per head
        model.lm.forward(np.asarray(fx.prompt), cache, model.backend)
        assert sum(layer.nbytes for layer in cache.layers if isinstance(layer, RecurrentState)) == fixed
        # per token: the latent of each indexed layer, plus key and pool gate of its own indexer
        per_token = 4 * (2 * text["kv_lora_rank"] + 2 * text["index_head_dim"])
        assert cache.bytes_per_token() == per_token
        assert isinstance(cache.layers[1], MLACache) and cache.layers[2].index_keys is None  # shared: no indexer keys
    out = subprocess.run([sys.executable, "-m", "colibri_core", "plan", "--model", str(fx.path), "--json", "--disk-bw",
                          "1G"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads(out.stdout)
    assert plan["kv_bytes_per_token"] == per_token
    assert plan["kv_bytes_at_context"] == per_token * plan["context_length"] + fixed


@pytest.mark.parametrize("changes,error,match", [
    ({"qk_rope_head_dim": 8}, UnsupportedModelError, "qk_rope_head_dim 8: GLM-5 Next's attention is NoPE"),
    ({"index_topk": 10}, ModelFormatError, "index_topk 10 is not divisible by index_kpool 4"),
    ({"index_kpool_always_select_tail": False}, UnsupportedModelError, "index_kpool_always_select_tail false"),
    ({"indexer_types": ["full", "shared", "full", "full"]}, ModelFormatError, "layer 1 is 'shared' but layer 0 is not"),
    ({"layer_types": ["linear_attention", "mamba", "indexed_attention", "linear_attention"]}, ModelFormatError,
     "layer_types must give"),
    ({"mlp_layer_types": ["dense"]}, ModelFormatError, "mlp_layer_types must list"),
    ({"num_key_value_heads": 2}, ModelFormatError, "num_key_value_heads 2 must equal num_attention_heads 4"),
    ({"linear_attn_config": {"head_dim": "eight"}}, ModelFormatError, "linear_attn_config.head_dim must be"),
    ({"hc_mult": 2}, ModelFormatError, r"hc_attn_fn. has shape \[24, 128\], but config.json implies \[8, 64\]"),
    ({"hidden_act": "gelu"}, UnsupportedModelError, "hidden_act 'gelu'"),
])
def test_bad_configs_are_refused_naming_the_field(tmp_path_factory, tmp_path, changes, error, match):
    fx = fixture(tmp_path_factory)
    with pytest.raises(error, match=match) as err:
        colibri_core.load(with_text(fx.path, tmp_path / "bad", **changes))
    assert "config.json" in str(err.value)


def test_a_text_config_that_is_not_an_object_is_refused(tmp_path_factory, tmp_path):
    fx = fixture(tmp_path_factory)
    with pytest.raises(ModelFormatError, match="text_config must be an object"):
        colibri_core.load(copy_model(fx.path, tmp_path / "bad", text_config="glm"))


def test_list_families_shows_glm5_next():
    out = subprocess.run([sys.executable, "-m", "colibri_core", "list-families", "--json"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    family = {f["family"]: f for f in json.loads(out)}["glm5-next"]
    assert family["model_types"] == ["glm5_next"]
    assert family["distribution"] == "colibri-glm"
    assert family["status"] == "ok"


def test_batched_requests_and_prefix_reuse_give_model_generate_tokens(tmp_path_factory):
    """Streams, KDA states and pooled selections per sequence in a batched step: each
    request's tokens are those of Model.generate, alone or among others, and a prompt
    resumed from a reused prefix (recurrent snapshots, latents, indexer rows) too."""
    from colibri_core.engine.scheduler import Request, Scheduler

    fx = fixture(tmp_path_factory)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 128, size=int(n)).tolist() for n in (70, 9, 33, 4, 41)]
    lengths = [10, 6, 12, 3, 8]
    with colibri_core.load(fx.path, history=False) as model:
        alone = [model.generate(token_ids=p, max_tokens=n, ignore_eos=True).token_ids for p, n in zip(prompts, lengths)]
        with Scheduler(model, slots=8, prefill_chunk=16) as sched:
            handles = [sched.submit(Request(p, n)) for p, n in zip(prompts, lengths)]
            assert all(h.wait(300) for h in handles)
            assert [h.token_ids for h in handles] == alone
            assert sched.stats()["steps"] < sum(lengths)  # decode steps really carried several sequences
            longer = prompts[0] + [5, 6, 7]
            again = sched.submit(Request(longer, 6))
            assert again.wait(300)
            assert again.usage["cached_tokens"] == 64  # whole chunks of the first prompt
        assert again.token_ids == model.generate(token_ids=longer, max_tokens=6, ignore_eos=True).token_ids
