"""Weight formats plug in through the quant hook: a format claims tensors from evidence
in the checkpoint and reads companion tensors; conflicting claims are refused."""

import numpy as np
import pytest

import colibri_core
from colibri_core.errors import UnsupportedModelError
from colibri_core.formats.base import QuantFormat
from colibri_core.plugins.registry import QuantSpec
from colibri_core.io.checkpoint import Checkpoint
from colibri_core.io.safetensors import write_safetensors
from colibri_core.testing import registered_plugin

from toy_family import ToyPlugin, write_toy_model


class RowInt8(QuantFormat):
    """Test format: int8 values with a float32 scale per row in a sibling '<name>.qs'."""

    name = "test-int8-row"

    def matches(self, info, context):
        return info.dtype == "I8" and f"{info.name}.qs" in context.checkpoint.tensors

    def companions(self, info, lookup):
        return [lookup(f"{info.name}.qs")]

    def decode(self, info, raw, companions):
        return raw.astype(np.float32) * companions[f"{info.name}.qs"][:, None]


class Greedy(RowInt8):
    name = "test-greedy"


def plugin(*formats):
    class P:
        @colibri_core.hookimpl
        def colibri_register_quants(self, register):
            for f in formats:
                register(QuantSpec(f.name, f"{__name__}:{f.__name__}"))

    return P()


def quantise_experts(model_dir):
    """Rewrite the toy checkpoint with every expert matrix as int8 + row scales; return
    the dequantised float32 tensors (what a correct reader must compute with)."""
    path = model_dir / "model.safetensors"
    with Checkpoint(model_dir) as ckpt:
        tensors = {name: ckpt.read(name) for name in ckpt.tensors}
    out, reference = {}, {}
    for name, value in tensors.items():
        if ".experts." in name:
            scale = np.abs(value).max(axis=1) / 127
            q = np.round(value / scale[:, None]).astype(np.int8)
            out[name], out[f"{name}.qs"] = q, scale.astype(np.float32)
            reference[name] = q.astype(np.float32) * scale[:, None].astype(np.float32)
        else:
            out[name] = reference[name] = value
    write_safetensors(path, out)
    return reference


def test_a_plugged_in_format_reads_companions_and_matches_its_float_equivalent(tmp_path):
    quant_dir = write_toy_model(tmp_path / "q")
    reference = quantise_experts(quant_dir)
    float_dir = write_toy_model(tmp_path / "f")
    write_safetensors(float_dir / "model.safetensors", reference)

    with registered_plugin(ToyPlugin(), "toy"):
        with pytest.raises(UnsupportedModelError, match="I8, which no installed weight format reads"):
            colibri_core.load(quant_dir)
        with registered_plugin(plugin(RowInt8), "int8-plugin"):
            with colibri_core.load(quant_dir, cap=1) as q, colibri_core.load(float_dir) as f:
                a = q.generate(token_ids=[1, 2, 3], max_tokens=6, return_logits=True)
                b = f.generate(token_ids=[1, 2, 3], max_tokens=6, return_logits=True)
                assert q.store.disk.bytes_read > 0
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logits, b.logits):
            np.testing.assert_array_equal(x, y)


def test_two_formats_claiming_one_tensor_is_refused(tmp_path):
    quant_dir = write_toy_model(tmp_path / "q")
    quantise_experts(quant_dir)
    with registered_plugin(ToyPlugin(), "toy"), registered_plugin(plugin(RowInt8, Greedy), "formats"):
        with pytest.raises(UnsupportedModelError, match="claimed by formats") as err:
            colibri_core.load(quant_dir)
        assert "'test-int8-row'" in str(err.value) and "'test-greedy'" in str(err.value)
