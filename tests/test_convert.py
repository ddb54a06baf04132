"""colibri convert: containers that load and agree with their source, resumable and
byte-identical, refusing to mix choices; and the quality report."""

import json
import shutil

import pytest

import colibri_core
from colibri_core.cli.convert import MANIFEST, convert, quality_report
from colibri_core.cli.demo import DemoSpec
from colibri_core.errors import UsageError
from colibri_core.io.safetensors import SafetensorsFile

from colibri_core.testing.cli import run_colibri

SPEC = DemoSpec(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
                intermediate_size=96, tokenizer_vocab=300, shard_bytes=60_000, router_std=1.0)


@pytest.fixture(scope="module")
def source(demo_model):
    """The model converted, over several shards."""
    assert len(list(demo_model.glob("*.safetensors"))) >= 3
    return demo_model


def tree_bytes(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


# a random tiny model's logits have small margins and its routing flips easily: the
# bounds are loose for 4-bit formats, tight for 8 and 16 bits
@pytest.mark.parametrize("experts, dense, min_cosine, min_agreement", [
    ("int4", "keep", 0.97, 0.5), ("int8", "int8", 0.999, 0.9), ("mxfp4", "int4", 0.9, 0.4), ("bf16", "f32", 0.99999, 0.98)])
def test_converted_model_loads_and_tracks_its_source(source, tmp_path, experts, dense, min_cosine, min_agreement):
    out = tmp_path / "out"
    result = convert(source, out, experts=experts, dense=dense)
    assert result.tensors_converted > 0 and (out / "config.json").exists() and (out / "tokenizer.json").exists()
    stamped = {}
    for shard in out.glob("*.safetensors"):
        stamped.update(json.loads(SafetensorsFile(shard).metadata.get("colibri.tensors", "{}")))
    expert_fmt = {"int4": "int4-gs64", "int8": "int8-row", "mxfp4": "mxfp4"}.get(experts)
    if expert_fmt:
        assert stamped["model.layers.0.mlp.experts.3.up_proj.weight"] == {"fmt": expert_fmt, "shape": [96, 64]}
    assert "model.layers.0.mlp.gate.weight" not in stamped  # routers keep their precision
    assert "model.embed_tokens.weight" not in stamped
    report = quality_report(source, out)
    assert report["cosine_mean"] > min_cosine and report["greedy_agreement"] >= min_agreement, report
    with colibri_core.load(out, cap=1, history=False) as model:
        result = model.generate("Once upon", max_tokens=6, ignore_eos=True)
        assert len(result.token_ids) == 6 and result.stats.bytes_read > 0


def test_int4_experts_take_a_seventh_of_float32_memory(source, tmp_path):
    out = tmp_path / "out"
    convert(source, out, experts="int4", dense="int8")
    with colibri_core.load(source, history=False) as a, colibri_core.load(out, history=False) as b:
        h, i = SPEC.hidden_size, SPEC.intermediate_size
        assert a.placement.expert_bytes == 3 * h * i * 2  # bf16 source stays bf16
        gate_up = i * (h // 64) * (32 + 2)  # rows x groups x (32 packed bytes + a bfloat16 scale)
        down = h * -(-i // 64) * (32 + 2)  # 96 inputs pad to two groups of 64
        assert b.placement.expert_bytes == 2 * gate_up + down
        assert b.placement.dense_bytes < a.placement.dense_bytes


def test_int4_containers_with_float32_scales_still_run(source, tmp_path):
    """Containers written before int4 scales became bfloat16 hold float32 ones: they load
    and give the same logits (the float32 values are the bfloat16 ones widened)."""
    import numpy as np

    from colibri_core.formats.base import bf16_to_f32
    from colibri_core.io.safetensors import as_array, write_safetensors

    new = tmp_path / "new"
    convert(source, new, experts="int4", dense="int4")
    old = tmp_path / "old"
    shutil.copytree(new, old)
    widened = 0
    for shard in sorted(old.glob("*.safetensors")):
        f = SafetensorsFile(shard)
        tensors = []
        for name, info in f.tensors.items():
            raw = np.empty(info.nbytes, np.uint8)
            f.read_into(info.offset, memoryview(raw))
            array = as_array(info, raw)
            if name.endswith(".qs") and info.dtype == "BF16":
                tensors.append((name, ("F32", bf16_to_f32(array))))
                widened += 1
            else:
                tensors.append((name, (info.dtype, array)))
        metadata = f.metadata
        f.close()
        write_safetensors(shard, tensors, metadata)
    assert widened > 0
    with colibri_core.load(new, history=False) as a, colibri_core.load(old, history=False) as b:
        assert b.placement.expert_bytes > a.placement.expert_bytes  # two more bytes per scale
        ids = [5, 17, 42, 7]
        np.testing.assert_array_equal(a.generate(token_ids=ids, max_tokens=5, ignore_eos=True, return_logits=True).logits,
                                      b.generate(token_ids=ids, max_tokens=5, ignore_eos=True, return_logits=True).logits)


def test_an_interrupted_conversion_resumes_to_the_same_bytes(source, tmp_path, monkeypatch):
    whole = tmp_path / "whole"
    convert(source, whole, experts="int4", dense="int8")

    from colibri_core.cli import convert as convert_module

    real_commit = convert_module.StreamWriter.commit
    calls = {"n": 0}

    def failing_commit(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # the second shard never lands
        return real_commit(self)

    resumed = tmp_path / "resumed"
    monkeypatch.setattr(convert_module.StreamWriter, "commit", failing_commit)
    with pytest.raises(KeyboardInterrupt):
        convert(source, resumed, experts="int4", dense="int8")
    monkeypatch.setattr(convert_module.StreamWriter, "commit", real_commit)
    manifest = json.loads((resumed / MANIFEST).read_text())
    assert len(manifest["done"]) == 1 and not manifest["complete"]
    assert not list(resumed.glob("*.tmp-*")) or True  # a leftover temporary file is cleaned up on resume
    result = convert(source, resumed, experts="int4", dense="int8")
    assert result.shards_resumed == 1 and result.shards_written == len(list(source.glob("*.safetensors"))) - 1
    assert not list(resumed.glob("*.tmp-*"))
    assert tree_bytes(resumed) == tree_bytes(whole)


def test_mixing_choices_in_one_directory_is_refused(source, tmp_path):
    out = tmp_path / "out"
    convert(source, out, experts="int4")
    with pytest.raises(UsageError, match="refusing to mix"):
        convert(source, out, experts="int8")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not a colibri conversion"):
        convert(source, other)


def make_fp8(source, dest):
    """An fp8 block-scaled copy of ``source`` (DeepSeek's layout: e4m3 weights and
    ``<name>_scale_inv``, quantization_config in config.json) of its projections."""
    import torch

    from colibri_core.io.checkpoint import Checkpoint
    from colibri_core.formats.base import bf16_to_f32
    from colibri_core.io.safetensors import write_safetensors
    from colibri_core.testing.fp8 import quantize_blocks

    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    with Checkpoint(source) as ckpt:
        tensors = {}
        for name, info in ckpt.tensors.items():
            value = bf16_to_f32(ckpt.read(name))
            if name.endswith("_proj.weight"):
                q, scale = quantize_blocks(torch.from_numpy(value), (128, 128))
                tensors[name] = ("F8_E4M3", q.view(torch.uint8).numpy())
                tensors[name + "_scale_inv"] = scale.numpy()
            else:
                tensors[name] = value
    write_safetensors(dest / "model.safetensors", tensors)
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_an_fp8_source_converts_and_keeps_quantization_config_only_while_fp8_remains(source, tmp_path):
    fp8 = make_fp8(source, tmp_path / "fp8")
    experts_only = tmp_path / "experts-only"
    convert(fp8, experts_only, experts="int4", dense="keep")
    config = json.loads((experts_only / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"  # attention stays fp8
    with colibri_core.load(experts_only, history=False) as model:
        q = model.lm.layers[0].attn.q.weight
        assert q.value.kind == "fp8"  # read natively, computed by the fp8 kernel
    everything = tmp_path / "everything"
    convert(fp8, everything, experts="int8", dense="int8")
    assert "quantization_config" not in json.loads((everything / "config.json").read_text())
    assert not [n for n in json.loads((everything / "model.safetensors.index.json").read_text())["weight_map"]
                if n.endswith("_scale_inv")]
    assert quality_report(fp8, everything)["cosine_mean"] > 0.999


def test_cli_convert_json(source, tmp_path):
    out = run_colibri("convert", "--model", source, "--out", tmp_path / "out", "--experts", "int8", "--json", "--report")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["tensors_converted"] > 0 and data["report"]["greedy_agreement"] > 0.8
    again = run_colibri("convert", "--model", source, "--out", tmp_path / "out", "--experts", "int4")
    assert again.returncode == 2 and "refusing to mix" in again.stderr


def test_convert_writes_an_integrity_manifest_of_what_it_wrote(source, tmp_path):
    from colibri_core.io import integrity
    from colibri_core.io.checkpoint import Checkpoint

    src = tmp_path / "src"
    shutil.copytree(source, src)
    with Checkpoint(src) as checkpoint:
        integrity.write(checkpoint)  # the source's manifest describes the source, not the conversion
    out = tmp_path / "out"
    convert(src, out, experts="int4", dense="int8")
    with Checkpoint(out) as checkpoint:
        manifest = integrity.Manifest.read(checkpoint)
        assert manifest is not None and set(manifest.digests) == set(checkpoint.tensors)
        assert integrity.mismatches(checkpoint, manifest) == []
    shard = sorted(out.glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-1] ^= 0xFF  # the last byte belongs to the last tensor
    shard.write_bytes(bytes(raw))
    with Checkpoint(out) as checkpoint:
        assert len(integrity.mismatches(checkpoint, integrity.Manifest.read(checkpoint))) == 1


@pytest.mark.parametrize("experts", ["int4", "int8", "mxfp4", "f32"])
def test_fused_experts_convert_as_the_same_experts_stored_apart(source, tmp_path, experts):
    """Experts stored fused ((experts, 2 * inter, hidden) gate_up and (experts, hidden,
    inter) down, as transformers 5 and some published checkpoints keep them) convert one
    expert at a time into fused tensors of the target format: the model computes exactly
    what the same experts stored one tensor per expert compute after converting them, and
    each expert's slice is read on its own (one cached expert per layer)."""
    from colibri_core.testing.oracle import fuse_experts

    fused = tmp_path / "fused"
    assert fuse_experts(source, fused) == SPEC.num_hidden_layers
    apart, together = tmp_path / "apart", tmp_path / "together"
    convert(source, apart, experts=experts)
    result = convert(fused, together, experts=experts)
    assert result.tensors_converted == 2 * SPEC.num_hidden_layers
    stamped = {}
    for shard in together.glob("*.safetensors"):
        stamped.update(json.loads(SafetensorsFile(shard).metadata.get("colibri.tensors", "{}")))
    fmt = {"int4": "int4-gs64", "int8": "int8-row", "mxfp4": "mxfp4"}.get(experts)
    if fmt:
        h, i, n = SPEC.hidden_size, SPEC.intermediate_size, SPEC.num_experts
        assert stamped["model.layers.1.mlp.experts.gate_up_proj"] == {"fmt": fmt, "shape": [n, 2 * i, h]}
        assert stamped["model.layers.1.mlp.experts.down_proj"] == {"fmt": fmt, "shape": [n, h, i]}
    runs = []
    for path in (apart, together):
        with colibri_core.load(path, cap=1, history=False) as model:
            runs.append(model.generate("Once upon a time", max_tokens=8, ignore_eos=True, return_logits=True))
    assert runs[0].token_ids == runs[1].token_ids
    assert all((a == b).all() for a, b in zip(runs[0].logits, runs[1].logits))



def interrupted_after_first_shard(src, out, monkeypatch, **choices):
    """A conversion of ``src`` into ``out`` stopped once its first shard is written (as
    a kill would stop it: every finished shard and the manifest are already on disk)."""
    from colibri_core.cli import convert as convert_module

    real_commit = convert_module.StreamWriter.commit
    calls = {"n": 0}

    def failing_commit(self):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_commit(self)

    with monkeypatch.context() as patch:
        patch.setattr(convert_module.StreamWriter, "commit", failing_commit)
        with pytest.raises(KeyboardInterrupt):
            convert(src, out, **choices)
    assert len(json.loads((out / MANIFEST).read_text())["done"]) == 1


def rewrite_first_tensor_in_place(shard):
    """Flip the sign of every value of the shard's first tensor (bf16), in place: same
    size, same header; only the bytes and the file's times change."""
    import os

    sf = SafetensorsFile(shard)
    first = min(sf.tensors.values(), key=lambda t: t.offset)
    sf.close()
    before = os.stat(shard)
    with open(shard, "r+b") as f:
        f.seek(first.offset)
        values = bytearray(f.read(first.nbytes))
        for i in range(1, len(values), 2):
            values[i] ^= 0x80  # the sign bit of each little-endian bf16
        f.seek(first.offset)
        f.write(values)
    after = os.stat(shard)
    assert after.st_size == before.st_size
    assert (after.st_mtime_ns, after.st_ctime_ns) != (before.st_mtime_ns, before.st_ctime_ns)
    return first.name


def test_a_resumed_conversion_redoes_shards_whose_source_changed(source, tmp_path, monkeypatch):
    """Interrupted after shard 1, a tensor of source shard 1 rewritten, the same command
    again: the result is the conversion of the changed source (shard 1 redone, the
    integrity manifest describing it), not the stale shard."""
    src = tmp_path / "src"
    shutil.copytree(source, src)
    resumed = tmp_path / "resumed"
    interrupted_after_first_shard(src, resumed, monkeypatch, experts="int4", dense="int8")
    first_shard = sorted(src.glob("*.safetensors"))[0]
    stale = (resumed / first_shard.name).read_bytes()
    rewrite_first_tensor_in_place(first_shard)

    result = convert(src, resumed, experts="int4", dense="int8")
    assert result.shards_resumed == 0 and result.shards_written == len(list(src.glob("*.safetensors")))
    fresh = tmp_path / "fresh"
    convert(src, fresh, experts="int4", dense="int8")
    assert (resumed / first_shard.name).read_bytes() != stale
    assert tree_bytes(resumed) == tree_bytes(fresh)  # shards, index, integrity and conversion manifests alike
    out = run_colibri("doctor", "--model", resumed, "--deep", "--json")
    assert out.returncode == 0, out.stdout + out.stderr


def test_an_unchanged_source_still_resumes_and_a_version_1_manifest_is_redone(source, tmp_path, monkeypatch):
    src = tmp_path / "src"
    shutil.copytree(source, src)
    out = tmp_path / "out"
    interrupted_after_first_shard(src, out, monkeypatch, experts="int8")
    (src / "README.md").write_text("a file that is not a shard changes no shard")
    assert convert(src, out, experts="int8").shards_resumed == 1
    fresh = tmp_path / "fresh"
    convert(src, fresh, experts="int8")
    # what colibri before per-shard sources wrote: sizes only, which cannot tell a changed source
    manifest = json.loads((out / MANIFEST).read_text())
    manifest.update(colibri_convert=1, done={name: entry["size"] for name, entry in manifest["done"].items()},
                    complete=False, source_files={p.name: p.stat().st_size for p in sorted(src.glob("*.safetensors"))})
    (out / MANIFEST).write_text(json.dumps(manifest))
    result = convert(src, out, experts="int8")
    assert result.shards_resumed == 0
    assert tree_bytes(out) == tree_bytes(fresh)
