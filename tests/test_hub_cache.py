"""Models in the Hugging Face hub cache layout: snapshot files are symlinks into blobs/.

The tree is built here as huggingface_hub lays it out: models--ORG--NAME/{blobs/HASH,
snapshots/REV/NAME -> ../../blobs/HASH, refs/main}. The snapshot runs to the tokens of
the plain directory, the repo root stands for the refs/main snapshot, and index entries
that name paths outside the model directory are still refused.
"""

import hashlib
import json
import os
import shutil

import pytest

import colibri_core
from colibri_core.cli.demo import DemoSpec, build_demo_model
from colibri_core.errors import ModelFormatError
from colibri_core.io.checkpoint import INDEX_NAME

from colibri_core.testing.cli import run_colibri

SPEC = DemoSpec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts=4, num_experts_per_tok=2,
                intermediate_size=16, tokenizer_vocab=300, shard_bytes=20_000)
REVISION = "0123456789abcdef0123456789abcdef01234567"
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    path = tmp_path_factory.mktemp("hub") / "plain"
    build_demo_model(path, SPEC)
    return path


def make_hub_repo(plain, root):
    """models--org--name as huggingface_hub leaves it after a download."""
    repo = root / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    for f in sorted(plain.iterdir()):
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copy(f, repo / "blobs" / digest)
        os.symlink(f"../../blobs/{digest}", snapshot / f.name)
    return repo, snapshot


def tokens(path):
    with colibri_core.load(path, history=False, cap=1) as model:
        return model.generate(token_ids=PROMPT, max_tokens=6, ignore_eos=True).token_ids


def test_a_hub_cache_snapshot_runs_to_the_plain_directory_tokens(plain, tmp_path):
    repo, snapshot = make_hub_repo(plain, tmp_path)
    assert all((snapshot / f.name).is_symlink() for f in plain.iterdir())
    expected = tokens(plain)
    assert tokens(snapshot) == expected
    assert tokens(repo) == expected  # the repo root stands for refs/main's snapshot


def test_doctor_passes_a_hub_cache_snapshot_and_its_repo_root(plain, tmp_path):
    repo, snapshot = make_hub_repo(plain, tmp_path)
    for model in (snapshot, repo):
        out = run_colibri("doctor", "--model", model, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
        assert checks["headers and tensors"]["status"] == "pass"


def test_a_repo_root_whose_snapshot_is_missing_is_one_clear_error(plain, tmp_path):
    repo, snapshot = make_hub_repo(plain, tmp_path)
    (repo / "refs" / "main").write_text("feedface")
    out = run_colibri("run", "--model", repo, "--token-ids", "1,2", "--max-tokens", "1")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "refs/main" in out.stderr and "feedface" in out.stderr


@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors"])
def test_index_entries_naming_paths_outside_are_still_refused(plain, tmp_path, entry):
    repo, snapshot = make_hub_repo(plain, tmp_path)
    index_blob = (snapshot / INDEX_NAME).resolve()
    index = json.loads(index_blob.read_text())
    victim = index["weight_map"]["lm_head.weight"]
    outside = snapshot.parent / "outside.safetensors"
    shutil.copy(snapshot / victim, outside)  # a valid shard: only where the index points is wrong
    entry = str(outside) if entry == "ABSOLUTE" else entry
    index["weight_map"] = {k: (entry if v == victim else v) for k, v in index["weight_map"].items()}
    (snapshot / INDEX_NAME).unlink()
    (snapshot / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ModelFormatError, match="outside the model directory"):
        colibri_core.load(snapshot, history=False)
    out = run_colibri("doctor", "--model", snapshot, "--json")
    assert out.returncode == 1
    check = {c["name"]: c for c in json.loads(out.stdout)["checks"]}["headers and tensors"]
    assert check["status"] == "fail" and "outside the model directory" in check["detail"]
    assert "inside the model directory" in check["hint"] and "re-download" not in check["hint"]
