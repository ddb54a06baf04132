"""Models in the Hugging Face hub cache layout: snapshot files are symlinks into blobs/.

The tree is built here as huggingface_hub lays it out: models--ORG--NAME/{blobs/HASH,
snapshots/REV/NAME -> ../../blobs/HASH, refs/main}. The snapshot runs to the tokens of
the plain directory, the repo root stands for the refs/main snapshot, and index entries
that name paths outside the model directory are still refused. ``--model ORG/NAME``
(``--revision``) finds the repo in the local cache offline, in every core command, and
colibri's routing history for a snapshot goes to colibri's cache dir, never into the
hub cache.
"""

import json
import shutil

import pytest

import colibri_core
from colibri_core.cli.demo import DemoSpec
from colibri_core.errors import ModelFormatError
from colibri_core.io.checkpoint import INDEX_NAME

from colibri_core.testing import hub_cache
from colibri_core.testing.cli import run_colibri

SPEC = DemoSpec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts=4, num_experts_per_tok=2,
                intermediate_size=16, tokenizer_vocab=300, shard_bytes=20_000)
REVISION = hub_cache.REVISION
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def plain(demo_model):
    """The model in a plain directory, as colibri writes it."""
    return demo_model


def tokens(path):
    with colibri_core.load(path, history=False, cap=1) as model:
        return model.generate(token_ids=PROMPT, max_tokens=6, ignore_eos=True).token_ids


def test_a_hub_cache_snapshot_runs_to_the_plain_directory_tokens(plain, tmp_path):
    repo, snapshot = hub_cache.make_hub_repo(plain, tmp_path)
    assert all((snapshot / f.name).is_symlink() for f in plain.iterdir())
    expected = tokens(plain)
    assert tokens(snapshot) == expected
    assert tokens(repo) == expected  # the repo root stands for refs/main's snapshot


def test_doctor_passes_a_hub_cache_snapshot_and_its_repo_root(plain, tmp_path):
    repo, snapshot = hub_cache.make_hub_repo(plain, tmp_path)
    for model in (snapshot, repo):
        out = run_colibri("doctor", "--model", model, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        checks = {c["name"]: c for c in json.loads(out.stdout)["checks"]}
        assert checks["headers and tensors"]["status"] == "pass"


def test_a_repo_root_whose_snapshot_is_missing_is_one_clear_error(plain, tmp_path):
    repo, snapshot = hub_cache.make_hub_repo(plain, tmp_path)
    (repo / "refs" / "main").write_text("feedface")
    out = run_colibri("run", "--model", repo, "--token-ids", "1,2", "--max-tokens", "1")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "refs/main" in out.stderr and "feedface" in out.stderr


@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors"])
def test_index_entries_naming_paths_outside_are_still_refused(plain, tmp_path, entry):
    repo, snapshot = hub_cache.make_hub_repo(plain, tmp_path)
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


# -- --model ORG/NAME: a repo id found in the local Hugging Face cache ------------------------
OTHER_REVISION = "fedcba9876543210fedcba9876543210fedcba98"


@pytest.fixture
def hub(plain, tmp_path):
    """A hub cache holding org/name (refs/main and a tag v2 on a second snapshot), and the
    environment that points colibri at it and makes a download attempt fail."""
    cache = tmp_path / "hf-hub"
    repo, snapshot = hub_cache.make_hub_repo(plain, cache)
    other = repo / "snapshots" / OTHER_REVISION
    shutil.copytree(snapshot, other, symlinks=True)
    (repo / "refs" / "v2").write_text(OTHER_REVISION)
    return repo, snapshot, other, hub_cache.hub_env(cache, XDG_CACHE_HOME=str(tmp_path / "xdg"))


def listing(path):
    return sorted(p.name for p in path.rglob("*"))


def test_a_repo_id_runs_from_the_cache_and_its_history_goes_to_colibris_cache_dir(plain, hub, tmp_path):
    repo, snapshot, other, env = hub
    before = listing(repo)
    expected = tokens(plain)
    for args, snapshot_used in ((("--model", "org/name"), snapshot), (("--model", "org/name", "--revision", "v2"), other),
                                (("--model", "org/name", "--revision", OTHER_REVISION), other),
                                (("--model", repo, "--revision", "v2"), other)):
        out = run_colibri("run", *args, "--token-ids", ",".join(map(str, PROMPT)), "--max-tokens", "6", "--ignore-eos",
                          "--cap", "1", "--json", env=env)  # the routing history is saved (the default)
        assert out.returncode == 0, (args, out.stderr)
        assert json.loads(out.stdout)["token_ids"] == expected
    # nothing of colibri's in the hub cache: neither the history nor its lock or temporary files
    assert listing(repo) == before
    saved = list((tmp_path / "xdg" / "colibri" / "usage").glob("*.json"))
    assert len(saved) == 2, saved  # one history per snapshot used
    assert json.loads(saved[0].read_text())["tokens"] > 0


def test_every_command_that_reads_a_model_takes_a_repo_id(hub, tmp_path):
    repo, snapshot, other, env = hub
    doctor = run_colibri("doctor", "--model", "org/name", "--json", env=env)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}["model directory"]["detail"] == str(snapshot)
    plan = run_colibri("plan", "--model", "org/name", "--revision", "v2", "--disk-bw", "1G", "--json", env=env)
    assert plan.returncode == 0 and json.loads(plan.stdout)["model_dir"] == str(other), plan.stderr
    out = tmp_path / "converted"
    convert = run_colibri("convert", "--model", "org/name", "--out", out, "--experts", "int8", "--json", env=env,
                          timeout=300)
    assert convert.returncode == 0 and (out / "config.json").is_file(), convert.stderr
    bench = run_colibri("bench", "--model", "org/name", "--tokens", "2", "--prompt-tokens", "4", "--repeats", "1",
                        "--json", env=env, timeout=300)
    assert bench.returncode == 0 and json.loads(bench.stdout)["model"] == str(snapshot), bench.stderr
    for command in ("run", "doctor", "plan", "convert", "bench"):  # serve and chat: colibri-serve's tests
        help_text = run_colibri(command, "--help", env={"COLUMNS": "200"}).stdout
        assert "--revision" in help_text and "repo id" in help_text, command


@pytest.mark.parametrize("command", ["run", "doctor", "plan", "convert", "bench"])
def test_a_repo_id_not_in_the_cache_is_one_clear_line_and_nothing_is_downloaded(hub, tmp_path, command):
    *_, env = hub
    extra = {"run": ["--token-ids", "1"], "convert": ["--out", tmp_path / "out"]}.get(command, [])
    out = run_colibri(command, "--model", "org/missing", *extra, env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --model org/missing:"), out.stderr
    assert "Hugging Face" in lines[0] and str(tmp_path / "hf-hub") in lines[0] and "hf download org/missing" in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, said", [
    (["--model", "org/name", "--revision", "nope"], "at revision nope"),
    (["--model", "REPO", "--revision", "nope"], "has no branch, tag or downloaded commit"),
    (["--model", "SNAPSHOT", "--revision", "v2"], "is a model directory; --revision picks"),
], ids=["repo-id", "repo-root", "plain-directory"])
def test_a_revision_that_is_not_there_is_one_clear_line(hub, args, said):
    repo, snapshot, other, env = hub
    args = [{"REPO": repo, "SNAPSHOT": snapshot}.get(a, a) for a in args]
    out = run_colibri("run", *args, "--token-ids", "1", env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and said in out.stderr, out.stderr
