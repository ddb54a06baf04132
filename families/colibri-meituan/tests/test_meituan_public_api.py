"""The package imports only colibri-core's public API (docs/plugins.md, "The public API")."""

from pathlib import Path

import colibri_meituan
from colibri_core.testing.public_api import private_imports


def test_meituan_imports_only_the_public_api():
    assert private_imports(Path(colibri_meituan.__file__).parent) == []
