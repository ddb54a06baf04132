"""colibri_gpt_oss uses only colibri-core's public plugin API: every colibri_core import of
the package is a module and name of ``colibri_core.plugins.public.PUBLIC_API`` (the list
docs/plugins.md documents), checked by parsing the sources."""

import shutil
from pathlib import Path

import colibri_gpt_oss
from colibri_core.testing.public_api import private_imports

PACKAGE = Path(colibri_gpt_oss.__file__).parent


def test_colibri_gpt_oss_imports_only_the_public_api():
    assert private_imports(PACKAGE) == []


def test_the_check_fails_on_a_private_import(tmp_path):
    copy = tmp_path / "colibri_gpt_oss"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    model = copy / "model.py"
    model.write_text(model.read_text() + "\nfrom colibri_core.nn.layers import rope_tables\n"
                     "from colibri_core.nn import _v\nimport colibri_core.compute.reference\n")
    found = private_imports(copy)
    assert len(found) == 3, found
    assert "from colibri_core.nn.layers import ... (not a public module)" in found[0]
    assert "from colibri_core.nn import _v (not public)" in found[1]
    assert "import colibri_core.compute.reference (not a public module)" in found[2]
