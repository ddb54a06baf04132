"""``colibri new-family NAME``: a ready-to-edit family distribution for an outside author.

The folder holds a pyproject with the ``colibri`` entry point, a package (the OLMoE
family's __init__.py and model.py, renamed: a decoder-only MoE on the shared blocks with a
softmax top-k router, SwiGLU experts and q/k RMSNorm), a README, and tests that pass as
written: an install test (``colibri list-families`` lists the family), a public-API import
check and an oracle suite against transformers' OLMoE with ``model_type`` renamed to the
family's.
It is written into a temporary folder beside the target and renamed into place, so a
failure leaves nothing half-written; an existing target is refused.
docs/writing-a-family.md walks through what to edit.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import click

from colibri_core.errors import UsageError

NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")
MAX_NAME = 40


def names(name: str) -> dict[str, str]:
    """The spellings of a family name: distribution, package, model_type, class."""
    if not isinstance(name, str) or len(name) > MAX_NAME or not NAME.match(name):
        raise UsageError(f"family name {name!r} must be lowercase letters and digits, words joined by '-' or '_', "
                         f"starting with a letter, at most {MAX_NAME} characters (e.g. 'mymoe' or 'my-moe')")
    snake = name.replace("-", "_")
    return {"__NAME__": name, "__DIST__": f"colibri-{name.replace('_', '-')}", "__PACKAGE__": f"colibri_{snake}",
            "__MODEL_TYPE__": snake, "__CLASS__": "".join(part.capitalize() for part in re.split(r"[-_]", name))}


# A new family's __init__.py and model.py are colibri-olmoe's (the smallest family) with
# olmoe's names made placeholders. They ship in templates/ because colibri-olmoe need not
# be installed where ``colibri new-family`` runs (``pip install colibri-core`` is the
# first step of docs/writing-a-family.md); tests/test_scaffold_templates.py fails when
# they no longer equal ``template_from_olmoe`` of olmoe's files, and
# ``python -m colibri_core.cli.scaffold families/colibri-olmoe/colibri_olmoe`` rewrites them.
FROM_OLMOE = ("__init__.py", "model.py")

# olmoe's spellings -> placeholders, in this order: ``olmoe`` alone is the family name
# once the distribution, package and model_type spellings are taken
OLMOE_SPELLINGS = (
    ("colibri-olmoe", "__DIST__"), ("colibri_olmoe", "__PACKAGE__"), ("Olmoe", "__CLASS__"), ("OLMoE", "__CLASS__"),
    ("``olmoe``", "``__MODEL_TYPE__``"), ('("olmoe",)', '("__MODEL_TYPE__",)'), ("olmoe", "__NAME__"),
)

# model.py's docstring: olmoe's names its transformers source; the author needs a guide
MODEL_DOCSTRING = '''"""__CLASS__ on colibri's shared blocks: a decoder-only MoE.

As generated this is colibri-olmoe's model.py, renamed: pre-norm layers of grouped-query
attention with RoPE (q/k RMSNorm over the whole projection, optionally clipped q/k/v) and
a MoE of SwiGLU experts behind a softmax top-k router, tensors named as transformers names
OLMoE's. Edit the config fields, the weight names and the blocks for your architecture;
import only colibri-core's public API (docs/plugins.md).
"""'''


# colibri-olmoe's __init__.py registers more than OLMoE (FlexOlmo): from this line to the
# closing parenthesis of its family_hook, the specs are not a new family's
OTHER_SPECS = "    # colibri-olmoe's other families (not in colibri new-family's template)"


def template_from_olmoe(name: str, source: str) -> str:
    """The template of a new family's file ``name`` (one of ``FROM_OLMOE``), made from
    the source of colibri-olmoe's file of that name (``__init__.py`` without the specs
    after ``OTHER_SPECS``)."""
    if name == "__init__.py" and OTHER_SPECS in source:
        head, tail = source.split(OTHER_SPECS, 1)
        source = head.rstrip(" ") + tail[tail.index("\n)\n") + 1:]
    if name == "model.py":
        if not source.startswith('"""') or '"""' not in source[3:]:
            raise ValueError("olmoe's model.py must open with its docstring (the template replaces it)")
        source = source[source.index('"""', 3) + 3:]
    for spelling, placeholder in OLMOE_SPELLINGS:
        source = source.replace(spelling, placeholder)
    left = re.search("olmoe", source, re.IGNORECASE)
    if left:
        line = source[:left.start()].count("\n") + 1
        raise ValueError(f"olmoe's {name} spells the family {left.group()!r} (template line {line}), "
                         "which OLMOE_SPELLINGS does not rename")
    return (MODEL_DOCSTRING if name == "model.py" else "") + source


def template_path(name: str) -> Path:
    """The shipped template of a new family's file ``name``."""
    return Path(__file__).parent / "templates" / f"{name}.tmpl"


def write_templates(olmoe_package: Path) -> None:
    """Rewrite templates/ from colibri-olmoe's package folder."""
    for name in FROM_OLMOE:
        source = (Path(olmoe_package) / name).read_text(encoding="utf-8")
        template_path(name).write_text(template_from_olmoe(name, source), encoding="utf-8")


def render(text: str, spellings: dict[str, str]) -> str:
    for key, value in spellings.items():
        text = text.replace(key, value)
    return text


def files(spellings: dict[str, str]) -> dict[str, str]:
    """Relative path -> content of every file of the distribution."""
    package = spellings["__PACKAGE__"]
    raw = {
        "pyproject.toml": PYPROJECT,
        "README.md": README,
        **{f"{package}/{name}": template_path(name).read_text(encoding="utf-8") for name in FROM_OLMOE},
        f"tests/test_{spellings['__MODEL_TYPE__']}_install.py": INSTALL_TEST,
        f"tests/test_{spellings['__MODEL_TYPE__']}_public_api.py": PUBLIC_API_TEST,
        f"tests/test_{spellings['__MODEL_TYPE__']}_oracle.py": ORACLE_TEST,
    }
    return {path: render(text, spellings) for path, text in raw.items()}


def new_family(name: str, parent: Path) -> Path:
    """Write the distribution ``colibri-NAME`` under ``parent``; returns its folder."""
    spellings = names(name)
    parent = Path(parent)
    if not parent.is_dir():
        raise UsageError(f"{parent}: " + ("not a directory" if parent.exists() else "does not exist"))
    target = parent / spellings["__DIST__"]
    if target.exists() or target.is_symlink():
        raise UsageError(f"{target} already exists: refusing to overwrite it")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=parent))
    try:
        for rel, text in files(spellings).items():
            path = staging / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        os.chmod(staging, 0o755)  # mkdtemp makes it private
        if target.exists():  # created meanwhile: os.rename would replace an empty directory
            raise UsageError(f"{target} already exists: refusing to overwrite it")
        try:
            os.rename(staging, target)
        except OSError as exc:
            raise UsageError(f"{target}: cannot create it ({exc.strerror or exc})") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


@click.command("new-family")
@click.argument("name")
@click.option("--dir", "parent", default=".", show_default=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder to create the distribution colibri-NAME in.")
def new_family_command(name, parent):
    """Write a ready-to-edit family distribution colibri-NAME (see docs/writing-a-family.md)."""
    target = new_family(name, parent)
    spellings = names(name)
    click.echo(f"wrote {target}\n"
               f"next: pip install -e '{target}[test]' && colibri list-families   (shows {spellings['__NAME__']})\n"
               f"      pytest {target / 'tests'}")


PYPROJECT = '''[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "__DIST__"
version = "0.1.0"
description = "__CLASS__ (model_type __MODEL_TYPE__) family for colibri."
readme = "README.md"
requires-python = ">=3.11"
license = "Apache-2.0"
dependencies = ["colibri-core>=0.1.0"]

[project.optional-dependencies]
# what tests/ needs: the oracle suite compares with transformers, which runs on torch
test = ["pytest", "torch", "transformers"]

[project.entry-points.colibri]
__NAME__ = "__PACKAGE__"

[tool.setuptools.packages.find]
include = ["__PACKAGE__*"]
'''

README = '''# __DIST__

A colibri model family for Hugging Face `model_type` `__MODEL_TYPE__`, written with
`colibri new-family __NAME__`. As generated it is colibri's OLMoE family renamed, a
decoder-only MoE (softmax top-k router, SwiGLU experts, q/k RMSNorm); edit
`__PACKAGE__/model.py` for your architecture (colibri's docs/writing-a-family.md walks
through it).

```
pip install -e '.[test]'    # registers the family (the `colibri` entry point); [test]: pytest, torch, transformers
colibri list-families       # shows __NAME__
pytest tests                # the oracle suite against transformers, on every installed backend
```

Use only colibri-core's public API (docs/plugins.md, "The public API");
`tests/test___MODEL_TYPE___public_api.py` checks every import.
'''

INSTALL_TEST = '''"""Installed (pip install -e '.[test]'), the distribution registers its family through the
``colibri`` entry point: ``colibri list-families`` lists it."""

import json

from colibri_core.testing.cli import run_colibri


def test_colibri_list_families_shows___MODEL_TYPE__():
    out = run_colibri("list-families", "--json")
    assert out.returncode == 0, out.stderr
    rows = {row["family"]: row for row in json.loads(out.stdout)}
    assert "__NAME__" in rows, f"__NAME__ is not registered (is __DIST__ installed?): {sorted(rows)}"
    assert rows["__NAME__"]["model_types"] == ["__MODEL_TYPE__"]
    assert rows["__NAME__"]["distribution"] == "__DIST__"
    assert rows["__NAME__"]["status"] == "ok"
'''

PUBLIC_API_TEST = '''"""The package imports only colibri-core's public API (docs/plugins.md, "The public API")."""

from pathlib import Path

import __PACKAGE__
from colibri_core.testing.public_api import private_imports


def test___MODEL_TYPE___imports_only_the_public_api():
    assert private_imports(Path(__PACKAGE__.__file__).parent) == []
'''

ORACLE_TEST = '''"""__CLASS__ against transformers: greedy tokens and logits under every placement, on
every installed backend (``COLIBRI_TEST_BACKENDS=cpu`` restricts them).

As generated the reference is transformers' OLMoE (``OlmoeForCausalLM``), saved with
config.json's model_type renamed to "__MODEL_TYPE__" so that this family runs it: the
suite passes as written. For your architecture set ``model_class`` to its transformers
class, build ``config()`` from its config class and drop ``claim`` once transformers
saves your model_type itself.
"""

from colibri_core.testing import edit_config
from colibri_core.testing.oracle import FamilyOracleSuite, OracleCase
from transformers import OlmoeConfig

MODEL_TYPE = "__MODEL_TYPE__"


def claim(path):
    """``OracleCase.rewrite``: the saved model as this family's model_type."""
    edit_config(path, model_type=MODEL_TYPE, architectures=["__CLASS__ForCausalLM"])


def config(**overrides):
    base = dict(vocab_size=128, eos_token_id=None, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                max_position_embeddings=128, initializer_range=0.1)
    base.update(overrides)
    return lambda: OlmoeConfig(**base)


class Test__CLASS__Oracle(FamilyOracleSuite):
    model_class = "OlmoeForCausalLM"
    cases = {
        "base": OracleCase(config(), rewrite=claim),
        "gqa_norm_topk": OracleCase(config(num_key_value_heads=2, num_experts_per_tok=3, norm_topk_prob=True),
                                    seed=1, rewrite=claim),
    }
'''


if __name__ == "__main__":  # python -m colibri_core.cli.scaffold OLMOE_PACKAGE_FOLDER
    write_templates(Path(sys.argv[1]))
