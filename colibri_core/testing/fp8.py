"""Making block-scaled fp8 checkpoints from tiny float32 models, for oracle tests.

``fp8_rewrite(block)`` gives an ``OracleCase.rewrite`` hook: it quantises the selected
weights of the saved checkpoint to torch.float8_e4m3fn with one float32 scale per block
(``<name>_scale_inv``, the DeepSeek layout), stamps ``quantization_config``
(``quant_method: fp8``, ``weight_block_size``) into config.json, and writes a float32
copy holding the *dequantised* weights for transformers to run as the reference.

torch and safetensors are imported only when used.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Callable

E4M3_MAX = 448.0

# linear weights DeepSeek-V3 / V3.2 ship in fp8 (not embeddings, lm_head, norms, the router
# or the indexer's weights_proj)
DEFAULT_PATTERN = re.compile(r"(_proj|\.wq_b|\.wk)\.weight$")


def _default_select(name: str, tensor) -> bool:
    return tensor.ndim == 2 and bool(DEFAULT_PATTERN.search(name)) and not name.endswith("weights_proj.weight")


def quantize_blocks(w, block: tuple[int, int]):
    """float32 (rows, cols) -> (float8_e4m3fn values, float32 scales (ceil(rows/bm), ceil(cols/bn)))
    with value * scale ~ w; each block's largest magnitude maps to 448."""
    import torch

    rows, cols = w.shape
    bm, bn = block
    r, c = math.ceil(rows / bm), math.ceil(cols / bn)
    padded = torch.zeros(r * bm, c * bn, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(r, bm, c, bn)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(r * bm, c * bn)[:rows, :cols].contiguous(), scale.contiguous()


def dequantize_blocks(q, scale, block: tuple[int, int]):
    """What transformers computes from (values, scales): float32 value * block scale."""
    rows, cols = q.shape
    bm, bn = block
    full = scale.float().repeat_interleave(bm, dim=0)[:rows].repeat_interleave(bn, dim=1)[:, :cols]
    return q.float() * full


def fp8_rewrite(block: tuple[int, int] = (128, 128), select: Callable[[str, object], bool] = _default_select,
                config_key: str | None = None) -> Callable[[Path], Path]:
    """An ``OracleCase.rewrite`` hook quantising a saved checkpoint to fp8 block scales.

    config_key: write quantization_config inside this sub-config (``"text_config"`` for
    wrapped models) instead of at the top of config.json."""

    def rewrite(path: Path) -> Path:
        from safetensors.torch import load_file, save_file

        reference = path.parent / f"{path.name}-dequantized"
        shutil.rmtree(reference, ignore_errors=True)
        shutil.copytree(path, reference)
        added: dict[str, str] = {}
        quantized = 0
        for file in sorted(path.glob("*.safetensors")):
            tensors = load_file(file)
            fp8, dequantized = {}, {}
            for name, t in tensors.items():
                if select(name, t):
                    q, scale = quantize_blocks(t, block)
                    fp8[name], fp8[name + "_scale_inv"] = q, scale
                    dequantized[name] = dequantize_blocks(q, scale, block)
                    added[name + "_scale_inv"] = file.name
                    quantized += 1
                else:
                    fp8[name] = dequantized[name] = t
            save_file(fp8, file, metadata={"format": "pt"})
            save_file(dequantized, reference / file.name, metadata={"format": "pt"})
        if not quantized:
            raise AssertionError(f"{path}: no tensor was selected for fp8 quantisation")
        index = path / "model.safetensors.index.json"
        if index.exists():
            data = json.loads(index.read_text())
            data["weight_map"].update(added)
            index.write_text(json.dumps(data, indent=2))
        config = json.loads((path / "config.json").read_text())
        target = config[config_key] if config_key else config
        target["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(block)}
        (path / "config.json").write_text(json.dumps(config, indent=2))
        return reference

    return rewrite
