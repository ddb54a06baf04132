"""Small MoE language models trained on CPU by ``benchmarks/train/train.py``.

Each is a Hugging Face model directory (``save_pretrained`` in bf16, a byte-level BPE
tokenizer with a ChatML template, ``training.json`` with how it was trained and how well
it does). ``path(name)`` finds one; the names are ``MODELS``' keys.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent

# name -> (directory, what it is)
MODELS = {
    "olmoe": ("olmoe-16x64", "OLMoE-1B-7B's routing geometry (16 layers, 64 experts, top-8) at hidden size 64"),
    "deepseek_v3": ("deepseek-v3-6x64-mtp", "DeepSeek-V3's structure (MLA, grouped top-6 of 64 experts, a shared "
                                            "expert) with one multi-token-prediction layer"),
}


def path(name: str) -> Path:
    """The model directory of ``name``; LookupError if this installation lacks it."""
    if name not in MODELS:
        raise LookupError(f"no trained model {name!r}: the names are {', '.join(sorted(MODELS))}")
    directory = HERE / MODELS[name][0]
    if not (directory / "config.json").is_file() or not (directory / "model.safetensors").is_file():
        raise LookupError(f"the trained model {name!r} is missing from {directory} (damaged installation?)")
    return directory
