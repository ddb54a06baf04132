"""Every distribution is publishable, and installs from built files as a user installs.

tools/build_dists.sh builds an sdist and a wheel of each (discovered) distribution into
dist/ and runs ``twine check --strict``; a fresh venv then installs colibri-core,
colibri-glm, colibri-olmoe and colibri-trained from that folder with ``pip install --no-index
--find-links dist --find-links CACHE`` (CACHE: their third-party dependencies, fetched
from PyPI once with ``pip download`` and reused), and colibri-cuda with the CuPy it
depends on, lists the families and backends and runs a tiny demo model.
"""

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from colibri_core.cli.demo import DemoSpec, build_demo_model
from colibri_core.plugins.known import FAMILY_DISTRIBUTIONS

REPO = Path(__file__).resolve().parents[1]


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
TINY = DemoSpec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
                intermediate_size=16, tokenizer_vocab=300, shard_bytes=40_000)


def distributions() -> dict[str, dict]:
    """name -> [project] table of every pyproject.toml the build script builds."""
    paths = [REPO / "pyproject.toml"] + sorted(p for kind in ("families", "backends", "plugins", "models")
                                               for p in (REPO / kind).glob("*/pyproject.toml"))
    return {data["project"]["name"]: {**data["project"], "dir": path.parent}
            for path in paths for data in [tomllib.loads(path.read_text())]}


def test_versions_and_requirements_are_consistent():
    dists = distributions()
    core = Version(dists["colibri-core"]["version"])
    assert len(dists) > 1
    for name, project in dists.items():
        assert name.startswith("colibri-") and project["dir"].name in (name, REPO.name), name
        version = Version(project["version"])
        assert (version.major, version.minor) == (core.major, core.minor), f"{name} {version} is not of core's {core} series"
        assert project.get("readme"), f"{name}: no readme (twine check --strict refuses it)"
        if name == "colibri-core":
            continue
        needs = [Requirement(r) for r in project.get("dependencies", []) if Requirement(r).name == "colibri-core"]
        assert needs, f"{name} does not require colibri-core"
        assert all(core in r.specifier for r in needs), f"{name} requires {needs}, which excludes colibri-core {core}"


def test_errors_name_real_distributions():
    dists = distributions()
    for model_type, distribution in FAMILY_DISTRIBUTIONS.items():
        assert distribution in dists, f"{model_type}: {distribution} is not built from this repository"
    from colibri_core.plugins.discovery import get_registry

    registry = get_registry()
    for model_type, family in registry.model_types.items():
        entry = registry.get("family", family)
        package = entry.spec.load().__module__.split(".")[0]
        owner = next((n for n, p in dists.items() if (p["dir"] / package).is_dir()), None)
        if owner is not None:  # a family of this repository (not a test's toy)
            assert FAMILY_DISTRIBUTIONS.get(model_type) == owner, f"{model_type} is run by {owner}"


@pytest.fixture(scope="session")
def wheel_cache():
    """Third-party wheels colibri-core needs, downloaded from PyPI once per machine."""
    cache = Path(os.environ.get("COLIBRI_TEST_WHEELS", Path.home() / ".cache" / "colibri-test-wheels"))
    cache.mkdir(parents=True, exist_ok=True)
    return cache


@pytest.mark.slow
def test_the_built_distributions_install_as_a_user_installs_them(tmp_path, wheel_cache):
    pytest.importorskip("build", reason="the test extra brings build")
    pytest.importorskip("twine", reason="the test extra brings twine")
    source = tmp_path / "src"  # a clean copy: the build writes egg-info next to the sources
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                                                "__pycache__", "*.so"))
    built = subprocess.run(["bash", str(source / "tools" / "build_dists.sh"), sys.executable], capture_output=True,
                           text=True, timeout=1800)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    dist = source / "dist"
    names = {p.name.split("-")[0] for p in dist.iterdir()}
    for name in distributions():
        assert name.replace("-", "_") in names, f"{name} was not built"
    assert any(p.name.startswith("colibri_core-") and p.suffix == ".whl" for p in dist.iterdir())
    wanted = ["colibri-core", "colibri-glm", "colibri-olmoe", "colibri-cuda", "colibri-trained"]
    download = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--dest", str(wheel_cache),
                               "--find-links", str(dist), *wanted], capture_output=True, text=True, timeout=1800, env=ENV)
    assert download.returncode == 0, download.stderr[-3000:]
    # pip download copies colibri's own wheels into the cache too: a later run, or another
    # checkout, would find two different files of one name and version there and in dist/
    for own in wheel_cache.glob("colibri_*"):
        own.unlink()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-index", "--find-links", str(dist),
                              "--find-links", str(wheel_cache), *wanted], capture_output=True, text=True, timeout=1800,
                             env=ENV)
    assert install.returncode == 0, install.stderr[-3000:]
    colibri = str(venv / "bin" / "colibri")
    listed = subprocess.run([colibri, "list-families", "--json"], capture_output=True, text=True, env=ENV, timeout=300)
    assert listed.returncode == 0, listed.stderr
    by_type = {t: row["distribution"] for row in json.loads(listed.stdout) for t in row["model_types"]}
    assert by_type["glm4_moe"] == "colibri-glm" and by_type["olmoe"] == "colibri-olmoe", by_type
    backends = subprocess.run([colibri, "list-backends", "--json"], capture_output=True, text=True, env=ENV, timeout=300)
    assert backends.returncode == 0, backends.stderr
    by_name = {row["backend"]: row for row in json.loads(backends.stdout)}
    assert by_name["cpu"]["available"] and "cuda" in by_name, by_name
    if not by_name["cuda"]["available"]:  # no GPU or no CuPy here: it says why
        assert by_name["cuda"]["reason"], by_name["cuda"]
    model = tmp_path / "tiny"
    build_demo_model(model, TINY)
    run = subprocess.run([colibri, "run", "--model", str(model), "--token-ids", "1,2,3", "--max-tokens", "4",
                          "--ignore-eos", "--json"], capture_output=True, text=True, env=ENV, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(json.loads(run.stdout)["token_ids"]) == 4
    # the README's demo line: the trained model and its held-out text come with the wheel
    demo = subprocess.run([colibri, "demo", "--json", "--max-tokens", "4"], capture_output=True, text=True, env=ENV,
                          timeout=300, cwd=tmp_path)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert json.loads(demo.stdout)["stats"]["bytes_read"] > 0
    trained = json.loads(demo.stdout)["model_dir"]
    scored = subprocess.run([colibri, "eval", "--model", trained, "--perplexity", "--domain", "python", "--max-tokens",
                             "600", "--json"], capture_output=True, text=True, env=ENV, timeout=300, cwd=tmp_path)
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert 1 < json.loads(scored.stdout)["results"]["python"]["perplexity"] < 1000
