"""Making block-scaled fp8 checkpoints from tiny float32 models, for oracle tests.

``fp8_rewrite(block)`` gives an ``OracleCase.rewrite`` hook: it quantises the selected
weights of the saved checkpoint to torch.float8_e4m3fn with one float32 scale per block
(``<name>_scale_inv``, the DeepSeek layout), stamps ``quantization_config``
(``quant_method: fp8``, ``weight_block_size``) into config.json, and writes a float32
copy holding the *dequantised* weights for transformers to run as the reference.

torch and safetensors are imported only when used.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable

from colibri_core.testing.rewrite import rewrite_checkpoint

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

    def quantise(tensors):
        stored, dequantized, names = {}, {}, []
        for name, t in tensors.items():
            if select(name, t):
                q, scale = quantize_blocks(t, block)
                stored[name], stored[name + "_scale_inv"] = q, scale
                dequantized[name] = dequantize_blocks(q, scale, block)
                names.append(name)
            else:
                stored[name] = dequantized[name] = t
        return stored, dequantized, names

    def rewrite(path: Path) -> Path:
        config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
        return rewrite_checkpoint(Path(path), quantise, config, config_key, torch=True)

    return rewrite
