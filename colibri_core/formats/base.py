"""Weight formats: how stored tensor bytes become the numbers the model computes with.

A format turns the raw arrays of one logical weight (the tensor itself plus, for
quantised formats, its companion scale tensors) into float32. The core ships the plain
float formats; quantised formats plug in through the same ``QuantSpec`` hook.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from colibri_core.io.safetensors import TensorInfo


@dataclass
class QuantTensor:
    """A weight kept in its stored (quantised) form for a backend kernel: ``kind`` names
    the kernel ("q8", "q4", "mxfp4", "fp8", "bf16", "q4g32", "mxfp4pair"), ``shape`` the
    logical (rows, cols)."""

    kind: str
    data: np.ndarray
    scales: np.ndarray | None
    shape: tuple[int, int]
    block: tuple[int, int] = (128, 128)  # fp8 scale blocks
    derived: dict = field(default_factory=dict, repr=False, compare=False)  # what a backend prepares once (kernel handles)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + (self.scales.nbytes if self.scales is not None else 0))


# kinds whose rows are independent (per-row or per-row-group scales): their rows can be
# reordered packed; fp8's scales cover blocks of rows
ROW_KINDS = frozenset({"q8", "q4", "mxfp4", "bf16", "q4g32", "mxfp4pair"})


def block_sources(order: np.ndarray, block: int) -> np.ndarray | None:
    """For rows read in ``order`` whose scales cover ``block`` consecutive rows (fp8's
    row blocks): the stored block each block of the result comes from, when every block
    of the result is one stored block's rows (in any order); None otherwise."""
    order = np.asarray(order)
    rows = len(order)
    sources = []
    for start in range(0, rows, block):
        chunk = order[start : start + block] // block
        j = int(chunk[0])
        if not np.all(chunk == j) or len(chunk) != min(block, rows - j * block):
            return None
        sources.append(j)
    return np.asarray(sources, dtype=np.int64)


def rows_stay_packed(kind: str | None, block: tuple[int, int], order: np.ndarray) -> bool:
    """Whether ``permute_rows`` keeps a packed weight of ``kind`` packed for ``order``."""
    if kind in ROW_KINDS:
        return True
    return kind == "fp8" and block_sources(order, block[0]) is not None


def permute_rows(host, order: np.ndarray):
    """A host-form weight (``host_form``: a float array, 1-D bias included, or a
    ``QuantTensor``) with its rows in ``order``: packed rows move with their scales, so
    the weight stays packed; fp8 rows too when ``order`` keeps each block of rows
    together (``block_sources``), the block scales then moving by block. None for a
    packed kind whose scales it would split."""
    if isinstance(host, QuantTensor):
        if host.kind == "fp8":
            sources = block_sources(order, host.block[0])
            if sources is None:
                return None
            return QuantTensor(host.kind, np.ascontiguousarray(host.data[order]),
                               np.ascontiguousarray(host.scales[sources]), host.shape, host.block)
        if host.kind not in ROW_KINDS:
            return None
        scales = None if host.scales is None else np.ascontiguousarray(host.scales[order])
        return QuantTensor(host.kind, np.ascontiguousarray(host.data[order]), scales, host.shape, host.block)
    return np.ascontiguousarray(np.asarray(host)[order])


class QuantFormat:
    """Base class of weight formats.

    ``kernel`` names the backend kernel that computes with the stored form directly
    (None: the weight is decoded to float32 at load). A backend that has the kernel keeps
    such weights in their stored form in memory (``QuantTensor``)."""

    name = "base"
    kernel: str | None = None
    # decode maps each stored element to one float32 on its own (no scales, no blocks):
    # a large tensor can be decoded a slice at a time, straight into its final buffer
    elementwise = False

    def matches(self, info: TensorInfo, context: "FormatContext") -> bool:
        """Claim a tensor from checkpoint evidence (quantization_config in
        ``context.config``, a stamp in the file's metadata, a companion scale tensor).
        Formats chosen by dtype alone leave this False."""
        return False

    def companions(self, info: TensorInfo, lookup) -> list[TensorInfo]:
        """Extra tensors (scales) this weight needs, found with ``lookup(name)``."""
        return []

    def stored_name(self, name: str, context: "FormatContext") -> str | None:
        """The name this format stores the tensor a family asks for as ``name`` under,
        when the checkpoint holds it so (compressed-tensors: ``X.weight_packed`` for
        ``X.weight``); None when it does not."""
        return None

    def logical_name(self, info: TensorInfo) -> str:
        """The name the tensor has unpacked (what ``colibri convert`` writes it as)."""
        return info.name

    def logical_shape(self, info: TensorInfo, context: "FormatContext") -> tuple[int, ...]:
        """The shape the model sees (packed formats store another)."""
        return info.shape

    def block(self, info: TensorInfo) -> tuple[int, int]:
        """The (rows, cols) block one scale covers in ``quantized``'s form (fp8's block
        scales; rows are otherwise independent)."""
        return (1, 1)

    def decode(self, info: TensorInfo, raw: np.ndarray, companions: dict[str, np.ndarray]) -> np.ndarray:
        """Return the weight as a float32 array of its logical shape."""
        raise NotImplementedError

    def quantized(self, info: TensorInfo, raw: np.ndarray, companions: dict[str, np.ndarray]) -> QuantTensor:
        """The stored form for ``kernel`` (formats with a kernel implement it)."""
        raise NotImplementedError

    def encode(self, name: str, weight: np.ndarray) -> dict[str, tuple[str, np.ndarray]]:
        """Quantise a float32 (rows, cols) weight for a colibri container: returns the
        tensors to write (the packed weight under ``name``, scales under ``name.qs``)."""
        raise NotImplementedError(f"the {self.name} format cannot encode")


class F32(QuantFormat):
    name = "f32"
    elementwise = True

    def decode(self, info, raw, companions):
        return np.array(raw, dtype=np.float32, copy=True)


class F16(QuantFormat):
    name = "f16"
    elementwise = True

    def decode(self, info, raw, companions):
        return raw.astype(np.float32)


class BF16(QuantFormat):
    name = "bf16"
    elementwise = True
    kernel = "bf16"

    def decode(self, info, raw, companions):
        return bf16_to_f32(raw)

    def quantized(self, info, raw, companions):
        return QuantTensor("bf16", np.ascontiguousarray(raw), None, tuple(info.shape))


class IndexTable(QuantFormat):
    """Integer tensors (I64 / I32): index tables such as DeepSeek-V4's ``tid2eid``
    (token id -> expert ids), decoded to float32, which holds every integer below 2**24
    exactly; a larger value is refused rather than rounded."""

    name = "index-table"
    elementwise = True

    def decode(self, info, raw, companions):
        if raw.size and int(np.abs(raw).max()) >= 1 << 24:
            from colibri_core.errors import ModelFormatError

            raise ModelFormatError(f"{info.path}: tensor {info.name!r} holds integers beyond 2**24, "
                                   "which colibri cannot read exactly as an index table")
        return raw.astype(np.float32)


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32: the bf16 bits are the high half of an f32."""
    out = np.empty(raw.shape, dtype=np.uint32)
    np.left_shift(raw, 16, out=out, dtype=np.uint32)
    return out.view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even like torch does."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


@dataclass(frozen=True)
class FormatContext:
    """What a format may look at to claim a tensor: the checkpoint (its tensors and each
    file's metadata) and the model's config.json (``quantization_config``)."""

    checkpoint: object
    config: dict


class FormatResolver:
    """Chooses the registered format that decodes each stored tensor.

    A format claims a tensor from evidence in the checkpoint (``QuantFormat.matches``:
    quantization_config, a colibri stamp, a companion scale tensor); when none does, the
    tensor's safetensors dtype decides. Two formats claiming one tensor, or a tensor no
    installed format reads, is an error naming it: the format is never guessed.
    """

    def __init__(self, registry, checkpoint=None, config: dict | None = None):
        self._formats: list[QuantFormat] = []
        self._by_dtype: dict[str, QuantFormat] = {}
        for entry in registry.all("quant"):
            fmt = entry.spec.load()()
            self._formats.append(fmt)
            for dtype in entry.spec.dtypes:
                self._by_dtype.setdefault(dtype, fmt)
        self._context = FormatContext(checkpoint, config or {})
        self._chosen: dict[str, QuantFormat] = {}

    def format_for(self, info: TensorInfo) -> QuantFormat:
        fmt = self._chosen.get(info.name)
        if fmt is not None:
            return fmt
        from colibri_core.errors import UnsupportedModelError

        claims = [f for f in self._formats if f.matches(info, self._context)]
        if len(claims) > 1:
            names = " and ".join(repr(f.name) for f in claims)
            raise UnsupportedModelError(f"{info.path}: tensor {info.name!r} is claimed by formats {names}; refusing to guess")
        fmt = claims[0] if claims else self._by_dtype.get(info.dtype)
        if fmt is None:
            raise UnsupportedModelError(
                f"{info.path}: tensor {info.name!r} is stored as {info.dtype}, which no installed weight format reads"
            )
        self._chosen[info.name] = fmt
        return fmt

    def logical_shape(self, info: TensorInfo) -> tuple[int, ...]:
        return tuple(self.format_for(info).logical_shape(info, self._context))

    def stored_name(self, name: str) -> str:
        """The checkpoint's name for the tensor a family asks for as ``name`` (a format
        may store it under another, ``QuantFormat.stored_name``); ``name`` itself otherwise."""
        checkpoint = self._context.checkpoint
        if checkpoint is None or name in checkpoint.tensors:
            return name
        for fmt in self._formats:
            stored = fmt.stored_name(name, self._context)
            if stored is not None:
                return stored
        return name

    def logical_name(self, info: TensorInfo) -> str:
        return self.format_for(info).logical_name(info)

    def claimant(self, info: TensorInfo) -> QuantFormat | None:
        """The format that claims ``info`` from checkpoint evidence, None when only its
        dtype would decide."""
        return next((f for f in self._formats if f.matches(info, self._context)), None)

    def host_form(self, info: TensorInfo, raw: np.ndarray, companions: dict[str, np.ndarray], backend, use: str):
        """A weight in host memory as the backend wants it handed over: its stored form
        (``QuantTensor``) when the backend keeps this packed kind for the weight's ``use``
        ("linear", "embedding" or "array"), else decoded to float32."""
        fmt = self.format_for(info)
        if self.kept_packed(info, backend, use):
            return fmt.quantized(info, raw, companions)
        return fmt.decode(info, raw, companions)

    def kept_packed(self, info: TensorInfo, backend, use: str) -> bool:
        fmt = self.format_for(info)
        return fmt.kernel is not None and backend.keeps_stored(fmt.kernel, use)

    def host_nbytes(self, info: TensorInfo, backend, use: str) -> int:
        """Bytes of ``host_form``."""
        if self.kept_packed(info, backend, use):
            return info.nbytes + sum(t.nbytes for t in self.companions(info))
        return 4 * _numel(self.logical_shape(info))

    def resident(self, info: TensorInfo, raw: np.ndarray, companions: dict[str, np.ndarray], backend, use: str):
        """The weight prepared on the backend (``Backend.prepare_weight`` of its host form)."""
        return backend.prepare_weight(self.host_form(info, raw, companions, backend, use), use)

    def resident_nbytes(self, info: TensorInfo, backend, use: str) -> int:
        """Bytes the prepared weight takes in the backend's memory."""
        kind = self.format_for(info).kernel if self.kept_packed(info, backend, use) else None
        return backend.weight_nbytes(kind, self.logical_shape(info), self.host_nbytes(info, backend, use))

    def companions(self, info: TensorInfo) -> list[TensorInfo]:
        checkpoint = self._context.checkpoint
        lookup = checkpoint.tensors.get if checkpoint is not None else (lambda name: None)
        return self.format_for(info).companions(info, lookup)

    def with_companions(self, infos: list[TensorInfo]) -> list[TensorInfo]:
        """The tensors to read for ``infos``: themselves and their formats' companions."""
        wanted = {t.name: t for t in infos}
        for info in infos:
            for t in self.companions(info):
                wanted.setdefault(t.name, t)
        return list(wanted.values())

    def decode_all(self, infos: list[TensorInfo], raw: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Decode raw bytes (by tensor name, companions included) to float32 arrays."""
        out = {}
        for info in infos:
            companions = {t.name: raw[t.name] for t in self.companions(info)}
            out[info.name] = self.format_for(info).decode(info, raw[info.name], companions)
        return out

    def read_decoded(self, checkpoint, infos: list[TensorInfo]) -> dict[str, np.ndarray]:
        """Read tensors and their companions (merging nearby reads) and decode each to float32."""
        return self.decode_all(infos, checkpoint.read_many(self.with_companions(infos)))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
