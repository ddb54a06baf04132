"""The host side of the kernels, without a GPU: the layouts the kernels read decode (by
the kernels' own bit operations, mirrored in numpy) to exactly the reference numbers of
every packed kind; the launch geometry covers every row, token and key once."""

import numpy as np
import pytest

from colibri_core.formats.base import QuantTensor, f32_to_bf16
from colibri_core.formats.fp8 import E4M3_TO_F32
from colibri_core.formats.integer import E2M1_VALUES, Int4GS64
from colibri_core.formats.reference import dequantize
from colibri_core.testing.backend_kit import pack
from colibri_cuda import geometry, layouts


def test_e4m3_decode_of_every_byte():
    codes = np.arange(256, dtype=np.uint8)
    ours, want = layouts.e4m3_value(codes), E4M3_TO_F32
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(want))
    finite = ~np.isnan(want)
    assert np.array_equal(ours[finite].view(np.uint32), want[finite].view(np.uint32))  # -0.0 too


def test_e2m1_decode_of_every_code():
    ours = layouts.e2m1_value(np.arange(16, dtype=np.uint8))
    assert np.array_equal(ours.view(np.uint32), E2M1_VALUES.view(np.uint32))


def test_e8m0_decode_of_every_exponent():
    e = np.arange(256, dtype=np.uint8)
    with np.errstate(over="ignore"):  # 255 is infinity, as in decode_mxfp4
        want = np.ldexp(np.float32(1.0), e.astype(np.int32) - 127).astype(np.float32)
    assert np.array_equal(layouts.e8m0_value(e).view(np.uint32), want.view(np.uint32))


def test_bf16_decode():
    bits = np.array([0, 0x8000, 0x3F80, 0xC120, 0x7F80, 0x0001], dtype=np.uint16)
    want = (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(layouts.bf16_value(bits).view(np.uint32), want.view(np.uint32))


SHAPES = [(5, 64), (7, 130), (33, 31), (129, 257)]  # whole groups, partial groups, partial fp8 blocks


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", layouts.KINDS)
def test_the_kernels_layout_decodes_to_the_reference(kind, shape):
    rng = np.random.default_rng(shape[0] * shape[1])
    w = (rng.standard_normal(shape) * 0.3).astype(np.float32)
    stored = pack(kind, w)
    host = layouts.host_pack(stored)
    assert host.nbytes == layouts.packed_nbytes(kind, shape, stored.block)
    assert all(a.flags.c_contiguous for a in host.arrays())
    got, want = layouts.decode(host), dequantize(stored)
    assert got.dtype == np.float32 and got.shape == shape
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), f"{kind}: not bit-identical"


def test_int4_with_float32_scales():
    """Containers written before bfloat16 scales: float32 scales, read as they are."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((6, 100)).astype(np.float32)
    tensors = Int4GS64().encode("w", w)
    data, bf16_scales = tensors["w"][1], tensors["w.qs"][1]
    f32_scales = (bf16_scales.astype(np.uint32) << 16).view(np.float32) * np.float32(1.001)  # not bfloat16 numbers
    stored = QuantTensor("q4", data, f32_scales, (6, 100))
    host = layouts.host_pack(stored)
    assert host.scales.dtype == np.float32
    assert np.array_equal(layouts.decode(host), dequantize(stored))


def test_fp8_block_is_carried():
    stored = pack("fp8", np.ones((70, 90), np.float32))
    host = layouts.host_pack(stored)
    assert (host.p0, host.p1) == tuple(stored.block) and host.scales.shape == (-(-70 // stored.block[0]),
                                                                              -(-90 // stored.block[1]))


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="no CUDA kernel"):
        layouts.host_pack(QuantTensor("q3", np.zeros(4, np.uint8), None, (2, 2)))


def test_bf16_weights_keep_two_bytes():
    stored = QuantTensor("bf16", f32_to_bf16(np.ones((3, 4), np.float32)), None, (3, 4))
    assert layouts.host_pack(stored).data.dtype == np.uint16 and layouts.packed_nbytes("bf16", (3, 4)) == 24


# -- geometry ------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", [1, 7, 8, 9, 16, 17, 70])
def test_token_slices_cover_each_token_once(tokens):
    slices = geometry.token_slices(tokens)
    covered = [t for first, end in slices for t in range(first, end)]
    assert covered == list(range(tokens))
    assert all(0 < end - first <= geometry.GEMV_MAX_TOKENS for first, end in slices)


@pytest.mark.parametrize("rows", [1, 4, 5, 4096, 151936])
def test_gemv_grid_has_a_warp_per_row(rows):
    grid, block = geometry.gemv_grid(rows)
    assert block == (geometry.ROWS_PER_BLOCK * geometry.WARP, 1, 1)
    assert grid[0] * geometry.ROWS_PER_BLOCK >= rows > (grid[0] - 1) * geometry.ROWS_PER_BLOCK


@pytest.mark.parametrize("seq", [1, 2, 63, 64, 65, 1000, 1024, 1025, 4096, 131072])
@pytest.mark.parametrize("heads,tokens", [(1, 1), (16, 1), (32, 8), (64, 70)])
@pytest.mark.parametrize("sms", [1, 132])
def test_attention_split_covers_the_keys_without_empty_splits(seq, heads, tokens, sms):
    split = geometry.attention_split(seq, heads, tokens, sms)
    assert 1 <= split.chunk <= geometry.ATTENTION_MAX_CHUNK
    assert split.splits * split.chunk >= seq > (split.splits - 1) * split.chunk
    assert split.chunk >= min(seq, geometry.ATTENTION_MIN_CHUNK)


def test_attention_split_fills_the_gpu_on_long_decodes():
    split = geometry.attention_split(32768, 8, 1, 132)
    assert split.splits * 8 >= 2 * 132


def test_limits():
    assert geometry.attention_fits(576) and not geometry.attention_fits(2048)
    assert geometry.router_fits(256, 8) and not geometry.router_fits(8, 9) and not geometry.router_fits(8192, 8)
    assert geometry.uses_gemv(1) and geometry.uses_gemv(geometry.GEMV_TOKEN_LIMIT)
    assert not geometry.uses_gemv(geometry.GEMV_TOKEN_LIMIT + 1)
