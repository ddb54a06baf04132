"""Making gpt-oss style MXFP4 checkpoints (``<name>_blocks`` / ``<name>_scales``) from
tiny float32 models, for oracle tests.

``mxfp4_rewrite()`` gives an ``OracleCase.rewrite`` hook. The routed experts of the
saved model (per expert, ``...experts.{e}.{gate,up,down}_proj.weight``, or already
fused, ``...experts.gate_up_proj`` / ``down_proj``) are stored fused as gpt-oss ships
them: ``...experts.gate_up_proj_blocks`` U8 (E, 2I, H / 32, 16) (gate rows first, then
up: colibri's fused layout; gpt-oss's own interleaving is its family's business) with
``..._scales`` U8 (E, 2I, H / 32), and ``...experts.down_proj_blocks`` (E, H, I / 32, 16);
with ``fuse=False`` each expert's ``<m>.weight`` becomes ``<m>.weight_blocks`` /
``<m>.weight_scales``. Byte j of a group holds element 2j (low nibble) and 2j + 1 (high),
e2m1 codes; the scale byte E means 2^(E - 127). ``quantization_config`` is
``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``. The reference copy holds
the dequantised float32 weights under the original names. Written from the format's
description (transformers' ``convert_moe_packed_tensors``), independently of colibri's
decoder (``colibri_core.formats.mxfp4_hub``). The cols of every quantised weight must be
a multiple of 32.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import numpy as np

from colibri_core.testing.rewrite import rewrite_checkpoint

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<role>gate|up|down)_proj\.weight$")
FUSED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<role>gate_up|down)_proj$")


def quantize_mxfp4(w: np.ndarray):
    """float32 (..., rows, cols), cols a multiple of 32 -> (blocks U8 (..., rows, cols/32,
    16), scales U8 (..., rows, cols/32), the float32 weight they stand for)."""
    if w.shape[-1] % 32:
        raise ValueError(f"MXFP4 blocks need cols a multiple of 32, got shape {list(w.shape)}")
    groups = w.astype(np.float32).reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(groups).max(axis=-1)
    with np.errstate(divide="ignore"):
        exponent = np.where(amax > 0, np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2, -127)
    biased = np.clip(exponent + 127, 0, 254).astype(np.uint8)
    scale = np.ldexp(np.float32(1.0), biased.astype(np.int32) - 127).astype(np.float32)[..., None]
    magnitude = np.abs(np.abs(groups / scale)[..., None] - E2M1).argmin(axis=-1)
    code = (magnitude | np.where(groups < 0, 8, 0)).astype(np.uint8)
    dequantised = (np.where(groups < 0, -1.0, 1.0) * E2M1[magnitude] * scale).astype(np.float32).reshape(w.shape)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    return blocks, biased, dequantised


def mxfp4_rewrite(fuse: bool = True, config_key: str | None = None) -> Callable:
    """An ``OracleCase.rewrite`` hook storing the routed experts as MXFP4 blocks."""
    keep: list[str] = []

    def quantise(tensors):
        stored, dequantised, names = {}, {}, []
        experts: dict[str, dict[str, dict[int, np.ndarray]]] = {}
        for name, t in tensors.items():
            per, fused = PER_EXPERT.match(name), FUSED.match(name)
            if per and fuse:
                experts.setdefault(per["prefix"], {}).setdefault(per["role"], {})[int(per["e"])] = t
                continue
            if per or fused:
                # <m>.weight -> <m>.weight_blocks; ...experts.gate_up_proj -> ...gate_up_proj_blocks
                stored[name + "_blocks"], stored[name + "_scales"], dequantised[name] = quantize_mxfp4(t)
                names.append(name)
                continue
            stored[name] = dequantised[name] = t
            if t.ndim == 2 and name.endswith(".weight"):
                keep.append(name[: -len(".weight")])
        for prefix, roles in experts.items():
            n = len(roles["down"])
            if any(len(roles[r]) != n for r in ("gate", "up")):
                raise AssertionError(f"{prefix}: the experts of a layer must lie in one shard to be fused")
            gate_up = np.stack([np.concatenate([roles["gate"][e], roles["up"][e]]) for e in range(n)])
            down = np.stack([roles["down"][e] for e in range(n)])
            for role, fused_weight in (("gate_up", gate_up), ("down", down)):
                blocks, scales, deq = quantize_mxfp4(fused_weight)
                stored[f"{prefix}.{role}_proj_blocks"], stored[f"{prefix}.{role}_proj_scales"] = blocks, scales
                inner = deq.shape[1] // 2
                for e in range(n):  # the reference keeps transformers' per-expert names
                    if role == "down":
                        dequantised[f"{prefix}.{e}.down_proj.weight"] = deq[e]
                    else:
                        dequantised[f"{prefix}.{e}.gate_proj.weight"] = np.ascontiguousarray(deq[e, :inner])
                        dequantised[f"{prefix}.{e}.up_proj.weight"] = np.ascontiguousarray(deq[e, inner:])
                names.append(f"{prefix}.{role}_proj")
        return stored, dequantised, names

    def rewrite(path):
        return rewrite_checkpoint(Path(path), quantise, lambda: {"quant_method": "mxfp4", "modules_to_not_convert": keep},
                                  config_key)

    return rewrite
