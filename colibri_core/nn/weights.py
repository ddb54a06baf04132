"""Declaring a model's weights: families ask for tensors by name and expected shape.

Every declaration is checked against the already-parsed safetensors headers at once, so
a wrong config or checkpoint is refused before any weight is allocated. Dense weights
are read and decoded in one pass afterwards (``load_dense``); expert weights are only
located here and stream through the expert store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..checkpoint import Checkpoint
from ..errors import ModelFormatError
from ..safetensors_file import TensorInfo


class Param:
    """A dense weight: its location now, its backend array after ``load_dense``."""

    __slots__ = ("info", "value")

    def __init__(self, info: TensorInfo):
        self.info = info
        self.value = None

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def numel(self) -> int:
        return self.info.numel


@dataclass
class ExpertDecl:
    """The routed experts of one MoE layer, located on disk."""

    layer: int  # decoder layer index
    count: int
    matrices: list[dict[str, TensorInfo]]  # per expert: role -> tensor
    moe_index: int = -1  # index among MoE layers, set when the store is built

    @property
    def numel_per_expert(self) -> int:
        return sum(info.numel for info in self.matrices[0].values())


@dataclass
class Weights:
    checkpoint: Checkpoint
    params: dict[str, Param] = field(default_factory=dict)
    experts: list[ExpertDecl] = field(default_factory=list)

    @property
    def config_source(self) -> str:
        """The config file's path, for error messages of ModelArgs.from_dict and build_rope."""
        return str(self.checkpoint.model_dir / "config.json")

    def _lookup(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        if name not in self.checkpoint:
            raise ModelFormatError(f"{self.checkpoint.model_dir}: missing tensor {name!r}")
        info = self.checkpoint.info(name)
        if info.shape != tuple(shape):
            raise ModelFormatError(
                f"{info.path}: tensor {name!r} has shape {list(info.shape)}, but config.json implies {list(shape)}"
            )
        return info

    def param(self, name: str, shape: tuple[int, ...]) -> Param:
        if name not in self.params:
            self.params[name] = Param(self._lookup(name, shape))
        elif self.params[name].info.shape != tuple(shape):
            raise ModelFormatError(f"tensor {name!r} is declared with two shapes")
        return self.params[name]

    def optional(self, name: str, shape: tuple[int, ...]) -> Param | None:
        return self.param(name, shape) if name in self.checkpoint else None

    def expert_layer(self, layer: int, count: int, matrices: dict[str, tuple[str, tuple[int, ...]]]) -> ExpertDecl:
        """Locate ``count`` experts of one layer. ``matrices`` maps a role to (name
        template with ``{e}`` for the expert index, expected shape of one expert's matrix).

        A template without ``{e}`` names a fused tensor of shape (count, *shape) whose
        slice e is one contiguous byte range (the layout transformers 5 uses)."""
        per_expert: list[dict[str, TensorInfo]] = [dict() for _ in range(count)]
        for role, (template, shape) in matrices.items():
            if "{e}" in template:
                for e in range(count):
                    per_expert[e][role] = self._lookup(template.format(e=e), shape)
            else:
                fused = self._lookup(template, (count, *shape))
                stride = fused.nbytes // count
                for e in range(count):
                    per_expert[e][role] = TensorInfo(
                        f"{template}[{e}]", fused.path, fused.dtype, tuple(shape), fused.offset + e * stride, stride
                    )
        decl = ExpertDecl(layer, count, per_expert)
        self.experts.append(decl)
        return decl

    # -- shorthands that return ready blocks --------------------------------------------
    def linear(self, prefix: str, out_features: int, in_features: int, *, bias: bool = False):
        """``prefix.weight`` (out, in) and, when ``bias``, ``prefix.bias`` (out,)."""
        from .layers import Linear

        b = self.param(f"{prefix}.bias", (out_features,)) if bias else None
        return Linear(self.param(f"{prefix}.weight", (out_features, in_features)), b)

    def rms_norm(self, prefix: str, dim: int, eps: float):
        from .layers import RMSNorm

        return RMSNorm(self.param(f"{prefix}.weight", (dim,)), eps)

    @property
    def dense_numel(self) -> int:
        return sum(p.numel for p in self.params.values())

    def load_dense(self, resolver, backend, progress: Callable[[int], None] | None = None) -> int:
        """Read, decode and upload every dense weight, in file order. Returns bytes read."""
        order = sorted(self.params.values(), key=lambda p: (p.info.path, p.info.offset))
        read = 0
        batch: list[Param] = []
        batch_bytes = 0
        for p in order + [None]:
            # decode in batches of ~64 MiB: few reads, bounded temporary memory
            if p is None or batch_bytes + p.info.nbytes > (64 << 20) and batch:
                decoded = resolver.read_decoded(self.checkpoint, [q.info for q in batch])
                for q in batch:
                    q.value = backend.asarray(decoded[q.name])
                    read += q.info.nbytes
                    if progress:
                        progress(q.info.nbytes)
                batch, batch_bytes = [], 0
            if p is not None:
                batch.append(p)
                batch_bytes += p.info.nbytes
        return read
