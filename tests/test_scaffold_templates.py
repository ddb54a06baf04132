"""``colibri new-family`` writes the OLMoE family renamed: its templates (shipped in
colibri_core/cli/templates, since colibri-olmoe need not be installed) are made from
colibri-olmoe's source and must not drift from it."""

import re
from pathlib import Path

import pytest

from colibri_core.cli import scaffold

OLMOE = Path(__file__).resolve().parents[1] / "families" / "colibri-olmoe" / "colibri_olmoe"
REGENERATE = f"python -m colibri_core.cli.scaffold {OLMOE}"


@pytest.mark.parametrize("name", scaffold.FROM_OLMOE)
def test_the_template_is_olmoe_s_source_renamed(name):
    made = scaffold.template_from_olmoe(name, (OLMOE / name).read_text(encoding="utf-8"))
    assert scaffold.template_path(name).read_text(encoding="utf-8") == made, (
        f"templates/{name}.tmpl differs from colibri-olmoe's {name}: run {REGENERATE}")


def test_a_new_family_has_its_own_names():
    texts = scaffold.files(scaffold.names("toy-moe"))
    for name in scaffold.FROM_OLMOE:
        text = texts[f"colibri_toy_moe/{name}"]
        assert not re.search(r"__[A-Z]+__", text), f"{name} keeps a placeholder"
        compile(text, name, "exec")
    assert 'name = "toy-moe"' in texts["colibri_toy_moe/model.py"]
    assert 'FamilySpec(name="toy-moe", model_types=("toy_moe",)' in texts["colibri_toy_moe/__init__.py"]


def test_a_spelling_the_renames_miss_is_an_error():
    with pytest.raises(ValueError, match="'OLMOE'.*OLMOE_SPELLINGS"):
        scaffold.template_from_olmoe("__init__.py", '"""colibri-olmoe: OLMOE."""\n')


def test_olmoe_s_other_families_stay_out_of_the_template():
    """colibri-olmoe's __init__.py also registers FlexOlmo, after ``OTHER_SPECS``: a new
    family registers only its own spec."""
    source = (OLMOE / "__init__.py").read_text(encoding="utf-8")
    made = scaffold.template_from_olmoe("__init__.py", source)
    assert scaffold.OTHER_SPECS in source and "flex_olmo" in source
    assert "flex_olmo" not in made and made.count("FamilySpec(") == 1
