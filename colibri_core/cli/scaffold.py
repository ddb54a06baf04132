"""``colibri new-family NAME``: a ready-to-edit family distribution for an outside author.

The folder holds a pyproject with the ``colibri`` entry point, a package whose model.py
declares a decoder-only MoE on the shared blocks (OLMoE-shaped: softmax top-k router,
SwiGLU experts, optional q/k RMSNorm), a README, and tests that pass as written: an
install test (``colibri list-families`` lists the family), a public-API import check and
an oracle suite against transformers' OLMoE with ``model_type`` renamed to the family's.
It is written into a temporary folder beside the target and renamed into place, so a
failure leaves nothing half-written; an existing target is refused.
docs/writing-a-family.md walks through what to edit.
"""

from __future__ import annotations

import os
import re
import shutil
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
        f"{package}/__init__.py": INIT,
        f"{package}/model.py": MODEL,
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
`colibri new-family __NAME__`. As generated it runs a decoder-only MoE shaped like OLMoE
(softmax top-k router, SwiGLU experts, optional q/k RMSNorm); edit `__PACKAGE__/model.py`
for your architecture (colibri's docs/writing-a-family.md walks through it).

```
pip install -e '.[test]'    # registers the family (the `colibri` entry point); [test]: pytest, torch, transformers
colibri list-families       # shows __NAME__
pytest tests                # the oracle suite against transformers, on every installed backend
```

Use only colibri-core's public API (docs/plugins.md, "The public API");
`tests/test___MODEL_TYPE___public_api.py` checks every import.
'''

INIT = '''"""__DIST__: the __NAME__ family (Hugging Face model_type ``__MODEL_TYPE__``).

Imports only colibri_core's light modules: the architecture (model.py) loads when a
model runs, through the ``impl`` string.
"""

from colibri_core.plugins.registry import FamilySpec, family_hook

__version__ = "0.1.0"

colibri_register_families = family_hook(
    FamilySpec(name="__NAME__", model_types=("__MODEL_TYPE__",),
               architectures=("__CLASS__ForCausalLM",),
               impl="__PACKAGE__.model:__CLASS__",
               description="__CLASS__: a decoder-only MoE on colibri's shared blocks"),
)
'''

MODEL = '''"""__CLASS__ on colibri's shared blocks: a decoder-only MoE.

As generated: pre-norm layers of grouped-query attention with RoPE (optionally q/k
RMSNorm over the whole projection, optionally clipped q/k/v) and a MoE of SwiGLU experts
behind a softmax top-k router, tensors named as transformers names OLMoE's. Edit the
config fields, the weight names and the blocks for your architecture; import only
colibri-core's public API (docs/plugins.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri_core.errors import ModelFormatError, UnsupportedModelError
from colibri_core.model.config import ModelArgs
from colibri_core.model.family import Family
from colibri_core.nn import Attention, build_rope
from colibri_core.nn.assembly import build_decoder
from colibri_core.model.builders import softmax_moe


@dataclass
class __CLASS__Args(ModelArgs):
    """config.json's fields: unknown keys are ignored, types and sizes checked."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_experts: int
    num_experts_per_tok: int
    num_key_value_heads: int | None = None
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    norm_topk_prob: bool = False
    clip_qkv: float | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def validate(self, source):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        if self.hidden_size % self.num_attention_heads:
            raise ModelFormatError(f"{source}: hidden_size {self.hidden_size} is not divisible by "
                                   f"num_attention_heads {self.num_attention_heads}")
        self.require_multiple(source, "num_attention_heads", "num_key_value_heads")
        self.require_at_most(source, "num_experts_per_tok", "num_experts")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"{source}: hidden_act {self.hidden_act!r} is not supported by the "
                                        "__NAME__ family (only 'silu')")


class __CLASS__(Family):
    name = "__NAME__"

    def build(self, config, w):
        a = __CLASS__Args.from_dict(config, w.config_source)
        hidden, heads, kv_heads = a.hidden_size, a.num_attention_heads, a.num_key_value_heads
        head_dim = hidden // heads
        rope = build_rope(config, head_dim, w.config_source)

        def attention(i, p):
            s = f"{p}.self_attn"
            q_norm = k_norm = None
            if w.has(f"{s}.q_norm.weight"):  # q/k RMSNorm over the whole projection (OLMoE)
                q_norm = w.rms_norm(f"{s}.q_norm", heads * head_dim, a.rms_norm_eps)
                k_norm = w.rms_norm(f"{s}.k_norm", kv_heads * head_dim, a.rms_norm_eps)
            return Attention(
                layer=i,
                **w.attention_projections(s, hidden, heads, kv_heads, head_dim, qkv_bias=a.attention_bias,
                                          o_bias=a.attention_bias),
                n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, rope=rope,
                q_norm=q_norm, k_norm=k_norm, clip_qkv=a.clip_qkv,
            )

        def moe(i, p):
            return softmax_moe(w, i, f"{p}.mlp", a.num_experts, a.num_experts_per_tok, a.norm_topk_prob, hidden,
                               a.intermediate_size)

        return build_decoder(a, w, attention, moe)
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
