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
from colibri_core.errors import ModelFormatError, UnsupportedModelError, UsageError, option
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


def inspect_model(model_dir: str | Path, backend=None, *, mtp: bool | str = False, mtp_int4: bool = False) -> Blueprint:
    """``backend``: a backend object, or the name of an installed one (default: the CPU);
    sizes are as that backend will hold the weights. ``mtp``: build the checkpoint's
    multi-token-prediction layers too (``lm.mtp``, for ``--draft mtp``); their weights
    must be int8 or better unless ``mtp_int4``; ``"if-usable"``: where the checkpoint has
    a usable one, else without."""
    if mtp == "if-usable":
        try:
            return inspect_model(model_dir, backend, mtp=True, mtp_int4=mtp_int4)
        except (UsageError, UnsupportedModelError, ModelFormatError):
            return inspect_model(model_dir, backend)
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
        if mtp:
            _, weights.mtp_layout = _mtp_layers(model_dir, config, checkpoint)
            weights.mtp_layers = 1  # drafts chain the first MTP layer: the others are not read
        lm = family_entry.spec.load()().build(config, weights)
        if mtp and len(lm.mtp) != weights.mtp_layers:
            raise UnsupportedModelError(f"{option('draft')} mtp: family {family_entry.spec.name!r} does not build "
                                        "multi-token-prediction layers")
        for p in weights.params.values():
            resolver.format_for(p.info)
        for decl in weights.experts:
            for info in decl.matrices[0].values():
                resolver.format_for(info)
        for i, decl in enumerate(weights.experts):
            decl.moe_index = i
        if mtp and not mtp_int4:
            _check_mtp_precision(model_dir, lm, weights, resolver)
    except BaseException:
        checkpoint.close()
        raise
    return Blueprint(model_dir, config, family_entry, checkpoint, weights, lm, resolver, backend)


# 4-bit kernels: an MTP layer quantised to them loses its use (the original engine measured
# 0-4% acceptance for int4 MTP heads, against 60-80% at int8)
FOUR_BIT_KERNELS = frozenset({"q4", "q4g32", "mxfp4", "mxfp4pair"})


def _mtp_layers(model_dir: Path, config: dict, checkpoint: Checkpoint) -> tuple[int, object]:
    """How many MTP layers ``config`` declares and in which layout (``nn.mtp``), the first
    found in the checkpoint; a one-line error naming the field or the missing tensor otherwise."""
    from colibri_core.nn.mtp import mtp_layout

    layout, n, field_name = mtp_layout(config)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ModelFormatError(f"{model_dir / 'config.json'}: {field_name} must be a non-negative integer, got {n!r}")
    if n == 0:
        raise UsageError(f"{option('draft')} mtp: {model_dir} has no multi-token-prediction layers "
                         f"(config.json: {field_name} is 0 or absent); use --draft ngram or auto")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if text.get("mtp_use_dedicated_embeddings"):
        raise UnsupportedModelError(f"{option('draft')} mtp: {model_dir}: an MTP layer with embeddings of its own "
                                    "(mtp_use_dedicated_embeddings) is not read by colibri")
    first = text.get("num_hidden_layers", config.get("num_hidden_layers"))
    own, _ = layout.prefixes(f"model.layers.{first}", 0)
    name = f"{own}.{layout.projection}.weight"
    if name not in checkpoint:
        raise ModelFormatError(f"{model_dir}: config.json declares {n} multi-token-prediction layer(s) but the "
                               f"checkpoint has no {name!r} (a conversion that dropped them?)")
    return n, layout


def _check_mtp_precision(model_dir: Path, lm: CausalLM, weights: Weights, resolver: FormatResolver) -> None:
    """Refuse MTP layers stored in 4 bits (see ``FOUR_BIT_KERNELS``)."""
    prefixes = tuple(p for m in lm.mtp for p in m.prefixes)
    infos = [p.info for p in weights.params.values() if p.info.name.startswith(prefixes)]
    infos += [i for d in weights.experts if d.layer >= len(lm.layers) for i in d.matrices[0].values()]
    for info in infos:
        fmt = resolver.format_for(info)
        if fmt.kernel in FOUR_BIT_KERNELS:
            raise UsageError(f"{option('draft')} mtp: {model_dir}: tensor {info.name!r} of the multi-token-prediction "
                             f"layer is stored as {fmt.name} (4-bit), which makes its drafts rarely right; convert the original "
                             f"checkpoint with colibri convert (it keeps MTP layers int8 or better), or force it with "
                             f"{option('mtp_int4')}")
