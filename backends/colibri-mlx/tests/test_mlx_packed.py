"""Packed weights on MLX: every kind prepared once holds exactly the numbers of the
reference decode, reports the bytes it really takes, and multiplies within float32
rounding of x @ dequantize(w).T."""

import mlx.core as mx
import numpy as np
import pytest

from colibri_core.formats.base import QuantTensor, f32_to_bf16
from colibri_core.formats.reference import dequantize
from colibri_mlx import packed
from mlx_checks import host, mlx_backend, rng  # noqa: F401 (fixtures)

ROWS = 48


def q4(rng, k, scales="bf16"):
    g = -(-k // 64)
    data = rng.integers(0, 256, (ROWS, g * 32), dtype=np.uint8)
    s = (rng.standard_normal((ROWS, g)) * 0.05).astype(np.float32)
    return QuantTensor("q4", data, f32_to_bf16(s) if scales == "bf16" else s, (ROWS, k))


def mxfp4(rng, k, every_exponent=False):
    g = -(-k // 32)
    if every_exponent:  # all 256 e8m0 exponents, 2^-127 .. 2^127 and NaN
        exponents = np.resize(np.arange(256, dtype=np.uint8), ROWS * g).reshape(ROWS, g)
    else:
        exponents = rng.integers(120, 130, (ROWS, g), dtype=np.uint8)
    return QuantTensor("mxfp4", rng.integers(0, 256, (ROWS, g * 16), dtype=np.uint8), exponents, (ROWS, k))


def bf16(rng, k):
    return QuantTensor("bf16", f32_to_bf16(rng.standard_normal((ROWS, k)).astype(np.float32)), None, (ROWS, k))


def q8(rng, k):
    data = rng.integers(-127, 128, (ROWS, k), dtype=np.int8)
    return QuantTensor("q8", data, (np.abs(rng.standard_normal(ROWS)) / 127).astype(np.float32), (ROWS, k))


def fp8(rng, k):
    codes = rng.integers(0, 256, (ROWS, k), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN codes
    scales = np.abs(rng.standard_normal((-(-ROWS // 128), -(-k // 128)))).astype(np.float32)
    return QuantTensor("fp8", codes, scales, (ROWS, k))


# (name, factory, kept in an MLX packed form)
CASES = [
    ("q4 bf16 scales", lambda rng: q4(rng, 256), True),
    ("q4 float32 scales", lambda rng: q4(rng, 256, "f32"), False),
    ("q4 padded group", lambda rng: q4(rng, 200), False),
    ("mxfp4", lambda rng: mxfp4(rng, 256), True),
    ("mxfp4 every exponent", lambda rng: mxfp4(rng, 256, every_exponent=True), True),
    ("mxfp4 padded group", lambda rng: mxfp4(rng, 80), False),
    ("bf16", lambda rng: bf16(rng, 96), True),
    ("q8", lambda rng: q8(rng, 96), False),
    ("fp8", lambda rng: fp8(rng, 160), False),
]


def dequantized(w) -> mx.array:
    """The prepared weight's numbers as MLX decodes them (``mx.dequantize`` for the
    quantised layouts)."""
    return w if isinstance(w, mx.array) else w.dequantized()


@pytest.mark.parametrize("name,make,native", CASES, ids=[c[0] for c in CASES])
def test_prepared_weight_holds_the_reference_numbers(mlx_backend, rng, name, make, native):
    w = make(rng)
    prepared = mlx_backend.prepare_weight(w)
    assert packed.has_native_form(w) == native
    assert isinstance(prepared, mx.array) != native
    if isinstance(prepared, packed.Quantized):
        assert prepared.data.dtype == mx.uint32  # MLX's own layout
    with np.errstate(over="ignore", invalid="ignore"):  # the extreme exponents overflow
        expected = dequantize(w)
    ours = host(mlx_backend, dequantized(prepared))
    assert ours.dtype == np.float32 and ours.shape == w.shape
    # bit for bit, except that MLX's affine decode scale * q + bias gives +0 where the
    # reference's (q - 8) * scale gives -0 (a negative scale times 0)
    equal = ours.view(np.uint32) == expected.view(np.uint32)
    signed_zero = (ours == 0) & (expected == 0)
    both_nan = np.isnan(ours) & np.isnan(expected)
    assert (equal | signed_zero | both_nan).all()
    assert mlx_backend.nbytes(prepared) == mlx_backend.weight_nbytes(w.kind, w.shape, w.nbytes)


FINITE = [c for c in CASES if "every exponent" not in c[0]]


@pytest.mark.parametrize("name,make,native", FINITE, ids=[c[0] for c in FINITE])
@pytest.mark.parametrize("t", [1, 7])
def test_packed_products_and_rows(mlx_backend, rng, name, make, native, t):
    w = make(rng)
    expected = dequantize(w)
    prepared = mlx_backend.prepare_weight(w)
    x = rng.standard_normal((t, w.shape[1])).astype(np.float32)
    reference = x @ expected.T
    ours = host(mlx_backend, mlx_backend.linear(mlx_backend.asarray(x), prepared))
    # quantized_matmul sums in its own order: float32 rounding, relative to the products' size
    assert np.abs(ours - reference).max() <= 1e-5 * np.abs(x).max() * np.abs(expected).sum(axis=1).max()
    ids = np.array([3, 0, 3, ROWS - 1])
    np.testing.assert_array_equal(host(mlx_backend, mlx_backend.embedding(prepared, ids)), expected[ids])


def test_which_kinds_stay_packed(mlx_backend):
    for kind in ("q4", "mxfp4", "bf16"):
        assert mlx_backend.has_kernel(kind)
        assert mlx_backend.keeps_stored(kind, "linear") and mlx_backend.keeps_stored(kind, "embedding")
        assert not mlx_backend.keeps_stored(kind, "array")
    for kind in ("q8", "fp8"):  # no exact MLX form: the core hands them over decoded
        assert not mlx_backend.keeps_stored(kind, "linear") and not mlx_backend.keeps_stored(kind, "embedding")
    assert mlx_backend.weight_nbytes(None, (10, 64), 0) == 4 * 640


def test_nibble_repack_matches_mlx_quantize(rng):
    """The repacked codes sit where MLX's layout puts element i of a row: bits 4(i % 8)
    of uint32 i // 8 (codes recovered from the reference decode)."""
    w = q4(rng, 128)
    values = dequantize(w)
    scales = packed.bf16_to_f32(w.scales)
    codes = np.rint(values / np.repeat(scales, 64, axis=1)).astype(np.int64) + 8
    ours = packed.nibbles_to_mlx(w.data, ROWS, 64)
    mlx_packed = np.zeros((ROWS, 128 // 8), dtype=np.uint32)
    for i in range(8):
        mlx_packed |= codes[:, i::8].astype(np.uint32) << (4 * i)
    np.testing.assert_array_equal(ours, mlx_packed)
