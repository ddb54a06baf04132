"""The backend contract: everything the core asks of a compute backend.

The shared blocks in ``colibri_core.nn`` do their array work through a backend
(``step.ops``), so a family written once runs on every backend. A backend is a subclass
of ``Backend``: the abstract methods below are required; the others have reference
implementations written against the contract itself, which a backend may replace with
faster ones. ``colibri_core.compute.reference.ReferenceBackend`` (numpy) is the reference
every backend is checked against, op by op, by the conformance kit
(``colibri_core.testing.backend_kit``); docs/backends.md walks through writing one.

**Arrays.** A backend's arrays are its own (numpy arrays on the CPU, ``mx.array`` on
MLX, CuPy arrays on CUDA). Besides the contract methods, the core uses only this array
protocol on them, which numpy, CuPy and MLX arrays all satisfy:

- ``x.shape`` (tuple of ints), ``x.ndim``, ``x.dtype``;
- ``x.reshape(*shape)`` and ``x.transpose(*axes)``;
- basic indexing with ints, slices, ``...`` and ``None`` (``x[:, a:b]``, ``x[-1:]``),
  and assignment into a basic slice (``cache[:, a:b] = rows``);
- ``+ - * /`` and unary ``-`` between two arrays of the backend (numpy broadcasting) and
  between an array and a Python ``float`` / ``int`` (never a numpy scalar: numpy would
  take over the operation).

Nothing else: no fancy indexing (``take_rows`` / ``add_rows``), no reductions, no numpy
functions. Host data crosses only through ``asarray`` (host -> backend) and ``to_host``
(backend -> host); every ``to_host`` is a synchronisation point and is counted
(``host_syncs``), so the statistics show how many a token costs.

**Dtypes.** Allocation names its dtype ("float32", "bfloat16", "float16", "int64",
"int32"). Activations are ``activation_dtype`` and caches ``cache_dtype``; float32 is the
reference, and a backend lists the float dtypes it computes in (``float_dtypes``). Attention
keys and values may be kept in another dtype the backend lists in ``kv_dtypes``
(``kv_cache_dtype``; the CPU backend: float16), which ``attention`` then takes.

**Weights.** A weight arrives in its host form: a float32 numpy array, or a
``QuantTensor`` (the stored packed form) when ``keeps_stored(kind, use)`` says the
backend wants it packed. ``prepare_weight`` turns it, once, into the backend's own form
(an upload, a repack to a native quantised layout, a decode); blocks pass that form back
to ``linear``, ``embedding`` and the experts' products and never look inside it.

**Memory.** ``device_memory()`` is None for a backend whose arrays live in host RAM (the
CPU): then its prepared weights count against ``--ram``. A backend with memory of its
own returns its size; the expert store then keeps prepared experts in a device tier
under ``--vram`` fed from the RAM tier (``unified_memory``: device and host memory are
one pool, as on Apple silicon, and share one budget). A backend that manages its memory
its own way names its own ``DeviceTier`` subclass in ``device_tier``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

import numpy as np

from colibri_core.compute import composites, host


@runtime_checkable
class Array(Protocol):
    """The array protocol above, as a type: what the core may use of a backend's array.
    numpy, CuPy, MLX and the Vulkan backend's arrays satisfy it; the conformance kit
    checks each backend's. Arrays carry no device of their own (MLX's have none): a
    backend's arrays live where the backend computes."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def ndim(self) -> int: ...

    @property
    def dtype(self) -> Any: ...

    def reshape(self, *shape: int) -> "Array": ...

    def transpose(self, *axes: int) -> "Array": ...

    def __getitem__(self, key: Any) -> "Array": ...

    def __setitem__(self, key: Any, value: Any) -> None: ...

    def __add__(self, other: Any) -> "Array": ...

    def __sub__(self, other: Any) -> "Array": ...

    def __mul__(self, other: Any) -> "Array": ...

    def __truediv__(self, other: Any) -> "Array": ...

    def __neg__(self) -> "Array": ...

Weight = Any  # what prepare_weight returns: the backend's form of a weight

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4, "uint8": 1}


def allocated_dtype(dtypes: dict[str, Any], dtype: str) -> Any:
    """``dtypes[dtype]``: a backend's own type for the dtype name ``dtype``, from its table
    of the dtypes it allocates; a ValueError naming them for any other."""
    try:
        return dtypes[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not one this backend allocates ({', '.join(dtypes)})") from None


class Backend(abc.ABC):
    """The contract. Subclasses set ``name`` and implement every abstract method."""

    name = "base"
    activation_dtype = "float32"
    cache_dtype = "float32"
    # attention keys and values (KVCache, SlidingKVCache): ``kv_dtype`` when set (``load(kv_cache=)``,
    # one of ``kv_dtypes``), else cache_dtype; float16 halves what a decode step reads per position
    kv_dtypes: tuple[str, ...] = ("float32",)
    kv_dtype: str | None = None
    float_dtypes: tuple[str, ...] = ("float32",)
    unified_memory = False
    # True when work is queued and runs once the host needs a result (to_host): time measured
    # on the host between two calls is then not the work between them (the profiling page says so)
    deferred = False
    # a colibri_core.experts.tiers.DeviceTier subclass of the backend's own ("module:Class"
    # or the class); None: the registered device tier (the generic one)
    device_tier: Any = None
    # the largest difference from transformers' float32 logits this backend promises (the
    # family oracle suites check it); greedy tokens must be identical regardless
    logits_tolerance = 1e-4

    def __init__(self) -> None:
        self.host_syncs = 0  # to_host calls so far

    @property
    def kv_cache_dtype(self) -> str:
        """The dtype attention caches store keys and values in."""
        return self.kv_dtype or self.cache_dtype

    # -- memory ------------------------------------------------------------------------
    @abc.abstractmethod
    def asarray(self, host: np.ndarray, dtype: str = "float32") -> Array:
        """A host (numpy) array as the backend's array of ``dtype``."""

    @abc.abstractmethod
    def zeros(self, shape: tuple[int, ...], dtype: str = "float32") -> Array:
        """A new array of zeros."""

    def to_host(self, x: Array) -> np.ndarray:
        """The array's values as a numpy array: a synchronisation point, counted."""
        self.host_syncs += 1
        return self._to_host(x)

    @abc.abstractmethod
    def _to_host(self, x: Array) -> np.ndarray:
        """``to_host`` without the counting."""

    def nbytes(self, x: Array) -> int:
        return int(x.nbytes)

    def device_memory(self) -> int | None:
        """Bytes of the backend's own memory (VRAM), or None when its arrays live in host
        RAM. ``plan`` and ``--vram`` defaults use it."""
        return None

    # -- weights -----------------------------------------------------------------------
    def has_kernel(self, kind: str) -> bool:
        """Whether the backend computes with weights of this packed kind ("q8", "q4",
        "mxfp4", "fp8", "bf16", and the checkpoint layouts "q4g32" (compressed-tensors
        int4) and "mxfp4pair" (gpt-oss MXFP4): ``QuantTensor.kind``) without decoding them
        to float32 first. A backend without one gets such weights decoded
        (``colibri_core.formats.reference.dequantize``)."""
        return False

    def keeps_stored(self, kind: str, use: str) -> bool:
        """Whether a weight of this packed kind reaches ``prepare_weight`` packed for this
        use: "linear" (only multiplied through ``linear`` / the experts' products),
        "embedding" (rows looked up by ``embedding``, perhaps also a tied LM head) or
        "array" (read as an array by a block: always float32)."""
        return use == "linear" and self.has_kernel(kind)

    def prepare_weight(self, w, use: str = "linear") -> Weight:
        """The backend's own form of a host weight (float32 numpy array, or ``QuantTensor``
        when ``keeps_stored``), made once: upload, repack or decode. The reference uploads
        float32 arrays and keeps packed weights as they are."""
        from colibri_core.formats.base import QuantTensor

        if isinstance(w, QuantTensor):
            return w
        return self.asarray(w)

    def weight_nbytes(self, kind: str | None, shape: tuple[int, ...], stored_nbytes: int) -> int:
        """Bytes a prepared weight takes in the backend's memory: ``kind`` is its packed kind
        when it reaches ``prepare_weight`` packed, None for a float32 array."""
        if kind is not None:
            return stored_nbytes
        return 4 * int(np.prod(shape, dtype=np.int64))

    def placed(self, packed: bool) -> None:
        """Called once the model's weights are placed; ``packed`` says whether any weight
        is kept in a packed form (so the backend's kernels will do most of the work)."""

    def start_threads(self) -> None:
        """Start the thread pools and buffers the backend's compute takes on first use.
        Called before any weight is loaded (colibri_core/engine/math_libraries.py): a pool
        that starts only once the weights hold the memory may fail in C, ending the
        process. Optional; a backend that starts nothing lazily leaves it alone."""

    def batch_invariant_rows(self, op: str, weights: list) -> int:
        """Up to how many activation rows ``op`` with these (prepared) weights computes
        every row bit for bit as it would that row alone: "linear" (``linear`` /
        ``linears``), "router" (``router_logits`` and the routers built on it:
        ``softmax_top_k``, ``sigmoid_grouped_top_k``, ``scored_top_k``), "experts"
        (``routed_experts``; ``weights``: the experts' ``ExpertWeights``), "attention"
        (``attention`` over a sequence's consecutive query rows, each as a step of its own
        would compute it; ``weights`` empty) or "mla" (absorbed MLA over such rows:
        ``mla_absorb_query``, ``mla_attention``, ``mla_absorb_output``; ``weights``: the
        layer's ``kv_b``). The batched engine feeds a decode step's rows
        through ``op`` at most this many at a time, so a request's tokens never depend on
        what else is in the batch, and verifies drafted positions in one attention call
        only where it may. The default, 1, is always right (BLAS, for one, picks other
        blockings, hence other roundings, for several rows); a backend whose kernels handle
        rows independently says so."""
        return 1

    # -- dense operations --------------------------------------------------------------
    @abc.abstractmethod
    def embedding(self, table: Weight, ids: np.ndarray) -> Array:
        """Rows of ``table`` (a prepared weight) for integer ``ids`` (host int array)."""

    @abc.abstractmethod
    def linear(self, x: Array, weight: Weight, bias: Array | None = None) -> Array:
        """x (T, in) @ weight.T (+ bias): the weight stored (out, in) as in PyTorch
        checkpoints, in its prepared form."""

    def linears(self, x: Array, weights: list, biases: list | None = None) -> list:
        """Several projections of the same x (q, k and v); a backend may fuse them."""
        biases = biases or [None] * len(weights)
        return [self.linear(x, w, b) for w, b in zip(weights, biases)]

    @abc.abstractmethod
    def rms_norm(self, x: Array, weight: Array | None, eps: float) -> Array:
        """x / sqrt(mean(x^2) + eps) * weight over the last axis."""

    @abc.abstractmethod
    def layer_norm(self, x: Array, weight: Array | None, bias: Array | None, eps: float) -> Array:
        """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias
        (biased variance, as torch.nn.LayerNorm)."""

    @abc.abstractmethod
    def rope(self, x: Array, cos: Array, sin: Array, rotary_dim: int) -> Array:
        """Rotate-half RoPE on the first ``rotary_dim`` features of x (T, heads, head_dim);
        cos/sin are (T, rotary_dim)."""

    def rope_interleaved(self, x: Array, cos: Array, sin: Array, rotary_dim: int) -> Array:
        """RoPE on the first ``rotary_dim`` features of x (T, heads, dim) laid out as
        interleaved pairs (x0, x1), (x2, x3), ...; pair i turns by the angle of column i of
        cos/sin (T, rotary_dim, the usual cat(freqs, freqs) tables). The rotated features
        come out de-interleaved (all first members, then all second members), exactly as
        transformers' ``apply_rotary_pos_emb_interleave``."""
        return composites.rope_interleaved(self, x, cos, sin, rotary_dim)

    @abc.abstractmethod
    def attention(self, q: Array, k: Array, v: Array, start: int, scale: float) -> Array:
        """Causal attention. q (T, Hq, D); k, v (Hkv, S, D) hold every cached position,
        the T queries sitting at positions start..start+T-1 of those S; query head h uses
        KV head h // (Hq / Hkv). Returns (T, Hq, Dv)."""

    def sparse_attention(self, q: Array, k: Array, v: Array, start: int, scale: float, selected: Array) -> Array:
        """``attention`` restricted to selected keys: query t sees the key positions in
        ``selected[t]`` (an integer array (T, K) of distinct positions, from ``top_k``; -1
        selects nothing and pads a row of fewer positions) that causality allows."""
        return composites.sparse_attention(self, q, k, v, start, scale, selected)

    @abc.abstractmethod
    def clip(self, x: Array, limit: float) -> Array:
        """Clamp to [-limit, limit]."""

    @abc.abstractmethod
    def silu(self, x: Array) -> Array:
        """x * sigmoid(x), elementwise."""

    @abc.abstractmethod
    def silu_mul(self, gate: Array, up: Array) -> Array:
        """silu(gate) * up."""

    @abc.abstractmethod
    def sigmoid(self, x: Array) -> Array:
        """1 / (1 + exp(-x)), elementwise."""

    @abc.abstractmethod
    def softplus(self, x: Array) -> Array:
        """log(1 + exp(x)) elementwise; x itself above 20 (PyTorch's threshold)."""

    @abc.abstractmethod
    def softmax(self, x: Array) -> Array:
        """Softmax over the last axis."""

    @abc.abstractmethod
    def l2_norm(self, x: Array, eps: float) -> Array:
        """x / sqrt(sum(x^2) + eps) over the last axis."""

    @abc.abstractmethod
    def concat(self, arrays: list, axis: int) -> Array:
        """Arrays joined along ``axis``."""

    @abc.abstractmethod
    def take_rows(self, x: Array, rows: np.ndarray) -> Array:
        """x[rows] for a host integer array ``rows`` (gather along the first axis)."""

    @abc.abstractmethod
    def add_rows(self, out: Array, rows: np.ndarray, y: Array, scale: np.ndarray) -> Array:
        """out[rows] += y * scale[:, None] for distinct host ``rows`` and host float32
        ``scale``; returns the updated array (it may be a new one)."""

    # -- primitives the composites are made of -------------------------------------------
    @abc.abstractmethod
    def exp(self, x: Array) -> Array:
        """e ** x, elementwise."""

    @abc.abstractmethod
    def maximum(self, x: Array, floor: float) -> Array:
        """max(x, floor) elementwise, ``floor`` a Python float (relu is maximum(x, 0.0))."""

    @abc.abstractmethod
    def matmul(self, a: Array, b: Array) -> Array:
        """Batched matrix product: a (..., M, K) @ b (..., K, N) -> (..., M, N), the
        leading axes of a and b equal, or b 2-D (K, N) for every batch of a. Either may be
        a view (a transpose, a slice)."""

    @abc.abstractmethod
    def reduce_sum(self, x: Array) -> Array:
        """The sum over the last axis, kept: (..., N) -> (..., 1)."""

    @abc.abstractmethod
    def reduce_max(self, x: Array) -> Array:
        """The largest value over the last axis, kept: (..., N) -> (..., 1)."""

    def supports(self, op: str) -> bool:
        """Whether the backend computes the composite ``op`` (one of ``COMPOSITE_OPS``)
        with a kernel of its own rather than the composite of its primitives. The
        conformance kit checks every such override against the composite."""
        if op not in COMPOSITE_OPS:
            raise ValueError(f"{op!r} is not a composite op ({', '.join(COMPOSITE_OPS)})")
        return getattr(type(self), op) is not getattr(Backend, op)

    # -- routing -----------------------------------------------------------------------
    def top_k(self, scores: Array, k: int) -> Array:
        """Indices (a backend int64 array (T, k)) of the k largest scores of each row,
        largest first; among equal scores the lower index first. They stay on the
        backend: DSA passes them straight to the attention."""
        scores_host = self.to_host(scores)
        return self.asarray(host.top_k_indices(scores_host, k), "int64")

    def softmax_top_k(self, x: Array, weight: Weight, k: int, renormalise: bool,
                      bias: Array | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The router of most MoE layers: probabilities softmax(x @ weight.T + bias) over
        the experts, the k largest of each row (largest first; of equal ones the lower
        index) and their probabilities, renormalised to sum 1 when asked. Returns host
        arrays, indices (T, k) int64 and weights (T, k) float32: the store needs the ids."""
        return host.softmax_top_k(self.router_logits(x, weight, bias), k, renormalise)

    def router_logits(self, x: Array, weight: Weight, bias: Array | None = None) -> np.ndarray:
        """A router's logits, x @ weight.T (+ bias), as host float32 (T, experts): what
        the routers choose from. A backend that computes them otherwise (each row as
        alone, say) overrides this one method for every router."""
        return self.to_host(self.linear(x, weight, bias)).astype(np.float32, copy=False)

    def sigmoid_grouped_top_k(self, x: Array, weight: Weight, bias: np.ndarray | None, k: int, n_group: int,
                              topk_group: int, renormalise: bool, scaling: float) -> tuple[np.ndarray, np.ndarray]:
        """DeepSeek-V3's ``noaux_tc`` router: scores sigmoid(x @ weight.T); ``bias`` (a host
        float32 array, the e_score_correction_bias) is added for choosing only; experts
        form ``n_group`` groups scored by the sum of their two best biased scores, only
        the ``topk_group`` best groups compete for the k slots; the chosen unbiased
        scores are renormalised (when asked) and multiplied by ``scaling``. Returns host
        (indices, weights) as ``softmax_top_k``."""
        return host.sigmoid_grouped_top_k(self.router_logits(x, weight), bias, k, n_group, topk_group, renormalise,
                                          scaling)

    # -- routed experts ----------------------------------------------------------------
    def swiglu_expert(self, x: Array, gate: Weight, up: Weight, down: Weight) -> Array:
        """down(silu(gate(x)) * up(x)) for one expert's matrices."""
        return self.linear(self.silu_mul(self.linear(x, gate), self.linear(x, up)), down)

    def routed_experts(self, x: Array, indices: np.ndarray, weights: np.ndarray, fetch: Callable, window: int = 8,
                       ready: Callable | None = None) -> Array:
        """Apply the routed SwiGLU experts of one MoE layer.

        ``indices`` and ``weights`` (host arrays, (T, k)) say which experts each token
        uses and with what weight; ``fetch(e)`` returns expert e's prepared matrices
        (``w["gate"]``, ``w["up"]``, ``w["down"]``). Each expert is fetched once for all
        its tokens (batch-union), and outputs are summed in ascending expert order: the
        reduction order may never depend on placement. At most ``window`` fetched experts
        may be held at once beyond the store's own. ``ready(e)``, when given, says whether
        fetching e would answer at once (a backend computing experts in batches computes
        what it holds before waiting for a read)."""
        out = self.zeros(tuple(x.shape), self.activation_dtype)
        for e, rows, scale in host.expert_groups(indices, weights):
            w = fetch(e)
            out = self.add_rows(out, rows, self.swiglu_expert(self.take_rows(x, rows), w["gate"], w["up"], w["down"]), scale)
        return out

    # -- attention with a sliding window and attention sinks (gpt-oss) ----------------
    def windowed_attention(self, q: Array, k: Array, v: Array, start: int, scale: float, window: int | None = None,
                           sinks: Array | None = None) -> Array:
        """``attention`` with two options: ``window`` (query t, at position start + t of the
        S keys, sees only keys s with start + t - window < s <= start + t: the last
        ``window`` positions, itself included) and ``sinks`` (an (Hq,) array: one extra
        logit per query head that takes part in the softmax and adds no value, as
        gpt-oss's learned attention sinks). With both None it is ``attention``. A composite
        (``colibri_core.compute.composites``); a backend may replace it."""
        if window is None and sinks is None:
            return self.attention(q, k, v, start, scale)
        return composites.windowed_attention(self, q, k, v, start, scale, window, sinks)

    # -- routed experts with biases and another gated activation (gpt-oss) -------------
    def gated_activation(self, gate: Array, up: Array, act: "GatedActivation") -> Array:
        """``act`` applied elementwise: g * sigmoid(alpha * g) * (u + up_offset), where
        g = min(gate, limit) and u = clip(up, limit) when ``act.limit`` is set, else
        g = gate and u = up. The plain ``GatedActivation()`` is ``silu_mul``. Other
        activations are a composite; a backend may replace it."""
        if act.plain:
            return self.silu_mul(gate, up)
        return composites.gated_activation(self, gate, up, act)

    def glu_expert(self, x: Array, w, act: "GatedActivation | UngatedActivation") -> Array:
        """One expert of ``routed_glu_experts``: down(act(gate(x) + gate_bias, up(x) +
        up_bias)) + down_bias. ``w`` holds ``gate`` and ``up`` (out, in), or one fused
        ``gate_up`` (2 * inter, in) whose first half of rows is gate and second up (a
        checkpoint's interleaved rows are reordered when the expert is read), and
        ``down``; the biases (``gate_bias``/``up_bias`` or ``gate_up_bias``,
        ``down_bias``) are optional. With an ``UngatedActivation`` the expert has no gate:
        down(act(up(x) + up_bias)) + down_bias (Nemotron-H's squared-ReLU experts), made of
        the primitives."""
        arrays = w.arrays if hasattr(w, "arrays") else w
        if isinstance(act, UngatedActivation):  # no gate: down(act(up(x) + up_bias)) + down_bias
            up = self.linear(x, arrays["up"], arrays.get("up_bias"))
            return self.linear(composites.ungated_activation(self, up, act), arrays["down"], arrays.get("down_bias"))
        if "gate_up" in arrays:
            gu = self.linear(x, arrays["gate_up"], arrays.get("gate_up_bias"))
            half = gu.shape[-1] // 2
            gate, up = gu[:, :half], gu[:, half:]
        else:
            gate = self.linear(x, arrays["gate"], arrays.get("gate_bias"))
            up = self.linear(x, arrays["up"], arrays.get("up_bias"))
        return self.linear(self.gated_activation(gate, up, act), arrays["down"], arrays.get("down_bias"))

    def routed_glu_experts(self, x: Array, indices: np.ndarray, weights: np.ndarray, fetch: Callable,
                           act: "GatedActivation", window: int = 8, ready: Callable | None = None) -> Array:
        """``routed_experts`` for experts computed by ``glu_expert``: biases, a fused
        gate_up, another ``GatedActivation``. Same batch-union fetching, ascending expert
        order of the sum and ``window`` / ``ready`` as ``routed_experts``."""
        out = self.zeros(tuple(x.shape), self.activation_dtype)
        for e, rows, scale in host.expert_groups(indices, weights):
            w = fetch(e)
            out = self.add_rows(out, rows, self.glu_expert(self.take_rows(x, rows), w, act), scale)
        return out

    # -- multi-head latent attention and DSA (DeepSeek V3 / V3.2, Kimi K2, GLM) -------
    def mla_expand(self, q_nope: Array, q_rot: Array, latent: Array, k_rot: Array, kv_b: Array,
                   nope_dim: int, v_dim: int) -> tuple[Array, Array, Array]:
        """Multi-head latent attention, expanded form (prefill). q_nope (T, H, nope_dim) and
        q_rot (T, H, rope_dim) are the query parts; latent (S, rank) and k_rot (S, rope_dim)
        are every cached position. ``kv_b`` (H * (nope_dim + v_dim), rank) expands the
        latent into per-head no-rope keys and values. Returns q (T, H, nope+rope), keys
        (H, S, nope+rope) with k_rot shared by all heads, values (H, S, v_dim): the inputs
        of ``attention`` / ``sparse_attention``."""
        return composites.mla_expand(self, q_nope, q_rot, latent, k_rot, kv_b, nope_dim, v_dim)

    def mla_absorb_query(self, q_nope: Array, kv_b: Array, nope_dim: int, v_dim: int) -> Array:
        """Fold the key up-projection into the query (absorbed MLA): for each head h,
        q_nope[t, h] @ W_uk[h], where W_uk[h] (nope_dim, rank) are head h's key rows of
        ``kv_b``. (T, H, nope_dim) -> (T, H, rank)."""
        return composites.mla_absorb_query(self, q_nope, kv_b, nope_dim, v_dim)

    def mla_attention(self, q_lat: Array, q_rot: Array, latent: Array, k_rot: Array, start: int, scale: float,
                      selected: Array | None = None) -> Array:
        """Causal attention in the latent space (absorbed MLA decode): score(t, h, s) =
        (q_lat[t, h] . latent[s] + q_rot[t, h] . k_rot[s]) * scale, softmax over the
        positions query t sees, output sum_s p * latent[s]. q_lat (T, H, rank), q_rot
        (T, H, rope), latent (S, rank), k_rot (S, rope); the T queries sit at positions
        start..start+T-1. ``selected`` ((T, K) from ``top_k``, or None for all; as in
        ``sparse_attention``, -1 pads) restricts each query to those key positions (DSA);
        causality still applies.
        Returns (T, H, rank)."""
        return composites.mla_attention(self, q_lat, q_rot, latent, k_rot, start, scale, selected)

    def mla_attention_kv(self, q_lat: Array, q_rot: Array, kv: Array, start: int, scale: float,
                         selected: Array | None = None) -> Array:
        """``mla_attention`` over the MLA cache's rows as it keeps them: ``kv`` (S, rank +
        rope), each position's latent then its rotary key (rank = q_lat's last dimension).
        A backend whose attention reads such rows as one key (one KV head: keys the whole
        row, values its latent) overrides this instead of splitting them."""
        rank = q_lat.shape[-1]
        return self.mla_attention(q_lat, q_rot, kv[:, :rank], kv[:, rank:], start, scale, selected)

    def mla_absorb_output(self, o_lat: Array, kv_b: Array, nope_dim: int, v_dim: int) -> Array:
        """Apply the value up-projection after latent attention: for each head h,
        W_uv[h] @ o_lat[t, h], where W_uv[h] (v_dim, rank) are head h's value rows of
        ``kv_b``. (T, H, rank) -> (T, H, v_dim)."""
        return composites.mla_absorb_output(self, o_lat, kv_b, nope_dim, v_dim)

    def dsa_index_scores(self, q: Array, k: Array, weights: Array, scale: float, start: int) -> Array:
        """The DSA lightning indexer's scores: score(t, s) = sum_h weights[t, h] *
        relu(scale * q[t, h] . k[s]), with q (T, Hi, D), cached index keys k (S, D) and
        per-head weights (T, Hi); positions a query cannot see are -inf. Returns (T, S)."""
        return composites.dsa_index_scores(self, q, k, weights, scale, start)

    # -- recurrent (linear-attention) layers -------------------------------------------
    def causal_conv1d(self, x: Array, weight: Array, state: Array) -> tuple[Array, Array]:
        """Depthwise causal convolution over time, without bias or activation.

        x (T, C) are the new positions, weight (C, K) one filter per channel, state (K-1, C)
        the inputs of the K-1 positions before x (zeros at the start of a sequence).
        Returns the output (T, C), out[t, c] = sum_j weight[c, j] * [state; x][t + j, c],
        and the new state: the last K-1 rows of [state; x]."""
        return composites.causal_conv1d(self, x, weight, state)

    def gated_delta_chunked(self, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array,
                            chunk_size: int) -> tuple[Array, Array]:
        """The gated delta rule over T positions, computed chunk by chunk (prefill).

        q, k (T, Hk, Dk) (already normalised and scaled), v (T, Hv, Dv), g (T, Hv) the
        log-decay (<= 0), beta (T, Hv) the write strength, state (Hv, Dk, Dv) the recurrent
        state before the first position. Key head h serves value heads h*r .. h*r+r-1
        (r = Hv / Hk). Per position and value head:
            S = exp(g) * S;  S += k (beta * (v - k^T S))^T;  out = q^T S
        Positions are grouped in chunks of ``chunk_size`` counted from the first of these T
        (the WY/UT form of transformers' torch_chunk_gated_delta_rule); mathematically
        identical to ``gated_delta_step``. Returns out (T, Hv, Dv) and the new state. The
        composite runs the recurrence position by position (equal within rounding); a
        backend replaces it with the chunked form for a fast prefill."""
        return composites.gated_delta_step(self, q, k, v, g, beta, state)

    def gated_delta_step(self, q: Array, k: Array, v: Array, g: Array, beta: Array,
                         state: Array) -> tuple[Array, Array]:
        """The gated delta rule position by position (decode); same arguments, results and
        recurrence as ``gated_delta_chunked`` (transformers' torch_recurrent_gated_delta_rule)."""
        return composites.gated_delta_step(self, q, k, v, g, beta, state)

    def gated_delta_channel_chunked(self, q: Array, k: Array, v: Array, g: Array, beta: Array, state: Array,
                                    chunk_size: int) -> tuple[Array, Array]:
        """The gated delta rule with a decay per key channel (Kimi Delta Attention),
        chunk by chunk (prefill): ``gated_delta_chunked`` with g (T, Hv, Dk) instead of
        (T, Hv). Per position and value head, row d of S (key channel d) decays by
        exp(g[d]):
            S = diag(exp(g)) S;  S += k (beta * (v - k^T S))^T;  out = q^T S
        (transformers' chunk_kimi_delta_attention). With g equal across the Dk channels
        this is ``gated_delta_chunked``. Returns out (T, Hv, Dv) and the new state. A composite
        (``colibri_core.compute.composites``); a backend may replace it."""
        return composites.delta_channel_step(self, q, k, v, g, beta, state)

    def gated_delta_channel_step(self, q: Array, k: Array, v: Array, g: Array, beta: Array,
                                 state: Array) -> tuple[Array, Array]:
        """``gated_delta_channel_chunked`` position by position (decode): same arguments,
        results and recurrence (transformers' recurrent_kimi_delta_attention)."""
        return composites.delta_channel_step(self, q, k, v, g, beta, state)

    # -- manifold hyper-connections (DeepSeek-V4, GLM-5 Next) -------------------------
    def sinkhorn(self, x: Array, iters: int, eps: float) -> Array:
        """Sinkhorn-Knopp normalisation of positive (..., N, N) matrices towards doubly
        stochastic ones, as transformers' mHC does it: columns first (x / (sum over
        axis -2 + eps)), then ``iters - 1`` rounds of rows (axis -1) then columns, the
        ``eps`` added to every sum. A composite (``colibri_core.compute.composites``); a
        backend may replace it."""
        return composites.sinkhorn(self, x, iters, eps)

    # -- DeepSeek-V4: attention over chosen keys, grouped output, scored routers --------
    def masked_attention(self, q: Array, k: Array, v: Array, scale: float, visible: np.ndarray,
                         sinks: Array | None = None) -> Array:
        """Attention where query t sees exactly the keys s with ``visible[t, s]`` (a host
        bool array (T, S); DeepSeek-V4: a sliding window of keys followed by compressed
        entries, visible by the query's position or chosen by its indexer). q (T, Hq, D),
        k, v (Hkv, S, D / Dv) (k and v may be the same array); ``sinks`` as
        ``windowed_attention``'s. Every query must see a key or have a sink. Returns
        (T, Hq, Dv). A composite (``colibri_core.compute.composites``); a backend may replace it."""
        return composites.masked_attention(self, q, k, v, scale, visible, sinks)

    def grouped_linear(self, x: Array, weight: Array, groups: int) -> Array:
        """A block-diagonal projection (DeepSeek-V4's grouped output projection): x (T, G *
        C) split into G groups of C features, group g times rows g * R .. g * R + R - 1 of
        ``weight`` (G * R, C; an "array" weight): (T, G * R). A composite; a backend may
        replace it."""
        return composites.grouped_linear(self, x, weight, groups)

    def scored_top_k(self, x: Array, weight: Weight, bias: np.ndarray | None, k: int, scoring: str, scaling: float,
                     chosen: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """DeepSeek-V4's router: scores f(x @ weight.T) with f ``scoring`` ("sqrtsoftplus":
        sqrt(softplus(.)), or "sigmoid"); the k experts of highest score + ``bias`` (a host
        float32 array, for choosing only), or the given ``chosen`` (host int (T, k): a
        hash-routed layer's experts, looked up from the token ids); their unbiased scores
        divided by their sum (+ 1e-20) and multiplied by ``scaling``. Returns host
        (indices, weights) as ``softmax_top_k``."""
        return host.scored_top_k(self.router_logits(x, weight), bias, k, scoring, scaling, chosen)

    # -- attention with a relative position bias (Inkling) -----------------------------
    def attention_relative_bias(self, q: Array, k: Array, v: Array, start: int, scale: float, rel: Array,
                                table: Array, window: int | None = None) -> Array:
        """``attention`` plus a per-query, per-head bias by distance: q (T, Hq, D), k, v
        (Hkv, S, D / Dv) with the T queries at rows start..start+T-1 of the S keys; the
        bias is bias[t, h] = rel[t, h] @ table, rel (T, Hq, R) mixing the R rows of
        ``table`` (R, E, a prepared "array" weight), one bias per distance 0..E-1. Query t,
        head h, key s at distance d = start + t - s scores scale * q . k + bias[t, h, d]
        (no bias where d >= E); it sees keys with 0 <= d (and d < ``window`` when given:
        the last ``window`` positions, itself included). Returns (T, Hq, Dv). A composite
        (``colibri_core.compute.composites``); a backend may replace it."""
        return composites.attention_relative_bias(self, q, k, v, start, scale, rel, table, window)


@dataclass(frozen=True)
class GatedActivation:
    """The gated activation of an expert (``Backend.gated_activation``): g * sigmoid(alpha
    * g) * (u + up_offset), with g = min(gate, limit) and u = clip(up, limit) when
    ``limit`` is set. ``GatedActivation()`` is SiLU-SwiGLU; gpt-oss's clamped SwiGLU is
    ``GatedActivation(alpha=1.702, limit=swiglu_limit, up_offset=1.0)``."""

    alpha: float = 1.0
    limit: float | None = None
    up_offset: float = 0.0

    @property
    def plain(self) -> bool:
        return self.alpha == 1.0 and self.limit is None and self.up_offset == 0.0


@dataclass(frozen=True)
class UngatedActivation:
    """The activation of an MLP without a gate, down(act(up(x))): "relu2" is the squared
    ReLU, max(u, 0)^2 (Nemotron-H's experts and MLPs). Computed from the primitives
    (``composites.ungated_activation``)."""

    name: str = "relu2"
    plain: ClassVar[bool] = False  # never plain SwiGLU: ``ExpertDecl.glu``

    NAMES: ClassVar[tuple[str, ...]] = ("relu2",)

    def __post_init__(self):
        if self.name not in self.NAMES:
            raise ValueError(f"ungated activation {self.name!r} is not one of {self.NAMES}")


# -- host-side reference helpers (numpy), shared by the reference implementations -------


# The ops with a default made of the primitives (colibri_core.compute.composites): a
# backend may override them with a fused kernel (``supports``) and need not.
COMPOSITE_OPS = ("rope_interleaved", "sparse_attention", "windowed_attention", "masked_attention",
                 "attention_relative_bias", "mla_expand", "mla_absorb_query", "mla_attention", "mla_attention_kv",
                 "mla_absorb_output", "dsa_index_scores", "grouped_linear", "sinkhorn", "causal_conv1d", "gated_delta_step",
                 "gated_delta_chunked", "gated_delta_channel_step", "gated_delta_channel_chunked", "gated_activation")
