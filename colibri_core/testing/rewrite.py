"""Rewriting a saved tiny checkpoint into a quantised layout, for oracle tests.

``rewrite_checkpoint`` runs a per-tensor quantiser over every shard of a saved model: the
model directory gets the quantised tensors (and ``quantization_config``), and a copy,
``<dir>-dequantized``, gets the float32 numbers those tensors decode to, for
transformers to load as the reference. The layouts themselves live in
``colibri_core.testing.compressed_tensors``, ``colibri_core.testing.mxfp4`` and
``colibri_core.testing.fp8``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

# quantise(tensors of one shard: name -> float32 array) -> (tensors to write in the
# quantised checkpoint: name -> array or (safetensors dtype, array), the float32 reference
# tensors for the same shard: name -> array, names quantised); torch tensors throughout
# with ``torch=True``
Quantiser = Callable[[dict[str, np.ndarray]], tuple[dict, dict[str, np.ndarray], list[str]]]


def rewrite_checkpoint(path: Path, quantise: Quantiser, quantization_config: dict | Callable[[], dict],
                       config_key: str | None = None, *, torch: bool = False) -> Path:
    """Rewrite the model at ``path`` in place; returns the dequantised reference's directory.
    quantization_config: the config, or a function making it once every shard is rewritten.
    config_key: write quantization_config inside this sub-config (``"text_config"``).
    torch: shards read and written as torch tensors, for dtypes numpy has not (bfloat16
    sources, float8 values)."""
    if torch:
        from safetensors.torch import load_file, save_file

        def write_safetensors(file, tensors, metadata):
            save_file(tensors, file, metadata=metadata)
    else:
        from safetensors.numpy import load_file

        from colibri_core.io.safetensors import write_safetensors

    reference = path.parent / f"{path.name}-dequantized"
    shutil.rmtree(reference, ignore_errors=True)
    shutil.copytree(path, reference)
    weight_map: dict[str, str] = {}
    quantised = 0
    for file in sorted(path.glob("*.safetensors")):
        stored, dequantised, names = quantise(load_file(file))
        quantised += len(names)
        write_safetensors(file, stored, {"format": "pt"})
        write_safetensors(reference / file.name, dequantised, {"format": "pt"})
        weight_map.update({name: file.name for name in stored})
    if not quantised:
        raise AssertionError(f"{path}: no tensor was selected for quantisation")
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = weight_map
        index.write_text(json.dumps(data, indent=2))
    config = json.loads((path / "config.json").read_text())
    target = config[config_key] if config_key else config
    target["quantization_config"] = quantization_config() if callable(quantization_config) else quantization_config
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return reference
