"""The built-in demo: built once, atomically, big enough to matter, and it streams."""

import json

import pytest

import colibri_core
from colibri_core.cli.demo import DEFAULT_SPEC, MARKER, DemoSpec, ensure_demo_model, is_complete

from colibri_core.testing.cli import run_colibri

TINY = DemoSpec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
                intermediate_size=16, tokenizer_vocab=300, shard_bytes=30_000, cached_experts_per_layer=2)


def test_default_demo_is_at_least_a_gigabyte():
    assert DEFAULT_SPEC.disk_bytes >= 1_000_000_000


def test_demo_model_is_built_once_and_reused(tmp_path):
    path = tmp_path / "demo"
    ensure_demo_model(path, TINY)
    assert is_complete(path, TINY)
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) > 1 and (path / "model.safetensors.index.json").exists()
    assert sum(f.stat().st_size for f in shards) >= TINY.disk_bytes
    stamp = (path / MARKER).stat().st_mtime_ns
    ensure_demo_model(path, TINY)
    assert (path / MARKER).stat().st_mtime_ns == stamp  # not rebuilt
    changed = DemoSpec(**{**TINY.__dict__, "seed": 1})
    ensure_demo_model(path, changed)
    assert is_complete(path, changed) and not is_complete(path, TINY)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial dirs left


def test_an_interrupted_build_leaves_nothing_usable_behind(tmp_path, monkeypatch):
    from colibri_core.cli import demo

    def fail_midway(out, spec, progress=None):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "build_demo_model", fail_midway)
    with pytest.raises(KeyboardInterrupt):
        ensure_demo_model(tmp_path / "demo", TINY)
    assert list(tmp_path.iterdir()) == []


def test_the_demo_checks_its_family_before_writing_anything(tmp_path, monkeypatch):
    from colibri_core.errors import UnsupportedModelError
    from colibri_core.plugins.discovery import reset_manager

    monkeypatch.setenv("COLIBRI_DISABLE_PLUGINS", "colibri-olmoe")
    reset_manager()
    with pytest.raises(UnsupportedModelError, match="no installed family runs model_type 'olmoe'"):
        ensure_demo_model(tmp_path / "demo", TINY)
    assert list(tmp_path.iterdir()) == []
    # the command too: one line, exit 2, and not a byte of the 1.3 GB default model
    out = run_colibri("demo", "--size", "full", "--dir", tmp_path / "demo", "--max-tokens", "1",
                      env={"COLIBRI_DISABLE_PLUGINS": "colibri-olmoe"}, timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("error: no installed family runs model_type 'olmoe'"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_demo_model_runs_and_its_text_is_decodable(tmp_path):
    path = ensure_demo_model(tmp_path / "demo", TINY)
    with colibri_core.load(path, ram=TINY.default_budget(path), history=False) as model:
        assert model.placement.slots == TINY.cached_experts_per_layer
        result = model.generate("Once upon a time", max_tokens=8, ignore_eos=True)
    assert isinstance(result.text, str) and len(result.token_ids) == 8
    assert result.stats.bytes_read > 0


def test_colibri_demo_command_end_to_end(tmp_path):
    """The real default demo (1.3 GB on disk): experts must stream under its budget."""
    out = run_colibri("demo", "--size", "full", "--dir", tmp_path / "demo", "--max-tokens", "6", "--json", timeout=600)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    stats = data["stats"]
    assert stats["cache_slots"] == DEFAULT_SPEC.cached_experts_per_layer
    assert stats["bytes_read"] > 0 and stats["hit_rate"] < 1
    assert len(data["token_ids"]) >= 1
    size = sum(f.stat().st_size for f in (tmp_path / "demo").glob("*.safetensors"))
    assert size >= 1_000_000_000


def test_the_default_demo_streams_the_trained_model():
    """``colibri demo`` runs colibri-trained's OLMoE-geometry model with a quarter of the
    experts cached: its text is real text and experts are read from disk."""
    trained = pytest.importorskip("colibri_trained", reason="colibri-trained is not installed")
    out = run_colibri("demo", "--json", "--max-tokens", "24", timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["size"] == "trained" and data["model_dir"] == str(trained.path("olmoe"))
    # 16 experts per layer: all LRU on a first run, half of them pinned once the routing
    # history (kept in the user cache dir, across runs) holds enough tokens
    layers = json.loads((trained.path("olmoe") / "config.json").read_text())["num_hidden_layers"]
    stats = data["stats"]
    assert stats["cache_slots"] + stats["pinned_experts"] // layers == DEFAULT_SPEC.cached_experts_per_layer
    assert stats["bytes_read"] > 0 and stats["hit_rate"] < 1
    assert len(data["token_ids"]) >= 1 and data["text"].strip()
    # its routing history goes to the cache dir, never into the installed model
    assert not (trained.path("olmoe") / "colibri-usage.json").exists()


def test_the_trained_demo_says_how_to_get_its_model(monkeypatch):
    import sys

    from colibri_core.cli.demo import trained_demo_path
    from colibri_core.errors import UsageError

    monkeypatch.setitem(sys.modules, "colibri_trained", None)  # as if not installed
    with pytest.raises(UsageError, match="pip install colibri-trained.*--size full"):
        trained_demo_path()


def test_the_full_size_demo_options_need_size_full(tmp_path):
    out = run_colibri("demo", "--dir", tmp_path / "demo", "--max-tokens", "1", timeout=60)
    assert out.returncode == 2 and out.stderr.startswith("error: --dir builds the full-size demo: add --size full")
    assert not (tmp_path / "demo").exists()
