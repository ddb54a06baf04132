"""Experts stored with gate and up rows interleaved (gpt-oss, Inkling) are read with
their rows reordered, gate rows first, once per read: packed forms stay packed (rows
move with their scales), float and bias rows move too, and a kind whose scales span
rows (fp8) is refused by ``permute_rows`` so the reader decodes it instead."""

import json

import numpy as np

from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.experts.tiers import DiskTier
from colibri_core.formats.base import FormatResolver, QuantTensor, permute_rows
from colibri_core.formats.integer import Int4GS64, Int8Row
from colibri_core.io.checkpoint import Checkpoint
from colibri_core.io.drives import Drive
from colibri_core.io.safetensors import write_safetensors
from colibri_core.nn.weights import Weights
from colibri_core.plugins.discovery import get_registry
from colibri_core.testing.mxfp4 import quantize_mxfp4

ORDER = np.concatenate([np.arange(0, 64, 2), np.arange(1, 64, 2)])


def test_packed_rows_move_with_their_scales():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    cpu = CpuBackend()
    blocks, _exponents, _ = quantize_mxfp4(w)
    forms = {"mxfp4pair": QuantTensor("mxfp4pair", blocks.reshape(64, -1), _exponents, (64, 96))}
    for kind, fmt in (("q8", Int8Row()), ("q4", Int4GS64())):
        t = fmt.encode("w", w)
        forms[kind] = QuantTensor(kind, t["w"][1], t["w.qs"][1], (64, 96))
    for kind, packed in forms.items():
        moved = permute_rows(packed, ORDER)
        assert isinstance(moved, QuantTensor) and moved.kind == kind and moved.shape == packed.shape
        # rows are computed independently: the reordered weight gives the same outputs, reordered
        np.testing.assert_array_equal(cpu.linear(x, moved), cpu.linear(x, packed)[:, ORDER], err_msg=kind)
    np.testing.assert_array_equal(permute_rows(w, ORDER), w[ORDER])
    np.testing.assert_array_equal(permute_rows(w[:, 0], ORDER), w[ORDER, 0])  # a bias
    # fp8's scales cover blocks of rows: an order that mixes the rows of two blocks is refused
    fp8 = QuantTensor("fp8", np.zeros((64, 96), np.uint8), np.ones((4, 3), np.float32), (64, 96), (16, 32))
    assert permute_rows(fp8, ORDER) is None


def test_an_interleaved_mxfp4_expert_is_read_packed_with_gate_rows_first(tmp_path):
    rng = np.random.default_rng(1)
    count, inter, hidden = 2, 32, 64
    gate_up = rng.standard_normal((count, 2 * inter, hidden)).astype(np.float32)
    blocks, exponents, decoded = quantize_mxfp4(gate_up)
    bias = rng.standard_normal((count, 2 * inter)).astype(np.float32)
    name = "experts.gate_up_proj"
    write_safetensors(tmp_path / "model.safetensors", {name + "_blocks": blocks, name + "_scales": exponents,
                                                      name + "_bias": bias})
    config = {"model_type": "test", "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    cpu = CpuBackend()
    with Checkpoint(tmp_path) as ck:
        w = Weights(ck, FormatResolver(get_registry(), ck, config))
        decl = w.expert_layer(0, count, {"gate_up": (name, (2 * inter, hidden)), "gate_up_bias": (name + "_bias", (2 * inter,))},
                              interleaved=True)
        paths = {t.path for t in ck.tensors.values()}
        disk = DiskTier([Drive("primary", {p: p for p in paths})], w.resolver, cpu)
        order = np.concatenate([np.arange(0, 2 * inter, 2), np.arange(1, 2 * inter, 2)])
        for e in range(count):
            got = disk.load(0, e, decl.matrices[e]).arrays
            assert isinstance(got["gate_up"], QuantTensor) and got["gate_up"].kind == "mxfp4pair"  # not float32
            eye = np.eye(hidden, dtype=np.float32)
            np.testing.assert_array_equal(cpu.linear(eye, got["gate_up"]).T, decoded[e][order])
            np.testing.assert_array_equal(got["gate_up_bias"], bias[e][order])
