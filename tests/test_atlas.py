"""``colibri atlas``: routing counts per domain equal an independent count of the router's
choices and leave the model's output alone; the atlas's arithmetic (shares, affinities,
entropies, domain information) on hand-made counts; the verdict on random weights and on
the trained model; bad input as one line naming the path; the atomic write beside the
routing history."""

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

import colibri_core
from colibri_core.engine.domain_routing import DomainRouting
from colibri_core.experts import atlas
from colibri_core.experts.history import READ_ONLY_MARKER, cache_path
from colibri_core.testing.cli import run_colibri
from colibri_core.testing.demo_specs import SMALL_RANDOM

SPEC = SMALL_RANDOM
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def prompts(tmp_path):
    """Two domains of real text: Python source and this repository's prose."""
    d = tmp_path / "prompts"
    d.mkdir()
    (d / "python.txt").write_text(Path(json.__file__).read_text())
    (d / "prose.txt").write_text((ROOT / "docs" / "serving.md").read_text())
    return d


@pytest.fixture
def cache(tmp_path, monkeypatch):
    home = tmp_path / "cache-home"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


# -- the arithmetic -----------------------------------------------------------------------
def test_profiles_on_hand_made_counts():
    # one layer, three experts, two domains; domain 0 gives 3x the tokens of domain 1
    counts = np.array([[[30, 10], [60, 0], [0, 0]]])
    p = atlas.domain_profiles(counts)
    assert p["tokens"][0].tolist() == [40, 60, 0]
    assert np.allclose(p["share"][0, :2], [[0.75, 0.25], [1.0, 0.0]])
    # the layer's routed tokens: 90 of domain 0, 10 of domain 1
    assert np.allclose(p["affinity"][0, 0], [0.75 / 0.9, 0.25 / 0.1])
    assert np.allclose(p["profile"][0, 0], np.array([0.75 / 0.9, 2.5]) / (0.75 / 0.9 + 2.5))
    q = p["profile"][0, 0]
    assert p["entropy_bits"][0, 0] == pytest.approx(-(q * np.log2(q)).sum())
    assert p["entropy"][0, 0] == pytest.approx(p["entropy_bits"][0, 0])  # log2(2) = 1
    assert p["entropy"][0, 1] == 0 and p["specialisation"][0, 1] == 1  # one domain only
    assert math.isnan(p["entropy"][0, 2])  # never routed


def test_a_specialist_needs_its_tokens_and_to_beat_the_random_routers():
    """One layer, two domains of 1000 tokens each, 20 experts: the random routers spread
    both domains alike (a mild lean, never one-sided); expert 0 takes 400 tokens almost
    all of domain 0, expert 1 five tokens all of domain 1: only expert 0 is a specialist."""
    rng = np.random.default_rng(0)
    counts = np.zeros((1, 20, 2), dtype=np.int64)
    counts[0, 0] = [390, 10]
    counts[0, 1] = [0, 5]
    counts[0, 2:] = [[610 // 18 + (i < 610 % 18), 985 // 18 + (i < 985 % 18)] for i in range(18)]
    null = rng.multinomial(1000, np.full(20, 1 / 20), size=(1, 8, 2)).transpose(0, 1, 3, 2)  # (1, 8 routers, 20, 2)
    rows = {r["expert"]: r for r in atlas.build(counts, null, ["a", "b"])["experts"]}
    assert rows[1]["specialisation"] == 1.0 and not rows[1]["specialist"]  # all one domain, but 5 tokens
    assert rows[0]["specialist"] and not any(rows[e]["specialist"] for e in range(2, 20))


def test_domain_information():
    separated = np.array([[[5, 0, 0, 0], [0, 5, 0, 0], [0, 0, 5, 0], [0, 0, 0, 5]]])
    assert atlas.domain_information(separated)[0] == pytest.approx(2.0)  # log2(4 domains)
    alike = np.array([[[3, 6], [1, 2], [4, 8]]])  # every domain spreads the same way
    assert atlas.domain_information(alike)[0] == pytest.approx(0.0, abs=1e-12)
    v = atlas.verdict(0.30, np.array([0.20, 0.21, 0.19, 0.20]))
    assert v["specialised"] and v["z"] == pytest.approx((0.30 - 0.20) / np.std([0.20, 0.21, 0.19, 0.20], ddof=1))
    assert not atlas.verdict(0.205, np.array([0.20, 0.21, 0.19, 0.20]))["specialised"]
    assert not atlas.verdict(0.22, np.array([0.20, 0.21, 0.19, 0.20]))["specialised"]  # above all, but z < 3


# -- counting -----------------------------------------------------------------------------
def test_counts_are_the_routers_choices_and_change_nothing(demo_model):
    with colibri_core.load(demo_model, history=False) as model:
        texts = [Path(json.__file__).read_text()[:3000], (ROOT / "docs" / "serving.md").read_text()[:3000]]
        wins = [[np.asarray(w) for w in np.array_split(model.encode(t)[:256], 4)] for t in texts]
        plain = [model.lm.forward(w, model.lm.new_cache(model.backend), model.backend) for ws in wins for w in ws]
        # an independent count: what the expert store is told each MoE layer used
        seen = np.zeros((2, SPEC.num_hidden_layers, SPEC.num_experts), dtype=np.int64)
        end_layer, domain = model.store.end_layer, [0]

        def counting(layer, indices, experts):
            seen[domain[0], layer] += np.bincount(np.asarray(indices).ravel(), minlength=SPEC.num_experts)
            return end_layer(layer, indices, experts)

        model.store.end_layer = counting
        with DomainRouting(model, 2) as routing:
            for d, ws in enumerate(wins):
                domain[0] = d
                routing.add(d, ws, batch=3)
            model.store.end_layer = end_layer
            tapped = [model.lm.forward(w, model.lm.new_cache(model.backend), model.backend) for ws in wins for w in ws]
    assert np.array_equal(routing.counts, seen.transpose(1, 2, 0))
    assert routing.tokens.tolist() == [sum(len(w) for w in ws) for ws in wins]
    assert (routing.counts.sum(1) == routing.tokens * SPEC.num_experts_per_tok).all()
    assert (routing.null.sum(2) == routing.tokens * SPEC.num_experts_per_tok).all()  # each random router: top-k too
    for a, b in zip(plain, tapped):
        assert np.array_equal(a, b)  # the taps change no logit


# -- the command --------------------------------------------------------------------------
def test_random_weights_have_nothing_to_show(demo_model, prompts, cache):
    shutil_copy = __import__("shutil").copytree(demo_model, cache.parent / "model")
    done = run_colibri("atlas", "--model", shutil_copy, "--prompts", prompts, env={"XDG_CACHE_HOME": str(cache)})
    assert done.returncode == 0, done.stderr
    assert "nothing to show" in done.stderr
    path = shutil_copy / atlas.FILENAME  # a writable model directory: beside its colibri-usage.json
    doc = json.loads(path.read_text())
    assert doc["verdict"]["specialised"] is False and doc["verdict"]["z"] < 3
    assert doc["domains"] == ["prose", "python"] and doc["model"]["moe_layers"] == SPEC.num_hidden_layers
    counts = np.asarray(doc["counts"])
    assert [d["tokens"] for d in doc["input"]["domains"]] == (counts.sum(1)[0] // SPEC.num_experts_per_tok).tolist()
    e = doc["experts"][3]
    p = atlas.domain_profiles(counts)
    assert e["affinity"] == pytest.approx(p["affinity"][0, 3].tolist(), rel=1e-5)
    assert e["entropy"] == pytest.approx(float(p["entropy"][0, 3]), rel=1e-5)
    assert not list(path.parent.glob(".colibri-atlas.json.tmp-*"))
    assert atlas.find(shutil_copy) == path


@pytest.mark.slow
def test_the_trained_model_is_specialised(trained_olmoe, cache):
    done = run_colibri("atlas", "--model", trained_olmoe, "--max-tokens", "4096", "--json",
                       env={"XDG_CACHE_HOME": str(cache)}, timeout=600)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    v, s = out["verdict"], out["summary"]
    assert v["specialised"] and v["z"] >= 3 and v["observed_bits"] > v["random_max_bits"]
    assert s["specialist_share"] > 0.03  # about 1 % of a random model's experts pass the bar
    # an installed package's model: the atlas goes beside its history, in the cache dir
    assert (trained_olmoe / READ_ONLY_MARKER).exists()
    assert out["path"] == str(cache_path(trained_olmoe).with_name(cache_path(trained_olmoe).stem + ".atlas.json"))
    assert str(cache) in out["path"]


def test_bad_input_is_one_line_naming_the_path(demo_model, tmp_path):
    def fails(prompts, *files):
        d = tmp_path / prompts
        d.mkdir(exist_ok=True)
        for name, data in files:
            (d / name).parent.mkdir(parents=True, exist_ok=True)
            (d / name).write_bytes(data)
        done = run_colibri("atlas", "--model", demo_model, "--prompts", d, "--out", tmp_path / "a.json")
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
        assert not (tmp_path / "a.json").exists()
        return lines[0]

    missing = run_colibri("atlas", "--model", demo_model, "--prompts", tmp_path / "nowhere")
    assert missing.returncode == 2 and missing.stderr.strip() == f"error: --prompts {tmp_path / 'nowhere'}: not found"
    assert "at least 2" in fails("none")
    assert "at least 2" in fails("one", ("a.txt", b"some text"))
    assert fails("empty", ("a.txt", b"some text"), ("b.txt", b" \n")) == f"error: {tmp_path / 'empty' / 'b.txt'}: empty (a prompt file needs text)"
    line = fails("binary", ("a.txt", b"some text"), ("b.txt", b"caf\xe9 au lait"))
    assert str(tmp_path / "binary" / "b.txt") in line and "not UTF-8" in line
    (tmp_path / "subdirs" / "empty-domain").mkdir(parents=True)
    assert f"{tmp_path / 'subdirs' / 'empty-domain'}: a domain directory with no files" in fails("subdirs", ("a/x.md", b"text"))


def test_the_write_is_atomic(tmp_path, monkeypatch):
    target = tmp_path / "model"
    target.mkdir()
    old = target / atlas.FILENAME
    old.write_text('{"format": 1, "old": true}')
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(colibri_core.errors.ResourceError, match="could not write the atlas"):
        atlas.write({"format": 1, "new": True}, target)
    assert old.read_text() == '{"format": 1, "old": true}'  # the old file whole, no temporary left anywhere
    assert sorted(p.name for p in target.iterdir()) == [atlas.FILENAME]
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert atlas.write({"format": 1, "new": True}, target) == old
    assert json.loads(old.read_text()) == {"format": 1, "new": True}
