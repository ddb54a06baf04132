"""Reading a model directory's configuration: ``config.json``, ``generation_config.json``
and the typed, validated arguments a family builds from.

Config files are untrusted: sizes are range-checked here, before any weight is
allocated, and every error names the file and the field.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

from colibri_core.errors import ModelFormatError
from colibri_core.io import smallfile

MAX_CONFIG_BYTES = smallfile.CONFIG_BYTES

# Generous upper bounds for common size fields: larger values are certainly corrupt and
# would otherwise turn into absurd allocations.
LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 19),
    "moe_intermediate_size": (1, 1 << 19),
    "num_hidden_layers": (1, 1 << 10),
    "num_attention_heads": (1, 1 << 12),
    "num_key_value_heads": (1, 1 << 12),
    "head_dim": (1, 1 << 12),
    "num_experts": (1, 1 << 14),
    "num_experts_per_tok": (1, 1 << 10),
    "max_position_embeddings": (1, 1 << 24),
    "rms_norm_eps": (0.0, 1.0),
}


def read_json(path: Path, what: str = "file") -> dict[str, Any]:
    """A config-sized JSON object file (a regular file, read through ``io.smallfile``)."""
    data = smallfile.read_json(path, MAX_CONFIG_BYTES, what)
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data


def check_family_keys(path: Path, config: dict[str, Any]) -> None:
    """The keys a family is chosen by: ``model_type`` a string, ``architectures`` a list
    of strings (either may be absent)."""
    architectures = config.get("architectures")
    if architectures is not None and not (isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)):
        raise ModelFormatError(f"{path}: 'architectures' must be a list of strings")
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ModelFormatError(f"{path}: 'model_type' must be a string")


def bounded(lo: int | float | None = None, hi: int | float | None = None, default: Any = dataclasses.MISSING):
    """A dataclass field with a range check applied by ``ModelArgs.from_dict``."""
    return field(default=default, metadata={"range": (lo, hi)})


@dataclass
class ModelArgs:
    """Base of a family's typed arguments: ``from_dict`` reads a config.json dict,
    ignores unknown keys, checks types and ranges, and names the field on error."""

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json"):
        hints = get_type_hints(cls)
        values = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            if f.name in raw and raw[f.name] is not None:
                values[f.name] = _check(source, f.name, raw[f.name], hints[f.name], f.metadata.get("range"))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                if f.name in raw:  # present but null
                    raise ModelFormatError(f"{source}: field {f.name!r} must not be null")
                raise ModelFormatError(f"{source}: missing field {f.name!r}")
        args = cls(**values)
        args.validate(source)
        return args

    def validate(self, source: str) -> None:
        """Cross-field checks; subclasses extend."""

    def default_head_dim(self, source: str) -> None:
        """``head_dim`` as hidden_size / num_attention_heads where the config gives none."""
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ModelFormatError(f"{source}: hidden_size {self.hidden_size} is not divisible by "
                                       f"num_attention_heads {self.num_attention_heads} (and no head_dim is given)")
            self.head_dim = self.hidden_size // self.num_attention_heads

    def require_multiple(self, source: str, field: str, of: str) -> None:
        """Field ``field`` a multiple of field ``of`` (query heads of KV heads)."""
        value, base = getattr(self, field), getattr(self, of)
        if value % base:
            raise ModelFormatError(f"{source}: {field} {value} is not a multiple of {of} {base}")

    def require_at_most(self, source: str, field: str, limit: str) -> None:
        """Field ``field`` no larger than field ``limit`` (experts per token of the experts)."""
        value, bound = getattr(self, field), getattr(self, limit)
        if value > bound:
            raise ModelFormatError(f"{source}: {field} {value} exceeds {limit} {bound}")


def _check(source: str, name: str, value: Any, hint: Any, rng: tuple | None) -> Any:
    kinds = _kinds(hint)
    if bool in kinds and isinstance(value, bool):
        return value
    if int in kinds and isinstance(value, int) and not isinstance(value, bool):
        out: Any = value
    elif float in kinds and isinstance(value, (int, float)) and not isinstance(value, bool):
        out = float(value)
        if not math.isfinite(out):
            raise ModelFormatError(f"{source}: field {name!r} must be finite, got {value!r}")
    elif str in kinds and isinstance(value, str):
        return value
    elif (dict in kinds and isinstance(value, dict)) or (list in kinds and isinstance(value, list)):
        return value
    elif object in kinds:
        return value
    else:
        expected = " or ".join(sorted(k.__name__ for k in kinds if k is not type(None)))
        raise ModelFormatError(f"{source}: field {name!r} must be {expected}, got {value!r}")
    lo, hi = rng if rng else LIMITS.get(name, (None, None))
    if (lo is not None and out < lo) or (hi is not None and out > hi):
        raise ModelFormatError(f"{source}: field {name!r} = {value!r} is outside the sane range [{lo}, {hi}]")
    return out


def _kinds(hint: Any) -> set[type]:
    args = getattr(hint, "__args__", None)
    origin = getattr(hint, "__origin__", None)
    if origin in (list, dict):
        return {origin}
    if args and origin is not None or type(hint).__name__ == "UnionType":
        kinds: set[type] = set()
        for a in args:
            kinds |= _kinds(a)
        return kinds
    if hint is Any:
        return {object}
    return {hint}


def eos_token_ids(model_dir: Path, config: dict[str, Any]) -> list[int]:
    """End-of-sequence ids: generation_config.json wins over config.json."""
    gen_path = model_dir / "generation_config.json"
    sources = []
    if smallfile.present(gen_path):
        sources.append((read_json(gen_path, "generation config"), gen_path.name))
    sources.append((config, "config.json"))
    for data, name in sources:
        value = data.get("eos_token_id")
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ModelFormatError(f"{model_dir / name}: eos_token_id must be a token id or a list of them, got {value!r}")
        return list(ids)
    return []
