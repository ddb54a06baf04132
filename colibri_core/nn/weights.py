"""Declaring a model's weights: families ask for tensors by name and expected shape.

Every declaration is checked against the already-parsed safetensors headers at once, so
a wrong config or checkpoint is refused before any weight is allocated. Dense weights
are read and decoded in one pass afterwards (``load_dense``); expert weights are only
located here and stream through the expert store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from colibri_core.io.checkpoint import Checkpoint
from colibri_core.io.buffers import huge_buffer
from colibri_core.errors import ModelFormatError
from colibri_core.formats.base import permute_rows, rows_stay_packed
from colibri_core.io.safetensors import TensorInfo
from colibri_core.compute.backend import GatedActivation, UngatedActivation
from colibri_core.nn.layers import Linear, RMSNorm, RoutedExperts, SwiGLU


class Param:
    """A dense weight: its location now, its backend array after ``load_dense``.

    ``transform`` (optional) maps the decoded float32 host array to the array the model
    computes with, once at load: a reshape, a row regrouping, ``1 + w`` for norms stored
    as offsets. Only exact or reference-defined arithmetic belongs there: it runs on the
    host, the same for every backend and placement.

    ``row_order`` (optional) reads the rows in that order instead (a regrouping of a
    linear weight's output channels): the weight stays packed when its format's scales
    allow it (``formats.base.permute_rows``), else it is decoded to float32 first; either
    way it is still only multiplied through ``linear``."""

    __slots__ = ("info", "value", "transform", "shape", "role", "row_order")

    def __init__(self, info: TensorInfo, transform: Callable | None = None, shape: tuple[int, ...] | None = None,
                 row_order: np.ndarray | None = None):
        self.info = info
        self.value = None
        self.transform = transform
        self.row_order = row_order
        self.shape = tuple(shape) if shape is not None else info.shape  # logical (packed formats store another)
        # "linear": only ever multiplied through ops.linear, so a backend may keep it in
        # its stored (quantised) form; "embedding": rows looked up (and perhaps a tied LM
        # head); "router": a linear whose precision steers routing; "plain": used as an
        # array (norms, matrices some block reads itself)
        self.role = "plain"

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def use(self) -> str:
        """How the model uses the array: "linear" (only through ops.linear), "embedding"
        (rows looked up, and possibly a tied LM head) or "array" (read as is). A backend
        may keep a weight in its stored (packed) form for the first two."""
        if self.transform is not None or self.role not in ("linear", "embedding"):
            return "array"
        return self.role


class ExpertMatrices(dict):
    """One expert's tensors by role (role -> ``TensorInfo``), and for roles the blocks do
    not only multiply as stored, ``forms``: role -> (use, transform). Such a role is
    decoded to float32 ("array") and, when a transform is given, mapped by it on the host
    once per read (a transpose of a (hidden, out) slice; a bias left unpacked).
    ``row_orders``: role -> the order its rows are read in (``permute_rows``: packed
    forms stay packed), e.g. a gate/up-interleaved ``gate_up`` read as gate rows, then up
    rows, once when the expert is read instead of at every step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.forms: dict[str, tuple[str, Callable | None]] = {}
        self.row_orders: dict[str, np.ndarray] = {}

    def use_of(self, role: str) -> str:
        return self.forms.get(role, ("linear", None))[0]

    def transform_of(self, role: str) -> Callable | None:
        return self.forms.get(role, ("linear", None))[1]


@dataclass
class ExpertDecl:
    """The routed experts of one MoE layer, located on disk. ``activation`` and the
    roles say how ``RoutedExperts`` computes them: plain SiLU-SwiGLU on
    gate/up/down without biases goes through ``ops.routed_experts``; anything else
    (biases, a fused ``gate_up`` role, another activation) through ``ops.routed_glu_experts``."""

    layer: int  # decoder layer index
    count: int
    matrices: list[ExpertMatrices]  # per expert: role -> tensor
    moe_index: int = -1  # index among MoE layers, set when the store is built
    # an UngatedActivation: experts of roles up and down only, down(act(up(x)))
    activation: GatedActivation | UngatedActivation = field(default_factory=GatedActivation)

    @property
    def glu(self) -> bool:
        """Whether these experts need ``routed_glu_experts``."""
        return not self.activation.plain or set(self.matrices[0]) != {"gate", "up", "down"}



def pairs_to_halves(heads: int, head_dim: int) -> np.ndarray:
    """Row order putting each head's even features first, then its odd ones."""
    per_head = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    return (np.arange(heads)[:, None] * head_dim + per_head[None, :]).reshape(-1)

@dataclass
class Weights:
    checkpoint: Checkpoint
    resolver: object = None  # FormatResolver: the logical shapes of packed formats
    params: dict[str, Param] = field(default_factory=dict)
    experts: list[ExpertDecl] = field(default_factory=list)
    # a family's name -> the checkpoint's, for checkpoints that keep their original
    # (pre-transformers) names: the family asks under transformers' names either way
    aliases: dict[str, str] = field(default_factory=dict)
    # multi-token-prediction layers to build as well (``build_decoder``; a draft source's),
    # in this layout (``nn.mtp.MTPLayout``; None: DeepSeek-V3's)
    mtp_layers: int = 0
    mtp_layout: Any = None

    def shape_of(self, info: TensorInfo) -> tuple[int, ...]:
        return self.resolver.logical_shape(info) if self.resolver is not None else info.shape

    @property
    def config_source(self) -> str:
        """The config file's path, for error messages of ModelArgs.from_dict and build_rope."""
        return str(self.checkpoint.model_dir / "config.json")

    def stored_name(self, name: str) -> str:
        """The checkpoint's name for the tensor a family asks for as ``name``: a packed
        format may store it under another (compressed-tensors ``X.weight_packed`` for
        ``X.weight``, gpt-oss's ``X_blocks`` for ``X``), and a checkpoint in its original
        layout under its own (``aliases``)."""
        name = self.aliases.get(name, name)
        return self.resolver.stored_name(name) if self.resolver is not None else name

    def _lookup(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        stored = self.stored_name(name)
        if stored not in self.checkpoint:
            raise ModelFormatError(f"{self.checkpoint.model_dir}: missing tensor {self.aliases.get(name, name)!r}")
        info = self.checkpoint.info(stored)
        if self.shape_of(info) != tuple(shape):
            raise ModelFormatError(
                f"{info.path}: tensor {self.aliases.get(name, name)!r} has shape {list(self.shape_of(info))}, but config.json implies {list(shape)}"
            )
        return info

    def param(self, name: str, shape: tuple[int, ...], transform: Callable | None = None, *,
              row_order: np.ndarray | None = None) -> Param:
        """``transform``: see ``Param``; ``row_order``: the rows read in that order (see
        ``Param``), for a 2-D weight without a transform."""
        if row_order is not None:
            row_order = np.asarray(row_order, dtype=np.int64)
            if transform is not None or len(shape) != 2 or sorted(row_order.tolist()) != list(range(shape[0])):
                raise ValueError(f"tensor {name!r}: row_order must be a permutation of the rows of a 2-D weight "
                                 "without a transform")
        if name not in self.params:
            info = self._lookup(name, shape)
            self.params[name] = Param(info, transform, self.shape_of(info), row_order)
        elif self.params[name].shape != tuple(shape):
            raise ModelFormatError(f"tensor {name!r} is declared with two shapes")
        elif self.params[name].transform is not transform or \
                (self.params[name].row_order is None) != (row_order is None) or \
                (row_order is not None and not np.array_equal(self.params[name].row_order, row_order)):
            raise ValueError(f"tensor {name!r} is declared with two different load transforms")
        return self.params[name]

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds a tensor of this name (to choose between layouts),
        under this name or the one a packed format stores it under (``stored_name``)."""
        return self.stored_name(name) in self.checkpoint

    def optional(self, name: str, shape: tuple[int, ...]) -> Param | None:
        return self.param(name, shape) if self.has(name) else None

    def expert_layer(self, layer: int, count: int, matrices: dict[str, tuple], *,
                     activation: GatedActivation | UngatedActivation | None = None, interleaved: bool = False,
                     transforms: dict[str, Callable] | None = None) -> ExpertDecl:
        """Locate ``count`` experts of one layer. ``matrices`` maps a role to (name
        template with ``{e}`` for the expert index, expected shape of one expert's matrix).

        A template without ``{e}`` names a fused tensor of shape (count, *shape) whose
        slice e is one contiguous byte range (the layout transformers 5 uses). A third
        item ``(part, parts)`` reads a fused tensor packing ``parts`` matrices along their
        first axis, (count, parts * shape[0], *shape[1:]): the role is part ``part`` of each
        expert's slice (``gate_up_proj``: gate is part 0 of 2, up part 1).

        Roles are ``gate``, ``up`` and ``down`` (out, in) or one fused ``gate_up`` (2 *
        inter, in), gate rows first; with ``interleaved`` its stored rows (and those of
        ``gate_up_bias``) alternate gate, up, ... (gpt-oss) and are read reordered, gate
        rows first (packed forms stay packed), so the blocks compute plain halves. Plus
        optional biases ``gate_bias``, ``up_bias`` / ``gate_up_bias``, ``down_bias`` (1-D).
        ``transforms``: role -> a host function applied to the decoded float32 slice at
        each read (e.g. ``numpy.transpose`` for a (in, out) layout); the shape given is the
        stored slice's. Biases and transformed roles reach the backend as float32.
        ``activation``: the experts' ``GatedActivation`` (default SiLU-SwiGLU), or an
        ``UngatedActivation`` for experts of roles ``up`` and ``down`` only (no gate)."""
        transforms = dict(transforms or {})
        products = {role for role in matrices if not role.endswith("_bias")}
        if isinstance(activation, UngatedActivation) != (products == {"up", "down"}):
            raise ValueError(f"experts of roles {sorted(products)}: an UngatedActivation goes with roles up and down "
                             "alone, and those with an UngatedActivation")
        unknown = set(transforms) - set(matrices)
        if unknown:
            raise ValueError(f"transforms for undeclared roles: {sorted(unknown)}")
        per_expert: list[ExpertMatrices] = [ExpertMatrices() for _ in range(count)]
        for role, (template, shape, *packed) in matrices.items():
            part, parts = packed[0] if packed else (0, 1)
            if "{e}" in template:
                if parts != 1:
                    raise ValueError(f"{role}: a per-expert template cannot be packed")
                for e in range(count):
                    per_expert[e][role] = self._lookup(template.format(e=e), shape)
            else:
                fused = self._lookup(template, (count, parts * shape[0], *shape[1:]))
                stride = fused.nbytes // count
                piece = stride // parts
                suffix = f"[{part}/{parts}]" if parts > 1 else ""
                # the slice as stored (a packed format's slice is packed too; its format
                # finds the matching slice of its scales from the name)
                stored_shape = (fused.shape[1] // parts, *fused.shape[2:])
                for e in range(count):
                    per_expert[e][role] = TensorInfo(f"{fused.name}[{e}]{suffix}", fused.path, fused.dtype, stored_shape,
                                                     fused.offset + e * stride + part * piece, piece)
        if interleaved and "gate_up" not in matrices:
            raise ValueError("interleaved experts need a fused gate_up role")
        for m in per_expert:
            for role in m:
                if role in transforms or role.endswith("_bias"):
                    m.forms[role] = ("array", transforms.get(role))
            if interleaved:
                rows = matrices["gate_up"][1][0]  # (2 * inter, in) as stored
                order = np.concatenate([np.arange(0, rows, 2), np.arange(1, rows, 2)])
                m.row_orders.update({role: order for role in ("gate_up", "gate_up_bias") if role in m})
        decl = ExpertDecl(layer, count, per_expert, activation=activation or GatedActivation())
        self.experts.append(decl)
        return decl

    # -- shorthands that return ready blocks --------------------------------------------
    def linear(self, prefix: str, out_features: int, in_features: int, *, bias: bool = False):
        """``prefix.weight`` (out, in) and, when ``bias``, ``prefix.bias`` (out,)."""
        b = self.param(f"{prefix}.bias", (out_features,)) if bias else None
        weight = self.param(f"{prefix}.weight", (out_features, in_features))
        weight.role = "linear"  # blocks that read it otherwise say so when they are built
        return Linear(weight, b)

    def halves_linear(self, prefix: str, n_heads: int, head_dim: int, in_features: int, *, bias: bool = False):
        """A q or k projection whose checkpoint rotates interleaved pairs (ERNIE 4.5, Cohere):
        ``linear`` with each head's rows (and bias) reordered to even features first, then
        odd ones, so the usual half-split RoPE applies (the scores are unchanged: q and k
        are permuted alike)."""
        order = pairs_to_halves(n_heads, head_dim)
        weight = self.param(f"{prefix}.weight", (n_heads * head_dim, in_features), row_order=order)
        b = self.param(f"{prefix}.bias", (n_heads * head_dim,), lambda v: np.ascontiguousarray(v[order])) if bias else None
        weight.role = "linear"
        return Linear(weight, b)

    def rms_norm(self, prefix: str, dim: int, eps: float, *, offset: bool = False):
        """``prefix.weight`` (dim,). With ``offset`` the checkpoint stores w and the norm
        scales by (1 + w) (Gemma, Qwen3-Next): 1 + w is computed once at load, in float32,
        exactly as the reference computes it on every call."""
        return RMSNorm(self.param(f"{prefix}.weight", (dim,), _plus_one if offset else None), eps)

    def swiglu(self, prefix: str, hidden: int, intermediate: int, activation: GatedActivation | None = None):
        """A dense SwiGLU MLP stored as ``prefix.{gate,up,down}_proj.weight`` (``activation``:
        another ``GatedActivation``, e.g. clamped)."""
        return SwiGLU(self.linear(f"{prefix}.gate_proj", intermediate, hidden), self.linear(f"{prefix}.up_proj", intermediate, hidden),
                      self.linear(f"{prefix}.down_proj", hidden, intermediate), activation)

    def swiglu_experts(self, layer: int, prefix: str, count: int, hidden: int, intermediate: int,
                       activation: GatedActivation | None = None):
        """Routed SwiGLU experts, in any layout the checkpoint has: one tensor per
        expert, ``prefix.{e}.{gate,up,down}_proj.weight`` (or Mixtral's
        ``prefix.{e}.{w1,w3,w2}.weight``), or fused as transformers 5 keeps
        them, ``prefix.gate_up_proj`` (count, 2 * inter, hidden; gate rows first) and
        ``prefix.down_proj`` (count, hidden, inter). Returns the ``RoutedExperts`` block;
        ``activation``: the experts' ``GatedActivation`` (default SiLU-SwiGLU)."""
        if not self.has(f"{prefix}.gate_up_proj") and self.has(f"{prefix}.0.w1.weight"):
            # Mixtral's naming (Kimi Linear's checkpoints): w1 gate, w3 up, w2 down
            matrices = {
                "gate": (f"{prefix}.{{e}}.w1.weight", (intermediate, hidden)),
                "up": (f"{prefix}.{{e}}.w3.weight", (intermediate, hidden)),
                "down": (f"{prefix}.{{e}}.w2.weight", (hidden, intermediate)),
            }
        elif self.has(f"{prefix}.gate_up_proj"):
            matrices = {
                "gate": (f"{prefix}.gate_up_proj", (intermediate, hidden), (0, 2)),
                "up": (f"{prefix}.gate_up_proj", (intermediate, hidden), (1, 2)),
                "down": (f"{prefix}.down_proj", (hidden, intermediate)),
            }
        else:
            matrices = {
                "gate": (f"{prefix}.{{e}}.gate_proj.weight", (intermediate, hidden)),
                "up": (f"{prefix}.{{e}}.up_proj.weight", (intermediate, hidden)),
                "down": (f"{prefix}.{{e}}.down_proj.weight", (hidden, intermediate)),
            }
        return RoutedExperts(self.expert_layer(layer, count, matrices, activation=activation))

    def attention_projections(self, prefix: str, hidden: int, n_heads: int, n_kv_heads: int, head_dim: int, *,
                              qkv_bias: bool = False, o_bias: bool = False, q_per_head: int = 1,
                              v_head_dim: int | None = None) -> dict:
        """``prefix.{q,k,v,o}_proj`` as keyword arguments of ``Attention``. ``q_per_head``
        = 2 when q_proj also produces an output gate per head (Qwen3-Next); ``v_head_dim``:
        the value heads' width when it is not ``head_dim`` (give ``Attention`` the same)."""
        dv = head_dim if v_head_dim is None else v_head_dim
        return {
            "q": self.linear(f"{prefix}.q_proj", n_heads * head_dim * q_per_head, hidden, bias=qkv_bias),
            "k": self.linear(f"{prefix}.k_proj", n_kv_heads * head_dim, hidden, bias=qkv_bias),
            "v": self.linear(f"{prefix}.v_proj", n_kv_heads * dv, hidden, bias=qkv_bias),
            "o": self.linear(f"{prefix}.o_proj", hidden, n_heads * dv, bias=o_bias),
        }

    @property
    def dense_numel(self) -> int:
        return sum(p.numel for p in self.params.values())

    def resident_bytes(self, resolver, backend) -> int:
        """Memory the dense weights will take on ``backend``."""
        return sum(resolver.resident_nbytes(p.info, backend, p.use) if self._packed(p, resolver, backend)
                   or p.row_order is None else backend.weight_nbytes(None, p.shape, 4 * p.numel)
                   for p in self.params.values())

    @staticmethod
    def _packed(p: Param, resolver, backend) -> bool:
        """Whether ``p`` is placed in its stored form: no transform, the backend keeps the
        format's kind for its use, and its rows (if reordered) move without splitting scales."""
        if p.transform is not None or not resolver.kept_packed(p.info, backend, p.use):
            return False
        fmt = resolver.format_for(p.info)
        return p.row_order is None or rows_stay_packed(fmt.kernel, fmt.block(p.info), p.row_order)

    def load_dense(self, resolver, backend, progress: Callable[[int], None] | None = None) -> int:
        """Read every dense weight in file order and place it on the backend: in its stored
        form when the backend has the format's kernel and the weight is only used by
        ``linear``, else decoded to float32. Returns bytes read."""
        order = sorted(self.params.values(), key=lambda p: (p.info.path, p.info.offset))
        read = 0
        streamed = [p for p in order if self._streams(p, resolver, backend)]
        for p in streamed:
            read += self._load_streamed(p, resolver, backend, progress)
        rest = [p for p in order if p not in set(streamed)]
        # kept in their stored form, weights are views of the buffer they are read into:
        # large batches (few reads) cost nothing beyond the weights themselves; decoded,
        # a batch's bytes live beside their decodes until it is done: small batches
        kept = [p for p in rest if self._packed(p, resolver, backend)]
        decoded = [p for p in rest if p not in set(kept)]
        for params, limit in ((kept, 64 << 20), (decoded, STREAM_MIN_BYTES)):
            batch: list[Param] = []
            batch_bytes = 0
            for p in params + [None]:
                if p is None or batch_bytes + p.info.nbytes > limit and batch:
                    read += self._load_batch(batch, resolver, backend, progress)
                    batch, batch_bytes = [], 0
                if p is not None:
                    batch.append(p)
                    batch_bytes += p.info.nbytes
        return read

    def _load_batch(self, batch: list[Param], resolver, backend, progress) -> int:
        if not batch:
            return 0
        raw = self.checkpoint.read_many(resolver.with_companions([q.info for q in batch]), buffer=huge_buffer)
        read = 0
        for q in batch:
            companions = {t.name: raw[t.name] for t in resolver.companions(q.info)}
            if q.transform is not None:
                host = resolver.format_for(q.info).decode(q.info, raw[q.name], companions)
                q.value = backend.prepare_weight(q.transform(host), "array")
            elif q.row_order is not None:
                if self._packed(q, resolver, backend):
                    host = permute_rows(resolver.host_form(q.info, raw[q.name], companions, backend, q.use), q.row_order)
                else:
                    host = permute_rows(resolver.format_for(q.info).decode(q.info, raw[q.name], companions), q.row_order)
                q.value = backend.prepare_weight(host, q.use)
            else:
                q.value = resolver.resident(q.info, raw[q.name], companions, backend, q.use)
            read += q.info.nbytes
            if progress:
                progress(q.info.nbytes)
        return read


    @staticmethod
    def _streams(p: Param, resolver, backend) -> bool:
        """Whether ``p`` is decoded to float32 slice by slice into its final buffer: a
        large weight the backend does not keep in its stored form, in a format whose
        decode is element by element. Read whole, it would sit beside its decode (a
        float32 copy, or twice the bytes of a float16 one) and overshoot the budget."""
        if p.info.nbytes < STREAM_MIN_BYTES or resolver.companions(p.info):
            return False
        if Weights._packed(p, resolver, backend):
            return False
        return resolver.format_for(p.info).elementwise

    def _load_streamed(self, p: Param, resolver, backend, progress) -> int:
        fmt = resolver.format_for(p.info)
        numel = 1
        for d in p.info.shape:
            numel *= d
        final = huge_buffer(4 * numel).view(np.float32)
        for first, chunk in self.checkpoint.read_chunks(p.info, STREAM_CHUNK_BYTES):
            final[first : first + chunk.size] = fmt.decode(p.info, chunk, {})
            if progress:
                progress(chunk.nbytes)
        host = final.reshape(p.info.shape)
        if p.row_order is not None:
            host = permute_rows(host, p.row_order)
        p.value = backend.prepare_weight(p.transform(host), "array") if p.transform is not None else \
            backend.prepare_weight(host, p.use)
        return p.info.nbytes


# a weight at least this large is decoded a slice at a time (each slice this large)
STREAM_MIN_BYTES = 8 << 20
STREAM_CHUNK_BYTES = 4 << 20


def _plus_one(w):
    return w + w.dtype.type(1.0)
