"""docs/writing-a-family.md's first steps, run as written: the commands of its "1.
Scaffold" block, taken from the page itself (so the page and this test cannot drift), run
by bash in a fresh virtual environment that has only colibri-core (installed from this
checkout, as ``pip install colibri-core`` would). The scaffold's ``[test]`` extra must
bring what its generated tests need, and they must pass as generated.

Two pins keep the run small and repeatable, set through pip's environment, not by
changing the commands: torch 2.13.0 (its CPU build is on these machines' disk; any other
release is a download of several GB) and the transformers colibri's own tests pin.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest

from colibri_core.testing.venv import ENV, fresh_venv

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "writing-a-family.md"


def scaffold_block() -> str:
    """The first fenced block under "## 1. Scaffold", verbatim."""
    section = DOC.read_text(encoding="utf-8").split("## 1. Scaffold", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```[^\n]*\n(.*?)^```", section, re.S | re.M)
    assert block, f"{DOC}: no command block under '## 1. Scaffold'"
    return block.group(1)


def test_the_block_installs_the_scaffold_with_its_test_extra():
    commands = [line.split("#", 1)[0].strip() for line in scaffold_block().splitlines()]
    assert "colibri new-family my-moe" in commands and "pytest colibri-my-moe/tests" in commands
    assert "pip install -e './colibri-my-moe[test]'" in commands


@pytest.mark.slow
def test_the_documented_scaffold_commands_pass_in_a_fresh_venv(tmp_path):
    venv = fresh_venv(REPO, tmp_path)
    assert not venv.imports("transformers") and not venv.imports("pytest"), "the venv starts with colibri-core only"
    pins = tmp_path / "pins.txt"
    pins.write_text("torch==2.13.0\ntransformers==5.23.0\n")
    work = tmp_path / "work"
    work.mkdir()
    env = {**ENV, "PATH": f"{venv.python.parent}{os.pathsep}{ENV.get('PATH', '')}", "VIRTUAL_ENV": str(venv.root),
           "PIP_CONSTRAINT": str(pins)}
    ran = subprocess.run(["bash", "-euo", "pipefail", "-c", scaffold_block()], capture_output=True, text=True,
                         cwd=work, env=env, timeout=1800)
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-4000:]
    assert re.search(r"\bmy-moe\b.*\bmy_moe\b", ran.stdout), ran.stdout[-3000:]  # list-families shows it
    summary = ran.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and not re.search(r"failed|error|skipped", summary), ran.stdout[-3000:]
