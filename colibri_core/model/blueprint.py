"""A model directory understood and validated, with nothing allocated yet.

``inspect_model`` reads config.json, picks the family, validates every shard header and
lets the family declare its weights against them (names, shapes, formats). ``load``
builds on it; ``colibri plan`` and ``colibri doctor`` stop here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from colibri_core.io.checkpoint import Checkpoint
from colibri_core.io.hub_cache import model_directory
from colibri_core.model.config import check_family_keys, read_json
from colibri_core.errors import ModelFormatError, UsageError, option
from colibri_core.nn.layers import CausalLM
from colibri_core.nn.weights import Weights
from colibri_core.model.placement import Placement, plan
from colibri_core.plugins.discovery import DEFAULT_BACKEND, create_backend, get_registry
from colibri_core.formats.base import FormatResolver
from colibri_core.plugins.registry import Entry
from colibri_core.units import format_bytes


@dataclass
class Blueprint:
    model_dir: Path
    config: dict
    family: Entry
    checkpoint: Checkpoint
    weights: Weights
    lm: CausalLM
    resolver: FormatResolver
    backend: object  # sizes are as the backend will hold the weights

    @property
    def moe(self):
        return self.weights.experts

    @property
    def experts_per_layer(self) -> int:
        return max((d.count for d in self.moe), default=0)

    @property
    def expert_bytes(self) -> int:
        """One expert as prepared on the backend (packed, or float32): what it computes with."""
        return self._expert_nbytes(self.resolver.resident_nbytes)

    @property
    def expert_host_bytes(self) -> int:
        """One expert in its host form (``FormatResolver.host_form``), as the disk tier yields it."""
        return self._expert_nbytes(self.resolver.host_nbytes)

    @property
    def expert_ram_bytes(self) -> int:
        """One expert as the RAM tier holds it: its host form when the backend has device
        memory (prepared experts live there), else the prepared form it computes with."""
        return self.expert_host_bytes if self.backend.device_memory() is not None else self.expert_bytes

    def _expert_nbytes(self, nbytes) -> int:
        return max((sum(nbytes(i, self.backend, getattr(d.matrices[0], "forms", {}).get(role, ("linear",))[0]) for role, i in d.matrices[0].items())
                    for d in self.moe), default=0)

    def prefetch_slots(self, *, prefetch: bool, slots: int | None = None, window: int | None = None) -> int:
        """Experts read ahead per MoE layer: ``slots``, or as many as ``window`` bytes hold
        (experts as the RAM tier holds them), by default the router's top-k; 0 without
        prefetch. A window in bytes means the same read-ahead whether experts are 2 MB or
        40 MB (each read ahead borrows a slot of its layer's cache while staged)."""
        if not prefetch or not self.moe:
            return 0
        if slots is not None:
            return slots
        if window is None:
            return self.top_k
        one = self.expert_ram_bytes
        if window < one:
            raise UsageError(f"{option('prefetch_window')} {format_bytes(window)} holds no expert of this model "
                             f"(one is {format_bytes(one)} on backend {self.backend.name!r})")
        return min(window // one, self.experts_per_layer)

    def placement(self, *, ram: int | None, cap: int | None, pin_share: float = 0.0, prefetch_slots: int = 0,
                  vram: int | None = None) -> Placement:
        """Where the weights would go on this backend under these budgets (nothing is read)."""
        return plan(dense_bytes=self.dense_bytes, expert_bytes=self.expert_ram_bytes, moe_layers=len(self.moe),
                    experts_per_layer=self.experts_per_layer, ram=ram, cap=cap, pin_share=pin_share,
                    prefetch_slots=prefetch_slots, io_window=max(1, self.top_k), device_memory=self.backend.device_memory(),
                    vram=vram, unified=self.backend.unified_memory, device_expert_bytes=self.expert_bytes)

    @property
    def expert_disk_bytes(self) -> int:
        return max((sum(i.nbytes for i in d.matrices[0].values()) for d in self.moe), default=0)

    @property
    def dense_bytes(self) -> int:
        """The dense weights as resident in memory on the backend."""
        return self.weights.resident_bytes(self.resolver, self.backend)

    @property
    def expert_params(self) -> int:
        return max((sum(_numel(self.resolver.logical_shape(i)) for i in d.matrices[0].values()) for d in self.moe), default=0)

    @property
    def dense_disk_bytes(self) -> int:
        return sum(p.info.nbytes for p in self.weights.params.values())

    @property
    def top_k(self) -> int:
        return max((getattr(e.router, "top_k", 0) for e in self._moe_blocks()), default=0)

    def _moe_blocks(self):
        return [layer.mlp for layer in self.lm.layers if hasattr(getattr(layer, "mlp", None), "router")]

    def kv_bytes_per_token(self) -> int:
        return self.lm.new_cache(self.backend).bytes_per_token()  # states allocate nothing until used

    def kv_bytes_for(self, tokens: int) -> int:
        """One sequence's KV / latent / recurrent state at ``tokens`` positions (a sliding
        window's layers hold at most their window)."""
        return self.lm.new_cache(self.backend).bytes_for(tokens)

    def close(self) -> None:
        self.checkpoint.close()


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def inspect_model(model_dir: str | Path, backend=None) -> Blueprint:
    """``backend``: a backend object, or the name of an installed one (default: the CPU);
    sizes are as that backend will hold the weights."""
    registry = get_registry()
    if backend is None or isinstance(backend, str):
        backend = create_backend(registry, backend or DEFAULT_BACKEND)
    model_dir = model_directory(model_dir)  # a hub cache repo root stands for its refs/main snapshot
    if not model_dir.is_dir():
        raise ModelFormatError(f"{model_dir}: " + ("not a directory" if model_dir.exists() else "does not exist"))
    config = read_json(model_dir / "config.json", "model config")
    check_family_keys(model_dir / "config.json", config)
    architectures, model_type = config.get("architectures"), config.get("model_type")
    family_entry = registry.family_for(model_type, architectures)
    checkpoint = Checkpoint(model_dir)
    try:
        resolver = FormatResolver(registry, checkpoint, config)
        weights = Weights(checkpoint, resolver)
        lm = family_entry.spec.load()().build(config, weights)
        for p in weights.params.values():
            resolver.format_for(p.info)
        for decl in weights.experts:
            for info in decl.matrices[0].values():
                resolver.format_for(info)
        for i, decl in enumerate(weights.experts):
            decl.moe_index = i
    except BaseException:
        checkpoint.close()
        raise
    return Blueprint(model_dir, config, family_entry, checkpoint, weights, lm, resolver, backend)
