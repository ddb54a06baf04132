"""The ct-int4-g32 weight format (compressed-tensors pack-quantized int4, Kimi K2.5's
experts): decode equals the specification's numbers exactly, the CPU kernel computes with
the packed bytes, and malformed checkpoints are refused with one line naming the tensor."""

import json

import numpy as np
import pytest

from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.compute.reference import ReferenceBackend
from colibri_core.errors import ColibriError
from colibri_core.formats.base import FormatResolver, QuantTensor
from colibri_core.io.checkpoint import Checkpoint
from colibri_core.io.safetensors import write_safetensors
from colibri_core.plugins.discovery import get_registry
from colibri_core.testing.compressed_tensors import quantization_config

NAME = "model.layers.1.mlp.experts.0.down_proj"


def pack_by_spec(values: np.ndarray) -> np.ndarray:
    """int4 values (rows, cols) in -8..7 -> int32 (rows, ceil(cols / 8)): value + 8 in
    bits 4j..4j+3 of word i for element 8i + j (compressed-tensors' pack_to_int32),
    written element by element."""
    rows, cols = values.shape
    out = np.zeros((rows, -(-cols // 8)), dtype=np.uint32)
    for r in range(rows):
        for c in range(cols):
            out[r, c // 8] |= np.uint32(int(values[r, c]) + 8) << np.uint32(4 * (c % 8))
    return out.view(np.int32)


def bf16_bits(x) -> np.ndarray:
    return (np.asarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)  # exact for these scales


def example(rows=5, cols=72, seed=0):
    """int4 values, bf16-exact scales (one per 32 inputs, the last group partial) and the
    float32 weight they mean."""
    rng = np.random.default_rng(seed)
    values = rng.integers(-8, 8, (rows, cols))
    scales = np.ldexp(rng.integers(1, 128, (rows, -(-cols // 32))).astype(np.float32), -12)  # 7 bits: bf16 exact
    weight = (values * np.repeat(scales, 32, axis=1)[:, :cols]).astype(np.float32)
    return values, scales, weight


def write(path, tensors, qc=None, ignore=()):
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(path / "model.safetensors", tensors)
    config = {"model_type": "test", "quantization_config": qc if qc is not None else quantization_config(list(ignore))}
    (path / "config.json").write_text(json.dumps(config))
    return path


def layout(values, scales, rows, cols, name=NAME):
    return {name + ".weight_packed": pack_by_spec(values), name + ".weight_scale": ("BF16", bf16_bits(scales)),
            name + ".weight_shape": np.array([rows, cols], dtype=np.int64)}


def resolve(path):
    ck = Checkpoint(path)
    config = json.loads((path / "config.json").read_text())
    return ck, FormatResolver(get_registry(), ck, config)


@pytest.mark.parametrize("rows, cols", [(5, 72), (3, 16), (4, 64)])
def test_decode_equals_the_specification_exactly(tmp_path, rows, cols):
    values, scales, weight = example(rows, cols)
    path = write(tmp_path / "m", layout(values, scales, rows, cols))
    ck, resolver = resolve(path)
    with ck:
        info = ck.info(resolver.stored_name(NAME + ".weight"))
        assert info.name == NAME + ".weight_packed"
        assert resolver.format_for(info).name == "ct-int4-g32"
        assert resolver.logical_shape(info) == (rows, cols) and resolver.logical_name(info) == NAME + ".weight"
        np.testing.assert_array_equal(resolver.read_decoded(ck, [info])[info.name], weight)


@pytest.mark.parametrize("m", [1, 3, 70])  # decode, a few rows, and past the kernels' switch to BLAS
def test_the_cpu_kernel_computes_with_the_packed_bytes(tmp_path, m):
    rows, cols = 96, 160  # a partial last group of 32 inputs
    values, scales, weight = example(rows, cols, seed=1)
    path = write(tmp_path / "m", layout(values, scales, rows, cols))
    ck, resolver = resolve(path)
    cpu = CpuBackend()
    with ck:
        info = ck.info(NAME + ".weight_packed")
        assert resolver.kept_packed(info, cpu, "linear") and not resolver.kept_packed(info, ReferenceBackend(), "linear")
        raw = ck.read_many(resolver.with_companions([info]))
        packed = resolver.host_form(info, raw[info.name], {t.name: raw[t.name] for t in resolver.companions(info)}, cpu,
                                    "linear")
    assert isinstance(packed, QuantTensor) and packed.kind == "q4g32" and packed.shape == (rows, cols)
    x = np.random.default_rng(2).standard_normal((m, cols)).astype(np.float32)
    want = x @ weight.T
    got = cpu.linear(x, packed)
    # 4-bit weights take int8 activations on AVX2 (as q4; docs/formats.md); exact otherwise
    tol = 3e-2 if cpu.kernels.INT4_INTEGER_PATH and m <= 64 else 1e-5
    assert np.abs(got - want).max() <= tol * np.abs(want).max()


def bad_cases():
    values, scales, _ = example(4, 64)
    good = layout(values, scales, 4, 64)
    yield "missing scale", {k: v for k, v in good.items() if not k.endswith("_scale")}, None, NAME + ".weight_scale"
    yield "missing shape", {k: v for k, v in good.items() if not k.endswith("_shape")}, None, NAME + ".weight_shape"
    yield "inconsistent shape", {**good, NAME + ".weight_shape": np.array([4, 80], dtype=np.int64)}, None, \
        NAME + ".weight_shape"
    yield "packed dtype", {**good, NAME + ".weight_packed": pack_by_spec(values).astype(np.int64)}, None, \
        NAME + ".weight_packed"
    yield "scale shape", {**good, NAME + ".weight_scale": ("BF16", bf16_bits(scales[:, :1]))}, None, NAME + ".weight_scale"
    yield "scale dtype", {**good, NAME + ".weight_scale": scales.astype(np.int32)}, None, NAME + ".weight_scale"
    yield "zero points", {**good, NAME + ".weight_zero_point": np.zeros((4, 2), dtype=np.int32)}, None, \
        NAME + ".weight_packed"
    qc = quantization_config([])
    qc["config_groups"]["group_0"]["weights"]["group_size"] = 128
    yield "group size", good, qc, "group_size"
    qc = quantization_config([])
    qc["config_groups"]["group_0"]["weights"]["symmetric"] = False
    yield "asymmetric", good, qc, "symmetric"
    qc = quantization_config([])
    qc["config_groups"]["group_0"]["format"] = qc["format"] = "int-quantized"
    yield "format", good, qc, "int-quantized"
    yield "ignored module", good, quantization_config(["re:.*experts.*"]), NAME


@pytest.mark.parametrize("tensors, qc, named", [pytest.param(*c[1:], id=c[0]) for c in bad_cases()])
def test_malformed_checkpoints_are_refused_with_one_line_naming_the_tensor(tmp_path, tensors, qc, named):
    path = write(tmp_path / "m", tensors, qc)
    ck, resolver = resolve(path)
    with ck, pytest.raises(ColibriError) as err:
        resolver.format_for(ck.info(NAME + ".weight_packed"))
    message = str(err.value)
    assert named in message and "\n" not in message, message


def test_the_portable_kernel_path_passes_the_kernel_tests_too():
    """This machine's best path ran above; the portable C loops run here in a child
    process held to them (COLIBRI_KERNEL_PATH)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLIBRI_KERNEL_PATH": "portable"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k",
                          "kernel_computes"], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "3 passed" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


def test_a_weight_shape_that_disagrees_with_its_layouts_first_is_refused_when_read(tmp_path):
    """The first weight of a layout is checked against its weight_shape at claim time;
    the others (thousands of experts) when their weight_shape is read with them."""
    values, scales, _ = example(4, 64)
    other = NAME.replace("experts.0", "experts.1")
    tensors = {**layout(values, scales, 4, 64), **layout(values, scales, 4, 64, other)}
    tensors[other + ".weight_shape"] = np.array([4, 57], dtype=np.int64)  # packs the same way as 64
    ck, resolver = resolve(write(tmp_path / "m", tensors))
    with ck:
        first, second = ck.info(NAME + ".weight_packed"), ck.info(other + ".weight_packed")
        assert resolver.logical_shape(first) == resolver.logical_shape(second) == (4, 64)
        resolver.read_decoded(ck, [first])
        with pytest.raises(ColibriError, match=r"experts\.1\.down_proj\.weight_shape.*\[4, 57\]") as err:
            resolver.read_decoded(ck, [second])
    assert "\n" not in str(err.value)
