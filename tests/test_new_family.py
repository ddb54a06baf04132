"""``colibri new-family NAME``: the scaffold an outside author starts from. Written into a
temporary folder, pip-installed (not editable) into a throwaway venv that sees this
environment's packages, it registers (``colibri list-families`` lists it) and its own
generated tests pass there: the install test, the public-API check and the oracle suite
against transformers' OLMoE renamed to the family's model_type. Names are validated, an
existing folder is refused, and a failed write leaves nothing behind."""

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from colibri_core.cli.scaffold import new_family
from colibri_core.errors import UsageError
from colibri_core.testing.cli import run_colibri
from colibri_core.testing.public_api import private_imports
from colibri_core.testing.venv import ENV


def throwaway_venv(root: Path) -> Path:
    """A venv whose interpreter also sees this environment's site-packages (colibri-core,
    torch, transformers, pytest, pip and setuptools) through a .pth file, so nothing is
    downloaded; without its own pip, whose bundled setuptools would shadow this one."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=300)
    site = next((root / "lib").glob("python*/site-packages"))
    (site / "outer-environment.pth").write_text(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return root / "bin" / "python"


def test_scaffolded_family_installs_registers_and_passes_its_oracle_suite(tmp_path):
    out = run_colibri("new-family", "toy-moe", "--dir", tmp_path)
    assert out.returncode == 0, out.stderr
    family = tmp_path / "colibri-toy-moe"
    assert sorted(str(p.relative_to(family)) for p in family.rglob("*") if p.is_file()) == [
        "README.md", "colibri_toy_moe/__init__.py", "colibri_toy_moe/model.py", "pyproject.toml",
        "tests/test_toy_moe_install.py", "tests/test_toy_moe_oracle.py", "tests/test_toy_moe_public_api.py"]
    assert [p.name for p in tmp_path.iterdir()] == ["colibri-toy-moe"]  # no staging folder left
    assert private_imports(family / "colibri_toy_moe") == []

    python = throwaway_venv(tmp_path / "venv")
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(family)],
                             capture_output=True, text=True, timeout=600, env=ENV, cwd=tmp_path)
    assert install.returncode == 0, install.stderr[-3000:]

    listed = subprocess.run([str(python), "-m", "colibri_core", "list-families", "--json"], capture_output=True,
                            text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = {row["family"]: row for row in json.loads(listed.stdout)}
    assert (rows["toy-moe"]["model_types"], rows["toy-moe"]["distribution"], rows["toy-moe"]["status"]) == (
        ["toy_moe"], "colibri-toy-moe", "ok")

    tests = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], capture_output=True,
                           text=True, timeout=1200, env={**ENV, "COLIBRI_TEST_BACKENDS": "cpu"}, cwd=family)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert " passed" in tests.stdout and "skipped" not in tests.stdout and "deselected" not in tests.stdout, tests.stdout[-2000:]


@pytest.mark.parametrize("name", ["", "Toy", "1moe", "toy moe", "toy--moe", "toy-", "../evil", "toy/moe", "x" * 41])
def test_bad_names_are_refused(tmp_path, name):
    with pytest.raises(UsageError, match="family name"):
        new_family(name, tmp_path)
    assert not any(tmp_path.iterdir())


def test_an_existing_folder_is_never_overwritten(tmp_path):
    (tmp_path / "colibri-toy").mkdir()
    (tmp_path / "colibri-toy" / "mine.txt").write_text("keep")
    out = run_colibri("new-family", "toy", "--dir", tmp_path)
    assert out.returncode != 0 and "already exists" in out.stderr
    assert [p.name for p in (tmp_path / "colibri-toy").iterdir()] == ["mine.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["colibri-toy"]


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import colibri_core.cli.scaffold as scaffold

    real = scaffold.files

    def broken(spellings):
        files = real(spellings)
        files["tests/zz_last.py"] = None  # write_text(None) fails after the other files are written
        return files

    monkeypatch.setattr(scaffold, "files", broken)
    with pytest.raises(TypeError):
        new_family("toy", tmp_path)
    assert not any(tmp_path.iterdir())
