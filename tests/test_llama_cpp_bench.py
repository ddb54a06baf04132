"""benchmarks/llama_cpp_bench.py's ``--experts-apart``: the routed experts of a
DeepSeek-V3-shaped fp8 checkpoint written into llama.cpp's GGUF one expert at a time
(llama.cpp's converter stacks a layer's experts in float32 first: 15 GB per tensor at the
real shape). Checked with the ``gguf`` package alone (no llama.cpp build here): the dense
GGUF's metadata and tensors are copied, and every expert tensor dequantises to the fp8
weights times their block scales, within Q4_0's rounding."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(model: Path, name: str) -> np.ndarray:
    """fp8 e4m3 weight times its 128 x 128 block scales, computed here apart from the script."""
    from safetensors import safe_open

    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(model / index[name]), framework="pt") as f:
        w = f.get_tensor(name).float().numpy()
    with safe_open(str(model / index[name + "_scale_inv"]), framework="pt") as f:
        s = f.get_tensor(name + "_scale_inv").float().numpy()
    full = np.kron(s, np.ones((128, 128), dtype=np.float32))[: w.shape[0], : w.shape[1]]
    return w * full


def test_experts_apart_writes_each_expert_as_q4_0(tmp_path):
    gen = script("synthetic_frontier")
    model = gen.write(gen.parse(["--out", str(tmp_path / "fr"), "--tiny", "--moe-layers", "2", "--dense-layers", "1"]))
    config = json.loads((model / "config.json").read_text())
    dense = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(str(dense), arch="deepseek2")
    w.add_block_count(3)
    w.add_string("test.marker", "kept")
    w.add_tensor("token_embd.weight", np.arange(64 * 8, dtype=np.float32).reshape(8, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    out = tmp_path / "model.gguf"
    script("llama_cpp_bench").add_experts(dense, model, out)
    r = gguf.GGUFReader(str(out))
    assert r.fields["test.marker"].contents() == "kept"
    assert r.fields["deepseek2.block_count"].contents() == 3
    found = {t.name: t for t in r.tensors}
    assert np.array_equal(found["token_embd.weight"].data, np.arange(64 * 8, dtype=np.float32).reshape(8, 64))
    n = config["n_routed_experts"]
    assert sorted(found) == sorted(["token_embd.weight"] + [f"blk.{layer}.ffn_{p}_exps.weight" for layer in (1, 2)
                                                          for p in ("gate", "up", "down")])
    assert not list(tmp_path.glob(".model.gguf.partial-*"))  # written beside, renamed into place
    for layer in (1, 2):
        for proj, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            t = found[f"blk.{layer}.ffn_{short}_exps.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.Q4_0
            got = gguf.quants.dequantize(t.data, t.tensor_type)
            for e in range(n):
                want = reference(model, f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight")
                assert got[e].shape == want.shape
                # Q4_0: per 32 weights, scale d = (the largest magnitude, signed) / -8; rounding
                # errs by at most |d| / 2, except at the clipped end (up to |d|)
                blocks = want.reshape(-1, 32)
                bound = np.abs(blocks).max(axis=1, keepdims=True) / 8 * 1.01 + 1e-7  # d is stored as float16
                assert np.all(np.abs(got[e].reshape(-1, 32) - blocks) <= bound), (layer, proj, e)
            # the bound is loose enough that experts mixed up might pass it: expert 0 is nearer itself
            other = reference(model, f"model.layers.{layer}.mlp.experts.1.{proj}.weight")
            assert np.abs(got[0] - reference(model, f"model.layers.{layer}.mlp.experts.0.{proj}.weight")).mean() < \
                np.abs(got[0] - other).mean()
