"""The fp8-e4m3-b128 weight format: e4m3 decode equals torch's float8_e4m3fn, block
scales (full and partial blocks) equal transformers' dequantisation, and malformed
checkpoints are refused with errors naming the tensor."""


import numpy as np
import pytest

from colibri_core.io.checkpoint import Checkpoint
from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.formats.base import FormatResolver
from colibri_core.formats.fp8 import E4M3_TO_F32, FP8E4M3Block, dequantize, e8m0_to_f32
from colibri_core.plugins.discovery import get_registry

torch = pytest.importorskip("torch")


def test_every_e4m3_byte_decodes_like_torch():
    reference = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    nan = np.isnan(reference)
    assert nan.sum() == 2  # 0x7F and 0xFF
    np.testing.assert_array_equal(np.isnan(E4M3_TO_F32), nan)
    np.testing.assert_array_equal(E4M3_TO_F32[~nan], reference[~nan])
    assert E4M3_TO_F32[0x7E] == 448 and E4M3_TO_F32[0x01] == 2.0**-9  # largest normal, smallest subnormal


def test_ue8m0_scales_are_powers_of_two():
    raw = np.array([0, 1, 126, 127, 128, 254], dtype=np.uint8)
    reference = torch.from_numpy(raw).view(torch.float8_e8m0fnu).float().numpy()
    np.testing.assert_array_equal(e8m0_to_f32(raw), reference)


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((200, 130), (128, 128)), ((7, 45), (4, 16)),
                                         ((1, 1), (128, 128))])
def test_block_dequantisation_equals_transformers(shape, block):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    g = torch.Generator().manual_seed(0)
    q = (torch.randn(shape, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand((-(-shape[0] // block[0]), -(-shape[1] // block[1])), generator=g) * 3e-3 + 1e-5
    expected = _dequantize_fp8_weight(q, scales, list(block), torch.float32).numpy()
    ours = dequantize(E4M3_TO_F32[q.view(torch.uint8).numpy()], scales.numpy(), block)
    np.testing.assert_array_equal(ours, expected)


def _fp8(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _resolver(ckpt, config):
    return FormatResolver(get_registry(), ckpt, config)


def test_resolver_claims_fp8_with_scales_and_decodes_through_read_decoded(tmp_path):
    raw = _fp8((130, 260))
    scale = np.array([[0.5, 2.0, 0.25], [1.5, 1.0, 4.0]], dtype=np.float32)
    from safetensors.torch import save_file

    save_file({"w.weight": torch.from_numpy(raw).view(torch.float8_e4m3fn),
               "w.weight_scale_inv": torch.from_numpy(scale)}, str(tmp_path / "model.safetensors"))
    config = {"model_type": "none", "quantization_config": QC}
    with Checkpoint(tmp_path) as ckpt:
        info = ckpt.info("w.weight")
        assert info.dtype == "F8_E4M3"
        resolver = _resolver(ckpt, config)
        assert resolver.format_for(info).name == "fp8-e4m3-b128"
        decoded = resolver.read_decoded(ckpt, [info])["w.weight"]
    full = np.repeat(np.repeat(scale, 128, axis=0)[:130], 128, axis=1)[:, :260]
    np.testing.assert_array_equal(decoded, E4M3_TO_F32[raw] * full)


def _save(tmp_path, tensors, quantization_config=QC):
    from safetensors.torch import save_file

    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = {"model_type": "none"}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    return config


def _fp8_tensor(shape):
    return torch.from_numpy(_fp8(shape)).view(torch.float8_e4m3fn)


def test_wrong_scale_shape_is_refused_naming_the_tensors(tmp_path):
    config = _save(tmp_path, {"layer.w.weight": _fp8_tensor((130, 260)), "layer.w.weight_scale_inv": torch.ones(1, 3)})
    with Checkpoint(tmp_path) as ckpt:
        with pytest.raises(ModelFormatError, match=r"'layer.w.weight_scale_inv' has shape \[1, 3\].*'layer.w.weight'.*\[2, 3\]"):
            _resolver(ckpt, config).format_for(ckpt.info("layer.w.weight"))


def test_block_size_comes_from_quantization_config(tmp_path):
    qc = dict(QC, weight_block_size=[64, 32])
    raw = _fp8_tensor((130, 70))
    scale = torch.rand(3, 3) + 0.5
    config = _save(tmp_path, {"w.weight": raw, "w.weight_scale_inv": scale}, qc)
    with Checkpoint(tmp_path) as ckpt:
        decoded = _resolver(ckpt, config).read_decoded(ckpt, [ckpt.info("w.weight")])["w.weight"]
    full = np.repeat(np.repeat(scale.numpy(), 64, axis=0)[:130], 32, axis=1)[:, :70]
    np.testing.assert_array_equal(decoded, E4M3_TO_F32[raw.view(torch.uint8).numpy()] * full)


@pytest.mark.parametrize("qc,error,match", [
    (dict(QC, weight_block_size=[128]), ModelFormatError, "weight_block_size must be two positive integers"),
    (dict(QC, weight_block_size=[0, 128]), ModelFormatError, "weight_block_size must be two positive integers"),
    (dict(QC, weight_block_size=None), UnsupportedModelError, "per-tensor"),
    (dict(QC, fmt="e5m2"), UnsupportedModelError, "fmt 'e5m2'"),
])
def test_bad_quantization_config_is_refused(tmp_path, qc, error, match):
    config = _save(tmp_path, {"w.weight": _fp8_tensor((8, 8)), "w.weight_scale_inv": torch.ones(1, 1)}, qc)
    with Checkpoint(tmp_path) as ckpt:
        with pytest.raises(error, match=match):
            _resolver(ckpt, config).format_for(ckpt.info("w.weight"))


def test_fp8_without_scales_is_refused_naming_the_missing_tensor(tmp_path):
    config = _save(tmp_path, {"w.weight": _fp8_tensor((8, 8)), "other": torch.ones(2)})
    with Checkpoint(tmp_path) as ckpt:
        with pytest.raises(ModelFormatError, match="'w.weight' is float8 e4m3 but has no block scales 'w.weight_scale_inv'"):
            _resolver(ckpt, config).format_for(ckpt.info("w.weight"))
    # without a quantization_config nothing claims it, and the dtype alone is not enough
    config = _save(tmp_path, {"w.weight": _fp8_tensor((8, 8)), "other": torch.ones(2)}, None)
    with Checkpoint(tmp_path) as ckpt:
        with pytest.raises(UnsupportedModelError, match="F8_E4M3, which no installed weight format reads"):
            _resolver(ckpt, config).format_for(ckpt.info("w.weight"))


def test_bf16_and_ue8m0_scale_tensors(tmp_path):
    raw = _fp8_tensor((4, 6))
    for scale in (torch.tensor([[0.5]], dtype=torch.bfloat16), torch.tensor([[0.25]]).to(torch.float8_e8m0fnu)):
        config = _save(tmp_path, {"w.weight": raw, "w.weight_scale_inv": scale})
        with Checkpoint(tmp_path) as ckpt:
            decoded = _resolver(ckpt, config).read_decoded(ckpt, [ckpt.info("w.weight")])["w.weight"]
        np.testing.assert_array_equal(decoded, raw.float().numpy() * scale.float().item())


def test_quantization_config_of_a_wrapped_text_model_is_read(tmp_path):
    _save(tmp_path, {"w.weight": _fp8_tensor((8, 8)), "w.weight_scale_inv": torch.ones(1, 1)}, None)
    config = {"model_type": "kimi_k25", "text_config": {"quantization_config": dict(QC, weight_block_size=[4, 4])}}
    with Checkpoint(tmp_path) as ckpt:
        with pytest.raises(ModelFormatError, match=r"needs \[2, 2\]"):
            _resolver(ckpt, config).format_for(ckpt.info("w.weight"))


def test_listed_as_a_weight_format():
    entry = get_registry().get("quant", "fp8-e4m3-b128")
    assert isinstance(entry.spec.load()(), FP8E4M3Block)
