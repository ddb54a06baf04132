"""Helpers for colibri's own tests and for plugin authors' tests.

- ``registered_plugin``: register a plugin object in-process for the duration of a block.
- ``colibri_core.testing.oracle``: tiny random transformers models as oracles, and
  ``FamilyOracleSuite``, the conformance base class every family test subclasses.
- ``colibri_core.testing.backend_kit``: ``BackendConformanceSuite``, the conformance
  base class a backend's tests subclass: every contract method against the reference.
- ``colibri_core.testing.backends``: the backends both suites run on (every installed
  one; ``COLIBRI_TEST_BACKENDS`` restricts them).
- ``colibri_core.testing.tiny_models``: tiny models of several families, built once per
  session, for the kit's checks of the batched engine and the scheduler tests.
- ``colibri_core.testing.fp8``: quantise a saved tiny model to fp8 block scales (an
  ``OracleCase.rewrite`` hook), with the dequantised weights as transformers' reference.
"""

from __future__ import annotations

from contextlib import contextmanager

from colibri_core.plugins.discovery import register_plugin, unregister_plugin


@contextmanager
def registered_plugin(obj, name: str):
    """Register ``obj`` (a module, class or instance with hookimpls) as plugin ``name``."""
    register_plugin(obj, name)
    try:
        yield
    finally:
        unregister_plugin(name)


DELETE = object()  # as a value for edit_config: remove the key


def edit_config(model_dir, **changes) -> None:
    """Change keys of a model directory's config.json (``DELETE`` removes one)."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def copy_model(src, dst, **config_changes):
    """Copy a model directory and change its config (see ``edit_config``)."""
    import shutil
    from pathlib import Path

    shutil.copytree(src, dst)
    edit_config(dst, **config_changes)
    return Path(dst)


def memory_param(value, prepare=None):
    """A weight ``Param`` holding ``value`` (float32) as a loaded model's would, without a
    checkpoint behind it: kept as the array, or ``prepare(array)`` (a backend's
    ``prepare_weight`` for its use)."""
    import numpy as np

    from colibri_core.io.safetensors import TensorInfo
    from colibri_core.nn.weights import Param

    value = np.ascontiguousarray(value, dtype=np.float32)
    p = Param(TensorInfo("t", "mem", "F32", value.shape, 0, value.nbytes))
    p.value = value if prepare is None else prepare(value)
    return p
