"""The mxfp4-hub weight format (gpt-oss's ``*_blocks`` / ``*_scales``): decode equals
transformers' ``convert_moe_packed_tensors`` and a float reference exactly, one expert's
slice of a fused tensor is read on its own, the CPU kernel computes with the packed bytes,
and malformed checkpoints are refused with one line naming the tensor."""

import json

import numpy as np
import pytest

from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.compute.reference import ReferenceBackend
from colibri_core.errors import ColibriError
from colibri_core.formats.base import FormatResolver, QuantTensor
from colibri_core.io.checkpoint import Checkpoint
from colibri_core.io.safetensors import write_safetensors
from colibri_core.nn.weights import Weights
from colibri_core.plugins.discovery import get_registry
from colibri_core.testing.mxfp4 import quantize_mxfp4

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
NAME = "model.layers.0.mlp.experts.gate_up_proj"
QC = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}


def example(shape, seed=0):
    """Random e2m1 codes and exponents for a weight of ``shape`` (..., rows, cols): the
    blocks and scales packed by hand from the format's description (byte j of a group:
    element 2j low nibble, 2j + 1 high), and the float32 weight they mean."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 16, shape).astype(np.uint8)
    exponents = rng.integers(120, 134, (*shape[:-1], shape[-1] // 32)).astype(np.uint8)
    magnitude = np.array(E2M1, dtype=np.float32)[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    weight = (magnitude * np.repeat(2.0 ** (exponents.astype(np.float64) - 127), 32, axis=-1)).astype(np.float32)
    pairs = codes.reshape(*shape[:-1], shape[-1] // 32, 16, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)
    return blocks, exponents, weight


def write(path, tensors, config=QC):
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(path / "model.safetensors", tensors)
    (path / "config.json").write_text(json.dumps({"model_type": "test", "quantization_config": config}))
    ck = Checkpoint(path)
    return ck, FormatResolver(get_registry(), ck, json.loads((path / "config.json").read_text()))


def test_decode_equals_transformers_and_the_float_reference(tmp_path):
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, exponents, weight = example((3, 8, 64))
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(exponents), dtype=torch.float32)
    np.testing.assert_array_equal(theirs.transpose(1, 2).numpy(), weight)  # transformers keeps (E, in, out)
    ck, resolver = write(tmp_path / "m", {NAME + "_blocks": blocks, NAME + "_scales": exponents})
    with ck:
        info = ck.info(resolver.stored_name(NAME))
        assert resolver.format_for(info).name == "mxfp4-hub" and resolver.logical_shape(info) == (3, 8, 64)
        assert resolver.logical_name(info) == NAME
        np.testing.assert_array_equal(resolver.read_decoded(ck, [info])[info.name], weight)


def test_the_test_helper_packs_what_the_format_reads(tmp_path):
    w = np.random.default_rng(1).standard_normal((2, 6, 96)).astype(np.float32)
    blocks, scales, dequantised = quantize_mxfp4(w)
    ck, resolver = write(tmp_path / "m", {NAME + "_blocks": blocks, NAME + "_scales": scales})
    with ck:
        info = ck.info(NAME + "_blocks")
        np.testing.assert_array_equal(resolver.read_decoded(ck, [info])[info.name], dequantised)
    assert np.abs(dequantised - w).max() <= 0.25 * np.abs(w).max()


def test_one_experts_slice_of_a_fused_tensor_is_read_on_its_own(tmp_path):
    E, inter, hidden = 4, 32, 64
    gu_blocks, gu_scales, gate_up = example((E, 2 * inter, hidden), seed=2)
    d_blocks, d_scales, down = example((E, hidden, inter), seed=3)
    down_name = NAME.replace("gate_up", "down")
    ck, resolver = write(tmp_path / "m", {NAME + "_blocks": gu_blocks, NAME + "_scales": gu_scales,
                                          down_name + "_blocks": d_blocks, down_name + "_scales": d_scales})
    with ck:
        decl = Weights(ck, resolver).swiglu_experts(0, "model.layers.0.mlp.experts", E, hidden, inter).decl
        for e in (0, 3):
            m = decl.matrices[e]
            assert m["up"].name == f"{NAME}_blocks[{e}][1/2]"
            read = ck.read_many(resolver.with_companions(list(m.values())))
            assert sum(v.nbytes for v in read.values()) < (gu_blocks.nbytes + d_blocks.nbytes) / 2  # this expert's bytes only
            decoded = resolver.decode_all(list(m.values()), read)
            np.testing.assert_array_equal(decoded[m["gate"].name], gate_up[e, :inter])
            np.testing.assert_array_equal(decoded[m["up"].name], gate_up[e, inter:])
            np.testing.assert_array_equal(decoded[m["down"].name], down[e])


@pytest.mark.parametrize("m", [1, 3, 70])
def test_the_cpu_kernel_computes_with_the_packed_bytes(tmp_path, m):
    blocks, exponents, weight = example((96, 160), seed=4)
    ck, resolver = write(tmp_path / "m", {"lm.weight_blocks": blocks, "lm.weight_scales": exponents})
    cpu = CpuBackend()
    with ck:
        info = ck.info(resolver.stored_name("lm.weight"))
        assert resolver.kept_packed(info, cpu, "linear") and not resolver.kept_packed(info, ReferenceBackend(), "linear")
        raw = ck.read_many(resolver.with_companions([info]))
        packed = resolver.host_form(info, raw[info.name], {t.name: raw[t.name] for t in resolver.companions(info)}, cpu,
                                    "linear")
    assert isinstance(packed, QuantTensor) and packed.kind == "mxfp4pair" and packed.shape == (96, 160)
    x = np.random.default_rng(5).standard_normal((m, 160)).astype(np.float32)
    want = x @ weight.T
    assert np.abs(cpu.linear(x, packed) - want).max() <= 1e-5 * np.abs(want).max()  # float32 products: no rounding


@pytest.mark.parametrize("k", [100, 160, 4144])
def test_the_cpu_kernel_computes_partial_groups_long_rows_and_extreme_exponents(k):
    """Rows longer than one of the AVX-512 path's K chunks, a partial last group, and
    extreme exponents (0, 1, 2, 200, 252: the AVX-512 path's per-exponent tables at their
    subnormal and largest finite entries); each row is compared at its own magnitude."""
    from colibri_core.compute.cpu import _kernels

    n, g = 19, -(-k // 32)
    rng = np.random.default_rng(k)
    codes = rng.integers(0, 16, (n, g * 32)).astype(np.uint8)
    codes[:, k:] = 0  # padding inputs of the last group are stored as zeros
    exponents = rng.integers(110, 140, (n, g)).astype(np.uint8)
    exponents[1, 0], exponents[2, -1], exponents[3, g // 2], exponents[5] = 0, 1, 2, 200
    codes[4], codes[4, 0], exponents[4, 0] = 0, 7, 252  # 6 * 2^125: the largest the exponent add takes
    magnitude = np.array(E2M1, np.float64)[codes & 7] * np.where(codes & 8, -1.0, 1.0)
    weight = (magnitude * np.repeat(2.0 ** (exponents.astype(np.float64) - 127), 32, axis=1))[:, :k]
    blocks = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    w = _kernels.weight("mxfp4pair", blocks, exponents, n, k)
    for m in (1, 2, 3, 5, 8, 9):
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[:, 0] = 0.25  # row 4's product stays finite
        out = np.empty((m, n), np.float32)
        _kernels.matmul(x, w, out)
        want = x.astype(np.float64) @ weight.T
        scale = np.abs(x).astype(np.float64) @ np.abs(weight).T  # each row's own magnitude
        assert (np.abs(out - want) <= 1e-6 * scale).all(), (m, np.abs(out - want).max())


def bad_cases():
    blocks, scales, _ = example((2, 8, 64))
    yield "missing scales", {NAME + "_blocks": blocks}, QC, NAME + "_scales"
    yield "scales shape", {NAME + "_blocks": blocks, NAME + "_scales": scales[:, :4]}, QC, NAME + "_scales"
    yield "scales dtype", {NAME + "_blocks": blocks, NAME + "_scales": scales.astype(np.float32)}, QC, NAME + "_scales"
    yield "blocks dtype", {NAME + "_blocks": blocks.astype(np.int16), NAME + "_scales": scales}, QC, NAME + "_blocks"
    yield "block width", {NAME + "_blocks": blocks.reshape(2, 8, 4, 8), NAME + "_scales": scales}, QC, NAME + "_blocks"


@pytest.mark.parametrize("tensors, config, named", [pytest.param(*c[1:], id=c[0]) for c in bad_cases()])
def test_malformed_checkpoints_are_refused_with_one_line_naming_the_tensor(tmp_path, tensors, config, named):
    ck, resolver = write(tmp_path / "m", tensors, config)
    with ck, pytest.raises(ColibriError) as err:
        resolver.format_for(ck.info(NAME + "_blocks"))
    assert named in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_blocks_without_an_mxfp4_config_are_not_claimed(tmp_path):
    blocks, scales, _ = example((2, 8, 64))
    ck, resolver = write(tmp_path / "m", {NAME + "_blocks": blocks, NAME + "_scales": scales}, {"quant_method": "other"})
    with ck:
        assert resolver.stored_name(NAME) == NAME  # no alias: a family asking for NAME finds it missing
        with pytest.raises(ColibriError, match="no installed weight format reads"):  # U8 bytes are not guessed to be e2m1
            resolver.format_for(ck.info(NAME + "_blocks"))


@pytest.mark.parametrize("level", ["avx2", "portable"])
def test_the_lower_kernel_paths_pass_the_kernel_tests_too(level):
    """This machine's best path ran above (AVX-512 where it has VBMI); the AVX2 and
    portable paths run here in child processes held to them (COLIBRI_KERNEL_PATH)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLIBRI_KERNEL_PATH": level}
    probe = subprocess.run([sys.executable, "-c", "from colibri_core.compute.cpu import _kernels; print(_kernels.MXFP4PAIR_PATH)"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == ("float" if level == "portable" else "avx2")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k",
                          "kernel_computes"], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "6 passed" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
