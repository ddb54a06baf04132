"""Multi-token-prediction layers, which DeepSeek-V3's and GLM-4.5's checkpoints carry past
their decoder layers (``num_nextn_predict_layers``) and colibri does not run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

import colibri_core
from colibri_core.io.safetensors import write_safetensors
from colibri_core.testing import copy_model


def check_mtp_layer_is_ignored(model_dir: Path, tmp_path: Path, prompt: list[int],
                               attention: dict[str, tuple[int, ...]]) -> None:
    """A copy of ``model_dir`` given an MTP layer (its projection and norm, and the
    ``attention`` tensors of the family's attention, random, in a shard of their own) gives
    ``model_dir``'s logits over ``prompt``, its checkpoint listing the layer's tensors."""
    config = json.loads((model_dir / "config.json").read_text())
    layer, hidden = f"model.layers.{config['num_hidden_layers']}", config["hidden_size"]
    mtp_dir = copy_model(model_dir, tmp_path / "mtp", num_nextn_predict_layers=1)
    rng = np.random.default_rng(0)
    write_safetensors(mtp_dir / "model-mtp.safetensors", {
        f"{layer}.eh_proj.weight": rng.standard_normal((hidden, 2 * hidden)).astype(np.float32),
        f"{layer}.enorm.weight": np.ones(hidden, np.float32),
        **{f"{layer}.{name}": rng.standard_normal(shape).astype(np.float32) for name, shape in attention.items()},
    })
    with colibri_core.load(model_dir, history=False) as plain, colibri_core.load(mtp_dir, history=False) as mtp:
        assert f"{layer}.eh_proj.weight" in mtp.checkpoint.tensors
        np.testing.assert_array_equal(mtp.logits(prompt), plain.logits(prompt))
