"""fp8 weights keep their block scales when their rows are reordered by whole blocks
(``formats.base.permute_rows``, ``block_sources``), as DeepSeek-V4's rope-first head
order does with 128-row blocks. An order that splits a block is refused (the weight is
then decoded first)."""

import numpy as np
import pytest

from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.formats.base import QuantTensor, block_sources, permute_rows, rows_stay_packed
from colibri_core.formats.fp8 import dequantize, e4m3_to_f32


def _fp8(rows, cols, block, seed=0):
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 0x7E, size=(rows, cols), dtype=np.uint8)  # no NaN codes
    codes |= (rng.integers(0, 2, size=(rows, cols)) << 7).astype(np.uint8)
    scales = np.ldexp(np.float32(1.0), rng.integers(-8, 2, size=(-(-rows // block[0]), -(-cols // block[1]))))
    return QuantTensor("fp8", codes, scales.astype(np.float32), (rows, cols), block)


@pytest.mark.parametrize("rows, block", [(512, (128, 128)), (300, (128, 64)), (48, (16, 16))])
def test_rows_moved_by_whole_blocks_stay_packed_and_compute_the_same(rows, block):
    bm = block[0]
    n = -(-rows // bm)
    full = [j for j in range(n) if min(bm, rows - j * bm) == bm]
    rng = np.random.default_rng(1)
    # whole blocks in another order (the partial last block stays last), rows shuffled inside each
    blocks = list(rng.permutation(full)) + [j for j in range(n) if j not in full]
    order = np.concatenate([j * bm + rng.permutation(min(bm, rows - j * bm)) for j in blocks])
    assert list(block_sources(order, bm)) == blocks and rows_stay_packed("fp8", block, order)
    w = _fp8(rows, 160, block)
    moved = permute_rows(w, order)
    assert isinstance(moved, QuantTensor) and moved.kind == "fp8" and moved.block == block
    reference = dequantize(e4m3_to_f32(w.data), w.scales, block)
    np.testing.assert_array_equal(dequantize(e4m3_to_f32(moved.data), moved.scales, block), reference[order])
    x = rng.standard_normal((3, 160)).astype(np.float32)
    cpu = CpuBackend()
    np.testing.assert_allclose(cpu.linear(x, moved), cpu.linear(x, w)[:, order], rtol=1e-5, atol=1e-5)


def test_an_order_splitting_a_block_is_refused():
    order = np.concatenate([np.arange(64, 128), np.arange(0, 64), np.arange(128, 256)])
    assert block_sources(order, 128) is not None  # within block 0: fine
    split = np.concatenate([np.arange(192, 256), np.arange(0, 192)])  # V4's plain rope_first on 256 channels
    assert block_sources(split, 128) is None and not rows_stay_packed("fp8", (128, 128), split)
    assert permute_rows(_fp8(256, 32, (128, 128)), split) is None
    assert rows_stay_packed("q8", (1, 1), split)  # per-row scales: any order

