"""DeepSeek-V4 in the layout of DeepSeek's published shards, read without conversion:
names without ``model.`` (``embed``, ``norm``, ``hc_head_fn``, ``attn.kv_norm``), the dense
projections fp8 e4m3 with ``<m>.scale`` F8_E8M0 128 x 128 block scales, the routed
experts fp4 (``<m>.weight`` I8 (rows, cols / 2) + ``<m>.scale`` F8_E8M0 (rows, cols / 32)),
``quantization_config`` fp8 / ue8m0 with ``expert_dtype: fp4`` (ds_v4_native.py writes it
from the float model). colibri on that layout gives transformers' greedy tokens and
logits on the same model dequantised; malformed layouts are refused in one line naming
the tensor; ``colibri convert`` reads it."""

import json
import shutil

import numpy as np
import pytest

import colibri_core
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.formats.base import QuantTensor, block_sources
from colibri_core.nn.compressed import rope_first
from colibri_core.io.checkpoint import Checkpoint
from colibri_core.io.safetensors import write_safetensors
from colibri_core.model.blueprint import inspect_model
from colibri_core.testing.cli import run_colibri
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase

from colibri_deepseek.v4 import head_order, rows_of
from ds_configs import v4, v4_buffers
from ds_v4_native import v4_native_rewrite

PROMPT = (5, 17, 90, 3, 42, 7, 64, 11, 2, 33, 21, 8, 19, 50, 4, 6, 13, 27, 31, 44, 70)


class TestDeepseekV4NativeOracle(FamilyOracleSuite):
    model_class = "DeepseekV4ForCausalLM"
    cases = {
        # hidden 160: 128 x 128 fp8 blocks full and partial; experts' inputs multiples
        # of 32 (whole fp4 groups); V4's top-level expert_dtype
        "flash": OracleCase(v4(hidden_size=160, moe_intermediate_size=64), prompt=PROMPT, prepare=v4_buffers(),
                            rewrite=v4_native_rewrite()),
        # heads of 256 channels, 64 of them rope: wq_b's and wkv's rows reordered across
        # 128-row fp8 blocks (head_order), each block moving whole with its scale
        "wide_heads": OracleCase(v4(head_dim=256, partial_rotary_factor=0.25, num_attention_heads=2, index_head_dim=128,
                                    moe_intermediate_size=32),
                                 seed=2, prompt=PROMPT, prepare=v4_buffers(seed=5), rewrite=v4_native_rewrite()),
        # V4.1's expert_dtype inside quantization_config, HCA first, several shards
        "v41_sharded": OracleCase(
            v4(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, q_lora_rank=32,
               layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
               mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=2, scoring_func="sigmoid"),
            seed=1, prompt=PROMPT, max_shard_size="40KB", prepare=v4_buffers(seed=3),
            rewrite=v4_native_rewrite(expert_dtype_at_top=False)),
    }

    def test_checkpoint_is_in_the_published_layout(self, case_name, tmp_path_factory):
        fx = self._fixture(case_name, tmp_path_factory)
        config = json.loads((fx.path / "config.json").read_text())
        qc = config["quantization_config"]
        assert qc["quant_method"] == "fp8" and qc["scale_fmt"] == "ue8m0"
        assert "fp4" in (config.get("expert_dtype"), qc.get("expert_dtype"))
        bp = inspect_model(fx.path)
        try:
            tensors = bp.checkpoint.tensors
            assert "embed.weight" in tensors and "hc_head_fn" in tensors and "layers.0.attn.kv_norm.weight" in tensors
            assert not any(n.startswith("model.") or n.endswith("_scale_inv") for n in tensors)
            experts = {bp.resolver.format_for(i).name for d in bp.moe for m in d.matrices for i in m.values()}
            assert experts == {"fp4-e2m1-g32"}
            fp8 = [n for n, t in tensors.items() if t.dtype == "F8_E4M3"]
            assert any(".wq_b." in n for n in fp8) and any(".shared_experts." in n for n in fp8)
            assert all(tensors[n[: -len(".weight")] + ".scale"].dtype == "F8_E8M0" for n in fp8)
            assert {bp.resolver.format_for(tensors[n]).name for n in fp8} == {"fp8-e4m3-b128"}
        finally:
            bp.close()

    def test_experts_and_projections_stay_packed(self, case_name, tmp_path_factory):
        """On the CPU backend the fp4 experts compute as stored (``mxfp4pair``) and the fp8
        projections with the fp8 kernel, those whose rows are reordered at load (each
        head's rope channels first: wq_b, wkv, the indexer's wq_b) included, their 128-row
        blocks moving whole; only wo_a, read as an array, is float32."""
        fx = self._fixture(case_name, tmp_path_factory)
        bp = inspect_model(fx.path, backend="cpu")
        try:
            if not bp.backend.has_kernel("mxfp4pair"):
                pytest.skip("the CPU kernels are not built")
            params, resolver = bp.weights.params, bp.resolver
            fp8 = [n for n, p in params.items() if p.info.dtype == "F8_E4M3"]
            reordered = [n for n in fp8 if params[n].row_order is not None]
            assert {n.split(".attn.")[-1] for n in reordered} >= {"wq_b.weight", "wkv.weight"}
            for name in fp8:
                packed = bp.weights._packed(params[name], resolver, bp.backend)
                assert packed == (not name.endswith(".wo_a.weight")), name
            assert bp.weights.resident_bytes(resolver, bp.backend) < sum(4 * p.numel for p in params.values())
            info = bp.moe[0].matrices[0]["gate"]
            raw = bp.checkpoint.read_many(resolver.with_companions([info]))
            host = resolver.host_form(info, raw[info.name], {t.name: raw[t.name] for t in resolver.companions(info)},
                                      bp.backend, "linear")
            assert isinstance(host, QuantTensor) and host.kind == "mxfp4pair" and host.shape == params[
                next(n for n in params if n.endswith("shared_experts.w1.weight"))].shape
        finally:
            bp.close()


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return TestDeepseekV4NativeOracle.oracle("flash", tmp_path_factory)


def _rewrite_tensor(model_dir, name, dtype, array):
    """Replace one tensor of a single-file checkpoint (its dtype and bytes)."""
    path = model_dir / "model.safetensors"
    with Checkpoint(model_dir) as ck:
        dtypes = {n: t.dtype for n, t in ck.tensors.items()}
        tensors = {n: np.array(ck.read(n)) for n in ck.tensors}
    tensors[name], dtypes[name] = array, dtype
    write_safetensors(path, {n: (dtypes[n], t) for n, t in tensors.items()}, {"format": "pt"})


@pytest.mark.parametrize("name, dtype, make, expected", [
    ("layers.2.ffn.experts.3.w2.scale", "F8_E8M0", lambda s: np.full((s[0], s[1] + 1), 127, np.uint8),
     r"'layers\.2\.ffn\.experts\.3\.w2\.scale' must be .*\[160, 2\].*found F8_E8M0 \[160, 3\]"),
    ("layers.2.ffn.experts.3.w2.scale", "BF16", lambda s: np.zeros(s, np.uint16),
     r"'layers\.2\.ffn\.experts\.3\.w2\.scale' must be .*found BF16"),
    ("layers.1.attn.wq_a.scale", "F8_E8M0", lambda s: np.full((s[0] + 1, s[1]), 127, np.uint8),
     r"'layers\.1\.attn\.wq_a\.scale' has shape \[2, 2\].*'layers\.1\.attn\.wq_a\.weight'"),
], ids=["fp4-scale-shape", "fp4-scale-dtype", "fp8-scale-shape"])
def test_malformed_scales_are_refused_naming_the_tensor(native, tmp_path, name, dtype, make, expected):
    bad = tmp_path / "model"
    shutil.copytree(native.path, bad)
    with Checkpoint(bad) as ck:
        shape = ck.tensors[name].shape
    _rewrite_tensor(bad, name, dtype, make(shape))
    with pytest.raises(ModelFormatError, match=expected) as err:
        colibri_core.load(bad, history=False).close()
    assert "\n" not in str(err.value)


def test_fp4_experts_without_expert_dtype_are_refused(native, tmp_path):
    """Without ``expert_dtype: fp4`` nothing says what the I8 tensors hold: refused, never guessed."""
    bad = tmp_path / "model"
    shutil.copytree(native.path, bad)
    config = json.loads((bad / "config.json").read_text())
    del config["expert_dtype"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"'layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight' is stored as I8") as err:
        colibri_core.load(bad, history=False).close()
    assert "\n" not in str(err.value)


def test_convert_reads_the_published_layout(native, tmp_path):
    # --experts keep: the fp4 experts and fp8 projections copied as they are, config kept
    keep = tmp_path / "keep"
    done = run_colibri("convert", "--model", native.path, "--out", keep, "--experts", "keep", timeout=300)
    assert done.returncode == 0, done.stderr
    config = json.loads((keep / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8" and config["expert_dtype"] == "fp4"
    with colibri_core.load(keep, history=False) as model:
        assert model.generate(token_ids=native.prompt, max_tokens=len(native.tokens), ignore_eos=True).token_ids \
            == native.tokens
    # experts and linear weights to float32 (fp4 and fp8 values are exact in float32): the
    # same model; wo_a, which the attention reads as an array, is copied as it is (fp8), so
    # quantization_config stays
    exact = tmp_path / "f32"
    done = run_colibri("convert", "--model", native.path, "--out", exact, "--experts", "f32", "--dense", "f32",
                       timeout=300)
    assert done.returncode == 0, done.stderr
    with Checkpoint(exact) as ck:
        assert not any(t.dtype == "I8" for t in ck.tensors.values())
        assert {n for n, t in ck.tensors.items() if t.dtype == "F8_E4M3"} == \
            {n for n in ck.tensors if n.endswith(".attn.wo_a.weight")}
    assert json.loads((exact / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    with colibri_core.load(exact, cap=1, history=False) as model:
        result = model.generate(token_ids=native.prompt, max_tokens=len(native.tokens), ignore_eos=True,
                                return_logits=True)
    assert result.token_ids == native.tokens
    assert float(np.abs(np.stack(result.logits) - native.step_logits).max()) < 1e-4
    # requantised to int4 experts: it loads and runs
    done = run_colibri("convert", "--model", native.path, "--out", tmp_path / "int4", "--experts", "int4", timeout=300)
    assert done.returncode == 0, done.stderr
    with colibri_core.load(tmp_path / "int4", history=False) as model:
        assert len(model.generate(token_ids=native.prompt, max_tokens=4, ignore_eos=True).token_ids) == 4


def test_deepseek_v4_head_order_moves_whole_blocks():
    order = head_order(512, 64)  # V4-Flash / -Pro heads
    assert sorted(order) == list(range(512))
    np.testing.assert_array_equal(order[:64], rope_first(512, 64)[:64])  # rope channels first, de-interleaved
    assert block_sources(rows_of(order, 64), 128) is not None  # wq_b: 64 heads
    assert block_sources(rows_of(rope_first(512, 64), 64), 128) is None
    np.testing.assert_array_equal(head_order(128, 64), rope_first(128, 64))  # the indexer's heads: one block each
    np.testing.assert_array_equal(head_order(16, 8), rope_first(16, 8))


def test_fp4_scales_stored_as_f32_powers_of_two_are_read_and_others_refused():
    from colibri_core.formats.fp4_e2m1 import exponents
    from colibri_core.io.safetensors import TensorInfo

    info = TensorInfo("layers.3.ffn.experts.0.w1.scale", "model.safetensors", "F32", (1, 3), 0, 12)
    np.testing.assert_array_equal(exponents(np.array([[1.0, 0.25, 2.0**-127]], np.float32), info), [[127, 125, 0]])
    with pytest.raises(ModelFormatError, match=r"'layers\.3\.ffn\.experts\.0\.w1\.scale' holds values that are not powers"):
        exponents(np.array([[0.3, 1.0, 1.0]], np.float32), info)
