"""The backend conformance kit: every method of the backend contract
(``colibri_core.compute.backend``), checked op by op against the numpy reference
(``colibri_core.compute.reference.ReferenceBackend``) on seeded random inputs.

A backend author subclasses ``BackendConformanceSuite`` in a test module, says how to
make the backend and, where its arithmetic differs from float32 numpy, how close it
promises to be; then runs pytest::

    # tests/test_conformance.py of the colibri-mybackend distribution
    from colibri_core.testing.backend_kit import BackendConformanceSuite
    from colibri_mybackend import MyBackend

    class TestMyBackend(BackendConformanceSuite):
        tolerance = 1e-5                                   # float operations
        packed_tolerance = {**BackendConformanceSuite.packed_tolerance, "q4": 3e-2}

        def make_backend(self):
            return MyBackend()

    $ pytest tests/test_conformance.py -q

Every check is one pytest test (``test_linear[q4-70-bias]``, ``test_attention[gqa4-decode]``
...), so a failure names the operation and the inputs. Besides, colibri's own tests run
this suite on every installed backend (``colibri_core.testing.backends``: installing a
backend plugin adds its run; ``COLIBRI_TEST_BACKENDS=cpu,mlx`` restricts the list).

What is checked: memory (``asarray`` / ``zeros`` dtypes, the ``to_host`` round trip,
``host_syncs`` counted by ``to_host``); the array protocol the core relies on (shape,
reshape, transpose, basic indexing, assignment into a basic slice, arithmetic with
backend arrays and Python numbers); embedding; linear / linears with biases for 1, 3 and
70 rows (the CPU kernels change strategy past 64) and weights of every packed kind
handed over as the core hands them (``prepare_weight`` of the stored ``QuantTensor``
when ``keeps_stored``, else of its float32 decode), against ``x @ dequantize(w).T``;
norms; both RoPE layouts with a partial rotary part; attention with 1, 2 and 4 query
heads per KV head, prefill and decode; windowed attention (a sliding window, sink logits,
and both reducing to attention); the clamped gated activation and the routed GLU experts
(biases, split / fused gate_up); attention with a relative bias by distance
(shorter than the keys, optionally windowed; with a zero bias it is attention); sparse and latent (MLA) attention with DSA
selections that causality partly masks; the MLA expansion and absorption and the
identity that both forms attend alike; the DSA indexer's scores; top-k and both routers
(ties go to the lower index); one expert and the routed experts of a layer (each expert
fetched once, in ascending order; ``window`` and ``ready`` honoured and without effect
on the result); the elementwise and row operations; the causal convolution and the
gated delta rule, chunked and stepwise, with their carried state, and its per-key-channel
decay form (Kimi Delta Attention), which must reduce to the scalar one when the decay
is equal across channels.

And the batched engine (``colibri_core.engine.scheduler``) computing with the backend on
whole tiny models (``colibri_core.testing.tiny_models``: OLMoE, MLA, DSA, Gated DeltaNet
and a packed int4 / int8 model; each skipped with its reason where its family or
transformers is not installed), loaded on the test's thread and run on the engine's own
(``test_engine_*``): batched requests get the tokens they get alone, which are
``Model.generate``'s; a batched decode step gives each row the bits of a one-row step;
prefix reuse gives a cold prefill's tokens; a cancelled request frees its slot.

Tolerances, declared by the subclass as class attributes:

- ``tolerance``: float operations. A result passes when its largest difference from the
  reference is at most ``tolerance`` x the reference's largest magnitude (infinities
  must match exactly). The default, 1e-5, suits float32 arithmetic in another order
  (BLAS, SIMD, a GPU); a backend computing in bfloat16 needs about 1e-2.
- ``packed_tolerance``: the same, per packed kind, for products with packed weights
  (linear, linears, embedding, experts). The defaults allow what the CPU kernels do:
  int8 activations for int4 and int8 weights (q4 2e-2, q8 1e-4; measured 1.2e-2 and
  2.7e-5; q4g32, compressed-tensors int4 in 32-input groups, 3e-2: measured 2.3e-2 on
  the routed experts check), exact decodes with float32 products for mxfp4, mxfp4pair,
  fp8 and bf16 (1e-5; measured 6e-7).

A backend whose activations are float16 or bfloat16 (``activation_dtype``) is held to at
least 2e-3 or 2e-2 whatever it declares. Integer results (indices, routing choices) must
be identical.
"""

from __future__ import annotations

import copy
import weakref
import zlib

import numpy as np
import pytest

import colibri_core
from colibri_core.engine import generation
from colibri_core.compute.backend import COMPOSITE_OPS, Array, Backend, GatedActivation, UngatedActivation
from colibri_core.engine.batching import RowInvariantOps
from colibri_core.compute.reference import ReferenceBackend
from colibri_core.engine.sampling import SamplingParams
from colibri_core.engine.scheduler import Request, Scheduler
from colibri_core.experts.tiers import DeviceTier, ExpertWeights
from colibri_core.formats.base import QuantTensor, bf16_to_f32, f32_to_bf16
from colibri_core.formats.fp8 import E4M3_TO_F32
from colibri_core.formats.integer import MXFP4, Int4GS64, Int8Row, nibble_codes
from colibri_core.formats.reference import dequantize
from colibri_core.io.container import SCALES_SUFFIX
from colibri_core.nn.rope import build_rope
from colibri_core.plugins.registry import import_object
from colibri_core.testing import tiny_models

PACKED_KINDS = ("q8", "q4", "mxfp4", "fp8", "bf16", "q4g32", "mxfp4pair")
WEIGHT_KINDS = ("f32",) + PACKED_KINDS  # "f32": a float32 array, never packed
ROWS = (1, 3, 70)  # one token, a few, and past the CPU kernels' switch to BLAS at 64
FP8_BLOCK = (32, 64)  # small blocks, so the test weights have several, some partial
# the least a backend whose activations are of this dtype can promise (its inputs alone are
# rounded to 2^-11 / 2^-8 of their magnitude)
DTYPE_TOLERANCE = {"float32": 0.0, "float16": 2e-3, "bfloat16": 2e-2}
# (T new positions, start): prefill from 0, one decoded token, a chunk after a prefix
STEPS = {"prefill": (6, 0), "decode": (1, 9), "chunk": (4, 5)}


# -- input builders ----------------------------------------------------------------------
def seeded(*key) -> np.random.Generator:
    """A generator seeded by the check's parameters: every run sees the same inputs."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def normal(rng: np.random.Generator, *shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def pack(kind: str, w: np.ndarray) -> QuantTensor:
    """A float32 (rows, cols) weight in packed form ``kind``, as the formats store it."""
    n, k = w.shape
    if kind == "bf16":
        return QuantTensor("bf16", f32_to_bf16(w), None, (n, k))
    if kind == "fp8":
        return _fp8_blocks(w, FP8_BLOCK)
    if kind in ("q4g32", "mxfp4pair"):
        return _pair_packed(kind, w)
    fmt = {"q8": Int8Row, "q4": Int4GS64, "mxfp4": MXFP4}[kind]()
    tensors = fmt.encode("w", w)
    return QuantTensor(fmt.kernel, tensors["w"][1], tensors["w" + SCALES_SUFFIX][1], (n, k))


def _pair_packed(kind: str, w: np.ndarray) -> QuantTensor:
    """The checkpoint layouts with 32-input groups whose byte j holds inputs 2j (low
    nibble) and 2j + 1 (high): q4g32 (compressed-tensors int4, (code - 8) * bfloat16
    scale) and mxfp4pair (gpt-oss MXFP4), codes chosen as colibri's encoders choose them."""
    n, k = w.shape
    g = -(-k // 32)
    if kind == "mxfp4pair":
        tensors = MXFP4().encode("w", w)
        codes, scales = nibble_codes(tensors["w"][1], g, 32), tensors["w" + SCALES_SUFFIX][1]
    else:
        padded = np.zeros((n, g * 32), dtype=np.float32)
        padded[:, :k] = w
        groups = padded.reshape(n, g, 32)
        extreme = np.take_along_axis(groups, np.abs(groups).argmax(axis=-1)[..., None], axis=-1)[..., 0]
        scales = f32_to_bf16((extreme / -8.0).astype(np.float32))
        s = bf16_to_f32(scales)[..., None]
        codes = np.where(s != 0, np.clip(np.rint(groups / np.where(s != 0, s, 1)) + 8, 0, 15), 8).astype(np.uint8)
    data = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8).reshape(n, g * 16)
    return QuantTensor(kind, data, scales, (n, k))


def _fp8_blocks(w: np.ndarray, block: tuple[int, int]) -> QuantTensor:
    """e4m3 codes nearest to w / scale, one float32 scale per block (absmax -> 448)."""
    n, k = w.shape
    bm, bn = block
    r, c = -(-n // bm), -(-k // bn)
    padded = np.zeros((r * bm, c * bn), dtype=np.float32)
    padded[:n, :k] = w
    amax = np.abs(padded.reshape(r, bm, c, bn)).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / 448, 1).astype(np.float32)
    scaled = w / np.repeat(np.repeat(scale, bm, axis=0), bn, axis=1)[:n, :k]
    table = np.where(np.isnan(E4M3_TO_F32), np.inf, E4M3_TO_F32)  # never pick a NaN code
    codes = np.abs(scaled[..., None] - table).argmin(axis=-1).astype(np.uint8)
    return QuantTensor("fp8", codes, scale, (n, k), block)


def host_form(backend: Backend, w, use: str):
    """A host weight as the core hands it to ``prepare_weight``: packed only when the
    backend keeps this kind packed for this use, else its float32 decode."""
    if isinstance(w, QuantTensor) and not backend.keeps_stored(w.kind, use):
        return dequantize(w)
    return w


def selection(rng: np.random.Generator, t: int, start: int, s: int, k: int) -> np.ndarray:
    """(T, k) distinct key positions per query, some beyond what causality lets it see;
    each query's own position is among them, so every query sees at least one key."""
    rows = []
    for i in range(t):
        others = rng.permutation(np.delete(np.arange(s), start + i))[: k - 1]
        rows.append(rng.permutation(np.append(others, start + i)))
    return np.array(rows, dtype=np.int64)


def padded_selection(rng: np.random.Generator, chosen: np.ndarray) -> np.ndarray:
    """``chosen`` with two -1 entries (padding) in every row, shuffled: the same positions."""
    pad = np.full((chosen.shape[0], 2), -1, dtype=np.int64)
    return np.array([rng.permutation(row) for row in np.concatenate([chosen, pad], axis=1)], dtype=np.int64)


def router_input(rng: np.random.Generator, t: int, hidden: int, n_experts: int, ties: bool):
    """One-hot token rows and a router weight whose columns are the logits: products
    are exact on every backend, so the choice of experts is decided by the rule alone.
    Distinct logits are 0.25 apart; with ``ties`` many are equal."""
    x = np.zeros((t, hidden), dtype=np.float32)
    x[np.arange(t), rng.integers(0, hidden, t)] = 1.0
    if ties:
        columns = [rng.integers(0, 3, n_experts) * 0.5 for _ in range(hidden)]
    else:
        columns = [rng.permutation(n_experts) * 0.25 + 0.1 for _ in range(hidden)]
    return x, np.stack(columns, axis=1).astype(np.float32)


class _Fetcher:
    """``fetch`` for routed_experts: records the order of fetches and how many earlier
    fetched experts the backend still holds at each fetch (a fresh object per fetch, so
    only the backend can keep one alive)."""

    def __init__(self, experts: list[ExpertWeights]):
        self.experts, self.order, self.most_held = experts, [], 0
        self._refs: list[weakref.ref] = []

    def __call__(self, e: int) -> ExpertWeights:
        self.most_held = max(self.most_held, sum(r() is not None for r in self._refs))
        w = ExpertWeights(dict(self.experts[e].arrays), 0)
        self._refs.append(weakref.ref(w))
        self.order.append(e)
        return w



# the kit's tests of composite ops (they take the ``ops`` fixture), and the ops each exercises
COMPOSITE_TESTS = {
    "test_rope": ('rope_interleaved',),
    "test_sparse_attention": ('sparse_attention',),
    "test_attention_relative_bias": ('attention_relative_bias',),
    "test_attention_relative_bias_without_bias_or_window_is_attention": ('attention_relative_bias',),
    "test_windowed_attention": ('windowed_attention',),
    "test_windowed_attention_reduces_to_attention": ('windowed_attention',),
    "test_gated_activation": ('gated_activation',),
    "test_routed_glu_experts": ('gated_activation',),
    "test_mla_expand": ('mla_expand',),
    "test_mla_absorb_query_and_output": ('mla_absorb_query', 'mla_absorb_output'),
    "test_mla_attention": ('mla_attention',),
    "test_mla_attention_kv": ('mla_attention_kv',),
    "test_mla_absorbed_attention_equals_expanded": ('mla_expand', 'mla_absorb_query', 'mla_attention', 'mla_absorb_output'),
    "test_dsa_index_scores": ('dsa_index_scores',),
    "test_sinkhorn": ('sinkhorn',),
    "test_masked_attention": ('masked_attention',),
    "test_grouped_linear": ('grouped_linear',),
    "test_causal_conv1d_carries_its_state": ('causal_conv1d',),
    "test_gated_delta_chunked": ('gated_delta_chunked',),
    "test_gated_delta_step_equals_chunked": ('gated_delta_step', 'gated_delta_chunked'),
    "test_gated_delta_channel_chunked": ('gated_delta_channel_chunked',),
    "test_gated_delta_channel_step_equals_chunked": ('gated_delta_channel_step', 'gated_delta_channel_chunked'),
    "test_gated_delta_channel_with_equal_channels_is_gated_delta": ('gated_delta_channel_chunked', 'gated_delta_chunked', 'gated_delta_channel_step', 'gated_delta_step'),
}

# the composite tests whose attention takes a selection (a sync on the composite path)
SELECTION_TESTS = frozenset({"test_sparse_attention", "test_mla_attention", "test_mla_attention_kv",
                             "test_mla_absorbed_attention_equals_expanded"})


def composed(backend: Backend) -> Backend:
    """A twin of ``backend`` (same device, same primitives) that computes every composite
    op with the composite (``colibri_core.compute.composites``), none of its own kernels."""
    cls = type(backend)
    plain = type(f"Composed{cls.__name__}", (cls,), {op: getattr(Backend, op) for op in COMPOSITE_OPS})
    twin = copy.copy(backend)
    twin.__class__ = plain
    return twin


class BackendConformanceSuite:
    """Subclass it, define ``make_backend`` and, if needed, the tolerances (see the
    module docstring); pytest collects every check."""

    tolerance: float = 1e-5
    packed_tolerance: dict[str, float] = {"q8": 1e-4, "q4": 2e-2, "mxfp4": 1e-5, "fp8": 1e-5, "bf16": 1e-5,
                                          "q4g32": 3e-2, "mxfp4pair": 1e-5}

    def make_backend(self) -> Backend:
        raise NotImplementedError("a BackendConformanceSuite subclass defines make_backend()")

    @pytest.fixture
    def backend(self) -> Backend:
        return self.make_backend()

    ref = ReferenceBackend()

    # -- helpers -------------------------------------------------------------------------
    def tol(self, backend: Backend, kind: str = "f32") -> float:
        declared = self.tolerance if kind == "f32" else self.packed_tolerance[kind]
        return max(declared, DTYPE_TOLERANCE.get(backend.activation_dtype, 0.0))

    @staticmethod
    def assert_close(got, want, tol: float, what: str) -> None:
        """``got`` (host) matches ``want``: same shape; integers identical; floats within
        ``tol`` x the largest magnitude of ``want``, the same infinities."""
        got, want = np.asarray(got), np.asarray(want)
        assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
        if want.dtype.kind in "iub":
            assert got.dtype.kind in "iub", f"{what}: dtype {got.dtype}, expected integers"
            wrong = np.argwhere(got != want)
            assert not wrong.size, (f"{what}: {len(wrong)} of {want.size} differ, first at {tuple(wrong[0])}: "
                                    f"{got[tuple(wrong[0])]} instead of {want[tuple(wrong[0])]}")
            return
        got, want = got.astype(np.float64), want.astype(np.float64)
        finite = np.isfinite(want)
        assert np.array_equal(np.isfinite(got), finite) and np.array_equal(got[~finite], want[~finite]), \
            f"{what}: infinities or NaNs differ from the reference's"
        if not finite.any():
            return
        err = float(np.abs(got[finite] - want[finite]).max())
        scale = float(np.abs(want[finite]).max())
        assert err <= tol * scale, f"{what}: off by {err:.3g}, more than {tol:g} x {scale:.3g} (the reference's magnitude)"

    def check(self, backend: Backend, got, want, what: str, kind: str = "f32") -> None:
        """A backend array against the reference's result."""
        own = type(backend.zeros((1,), "float32"))
        assert isinstance(got, own), f"{what}: a {type(got).__name__}, not the backend's array type {own.__name__}"
        self.assert_close(backend._to_host(got), want, self.tol(backend, kind), what)  # the kit's look: not counted

    @staticmethod
    def act(backend: Backend, x: np.ndarray):
        """Host float32 activations as the backend's."""
        return backend.asarray(x, backend.activation_dtype)

    @staticmethod
    def cached(backend: Backend, x: np.ndarray):
        return backend.asarray(x, backend.cache_dtype)

    def weight(self, backend: Backend, kind: str, shape: tuple[int, int], rng, use: str = "linear"):
        """(the backend's prepared weight, the float32 numbers it stands for)."""
        w = normal(rng, *shape, scale=0.1)
        if kind != "f32":
            packed = pack(kind, w)
            w = dequantize(packed)
            return backend.prepare_weight(host_form(backend, packed, use), use), w
        return backend.prepare_weight(w, use), w

    # The composite ops' tests run twice: on the backend as it is (its fused kernels, where
    # it has them: ``supports``) and on its primitives alone through the composites, so a
    # fused kernel is checked against the composite as both are against the reference.
    # Either way the ops must not cross to the host (the kit's own looks use the uncounted
    # _to_host), except where an attention takes an indexer's selection: the composite
    # brings the selection to the host once to build its mask.
    @pytest.fixture(params=["own", "composite"])
    def ops(self, request, backend):
        name = request.function.__name__
        chosen = backend
        if request.param == "composite":
            if not any(backend.supports(op) for op in COMPOSITE_TESTS[name]):
                pytest.skip(f"{backend.name} computes {', '.join(COMPOSITE_TESTS[name])} with the composites: "
                            "the 'own' run is that run")
            chosen = composed(backend)
        before = chosen.host_syncs
        yield chosen
        if name not in SELECTION_TESTS:
            assert chosen.host_syncs == before, (f"{', '.join(COMPOSITE_TESTS[name])} took {chosen.host_syncs - before} "
                                                 f"host syncs ({request.param}): they must stay on the device")

    # -- primitives --------------------------------------------------------------------------
    def test_exp_and_maximum(self, backend):
        x = normal(seeded("exp"), 5, 7, scale=3.0)
        x[0, :4] = [-100.0, 0.0, 80.0, -0.5]
        self.check(backend, backend.exp(self.act(backend, x)), np.exp(x), "exp")
        self.check(backend, backend.maximum(self.act(backend, x), 0.25), np.maximum(x, np.float32(0.25)), "maximum")

    @pytest.mark.parametrize("shape", [((4, 5), (5, 3)), ((2, 4, 5), (2, 5, 3)), ((2, 3, 4, 5), (2, 3, 5, 6)),
                                       ((2, 4, 5), (5, 3))], ids=["2d", "batched", "two-batch-axes", "shared-b"])
    def test_matmul(self, backend, shape):
        rng = seeded("matmul", str(shape))
        a, b = normal(rng, *shape[0]), normal(rng, *shape[1])
        self.check(backend, backend.matmul(self.act(backend, a), self.act(backend, b)), a @ b, "matmul")

    def test_matmul_of_views(self, backend):
        rng = seeded("matmul views")
        a, b = normal(rng, 4, 3, 6), normal(rng, 3, 5, 6)
        got = backend.matmul(self.act(backend, a).transpose(1, 0, 2), self.act(backend, b).transpose(0, 2, 1)[:, :, 1:])
        self.check(backend, got, a.transpose(1, 0, 2) @ b.transpose(0, 2, 1)[:, :, 1:], "matmul of a transpose and a slice")

    @pytest.mark.parametrize("op", ["reduce_sum", "reduce_max"])
    def test_reductions(self, backend, op):
        x = normal(seeded(op), 3, 4, 70, scale=2.0)
        want = (np.sum if op == "reduce_sum" else np.max)(x, axis=-1, keepdims=True)
        got = getattr(backend, op)(self.act(backend, x))
        assert tuple(got.shape) == (3, 4, 1), f"{op} gave shape {got.shape}"
        self.check(backend, got, want, op)
        self.check(backend, getattr(backend, op)(self.act(backend, x).transpose(0, 2, 1)),
                   (np.sum if op == "reduce_sum" else np.max)(x.transpose(0, 2, 1), axis=-1, keepdims=True),
                   f"{op} of a transpose")

    def test_supports_names_the_composites_the_backend_replaces(self, backend):
        for op in COMPOSITE_OPS:
            assert backend.supports(op) == (getattr(type(backend), op) is not getattr(Backend, op)), op
        with pytest.raises(ValueError):
            backend.supports("linear")

    # -- memory ----------------------------------------------------------------------------
    def test_start_threads_can_run_before_anything_and_twice(self, backend):
        """``start_threads`` runs before any weight is loaded (once per process, but a
        second load may call it again): it must neither fail nor break what follows."""
        assert backend.start_threads() is None
        assert backend.start_threads() is None
        host = np.arange(12, dtype=np.float32).reshape(3, 4)
        assert np.array_equal(backend.to_host(backend.asarray(host)), host)

    @pytest.mark.parametrize("dtype", ["float32", "int64", "int32"])
    def test_asarray_to_host_round_trip(self, backend, dtype):
        rng = seeded("asarray", dtype)
        host = (rng.standard_normal((3, 5, 4)) * 100).astype(dtype)
        x = backend.asarray(host, dtype)
        syncs = backend.host_syncs
        back = backend.to_host(x)
        assert backend.host_syncs == syncs + 1, "to_host must count one host synchronisation"
        assert isinstance(back, np.ndarray) and back.dtype == np.dtype(dtype), f"to_host gave {type(back)} {back.dtype}"
        self.assert_close(back, host, 0.0, f"asarray({dtype}) then to_host")
        zeros = backend.to_host(backend.zeros((2, 3), dtype))
        assert zeros.dtype == np.dtype(dtype), f"zeros({dtype}) came back as {zeros.dtype}"
        self.assert_close(zeros, np.zeros((2, 3), dtype), 0.0, f"zeros({dtype})")

    def test_every_float_dtype_holds_its_values(self, backend):
        assert "float32" in backend.float_dtypes
        host = normal(seeded("float dtypes"), 4, 6)
        for dtype in backend.float_dtypes:
            precision = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}[dtype]
            got = backend.to_host(backend.asarray(host, dtype)).astype(np.float32)
            self.assert_close(got, host, precision, f"asarray({dtype})")
            self.assert_close(backend.to_host(backend.zeros((2, 2), dtype)).astype(np.float32), np.zeros((2, 2)), 0.0,
                              f"zeros({dtype})")

    # -- the array protocol --------------------------------------------------------------------
    def test_arrays_satisfy_the_protocol(self, backend):
        for dtype in ("float32", *backend.float_dtypes, "int32"):
            host = np.ones((2, 3), np.int32 if dtype == "int32" else np.float32)
            for made in (backend.zeros((2, 3), dtype), backend.asarray(host, dtype)):
                assert isinstance(made, Array), f"{type(made).__name__} ({dtype}) lacks the array protocol"
        x = self.act(backend, normal(seeded("protocol"), 2, 3))
        for derived in (x.reshape(3, 2), x.transpose(1, 0), x[:, 1:], x + x, x * 2.0, -x):
            assert isinstance(derived, Array), f"{type(derived).__name__} lacks the array protocol"

    def test_shape_reshape_transpose(self, backend):
        host = normal(seeded("shape"), 4, 6, 5)
        x = self.act(backend, host)
        assert x.shape == (4, 6, 5) and all(type(d) is int for d in x.shape), f"shape {x.shape!r}"
        assert x.ndim == 3
        self.check(backend, x.reshape(24, 5), host.reshape(24, 5), "reshape(24, 5)")
        self.check(backend, x.reshape(4, -1), host.reshape(4, -1), "reshape(4, -1)")
        self.check(backend, x.transpose(1, 0, 2), host.transpose(1, 0, 2), "transpose(1, 0, 2)")
        self.check(backend, x.transpose(2, 0, 1).reshape(5, 24), host.transpose(2, 0, 1).reshape(5, 24),
                   "transpose then reshape")

    @pytest.mark.parametrize("key", [
        pytest.param((1,), id="x[1]"),
        pytest.param((slice(None), slice(2, 5)), id="x[:,2:5]"),
        pytest.param((slice(-1, None),), id="x[-1:]"),
        pytest.param((Ellipsis, 1), id="x[...,1]"),
        pytest.param((None, slice(None), 0), id="x[None,:,0]"),
        pytest.param((slice(1, 3), None, slice(None, None, 2)), id="x[1:3,None,::2]"),
        pytest.param((-1, Ellipsis, slice(1, 2)), id="x[-1,...,1:2]"),
    ])
    def test_basic_indexing(self, backend, key):
        host = normal(seeded("index", key), 4, 6, 5)
        self.check(backend, self.act(backend, host)[key], host[key], f"indexing {key}")

    def test_assignment_into_a_basic_slice(self, backend):
        rng = seeded("assign")
        rows, more = normal(rng, 2, 3, 4), normal(rng, 2, 1, 4)
        cache = backend.zeros((2, 8, 4), backend.cache_dtype)
        cache[:, 2:5] = self.cached(backend, rows)
        cache[:, 5:6] = self.cached(backend, more)
        want = np.zeros((2, 8, 4), dtype=np.float32)
        want[:, 2:5], want[:, 5:6] = rows, more
        self.check(backend, cache, want, "cache[:, a:b] = rows")

    @pytest.mark.parametrize("op", ["+", "-", "*", "/"])
    def test_arithmetic(self, backend, op):
        rng = seeded("arithmetic", op)
        a = normal(rng, 3, 1, 4)
        b = ((rng.random((5, 4)) + 0.5) * rng.choice([-1, 1], (5, 4))).astype(np.float32)  # |b| >= 0.5: safe divisors
        apply = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y, "/": lambda x, y: x / y}[op]
        x, y = self.act(backend, a), self.act(backend, b)
        self.check(backend, apply(x, y), apply(a, b), f"array {op} array (broadcast)")
        self.check(backend, apply(y, 1.5), apply(b, np.float32(1.5)), f"array {op} float")
        self.check(backend, apply(2.5, y), apply(np.float32(2.5), b), f"float {op} array")
        self.check(backend, apply(y, 3), apply(b, np.float32(3)), f"array {op} int")
        self.check(backend, -y, -b, "unary -")

    # -- dense operations ----------------------------------------------------------------------
    @pytest.mark.parametrize("kind", WEIGHT_KINDS)
    def test_embedding(self, backend, kind):
        rng = seeded("embedding", kind)
        table, truth = self.weight(backend, kind, (50, 96), rng, use="embedding")
        ids = np.array([3, 0, 49, 3, 17], dtype=np.int64)
        self.check(backend, backend.embedding(table, ids), truth[ids], f"embedding of {kind} rows", kind)

    # -- what placement and the batched engine rely on ------------------------------------------
    def test_memory_figures_are_consistent(self, backend):
        """``device_memory`` sizes the device tier and ``--vram``; ``unified_memory`` makes
        the device and RAM tiers share one budget; ``weight_nbytes`` is what placement
        counts for a prepared weight."""
        size = backend.device_memory()
        assert size is None or (type(size) is int and size > 0), f"device_memory() gave {size!r}"
        assert isinstance(backend.unified_memory, bool)
        assert not (size is None and backend.unified_memory), "unified memory without a device size"
        w = normal(seeded("weight bytes"), 24, 64)
        prepared = backend.prepare_weight(w, "linear")
        counted = backend.weight_nbytes(None, w.shape, w.nbytes)
        assert type(counted) is int and counted > 0
        if isinstance(prepared, Array):  # an array form: placement's count is its size
            assert counted == backend.nbytes(prepared), f"weight_nbytes {counted} != the prepared array's {backend.nbytes(prepared)}"
        for kind in PACKED_KINDS:
            if backend.keeps_stored(kind, "linear"):
                packed = pack(kind, normal(seeded("weight bytes", kind), 24, 64))
                assert backend.weight_nbytes(kind, (24, 64), packed.nbytes) > 0, kind

    @pytest.mark.parametrize("kind", ["f32", "q4"])
    def test_device_tier_holds_experts_that_compute_as_their_ram_forms(self, backend, kind):
        """The device tier (``--vram``: the backend's ``device_tier`` class, else the core's
        ``DeviceTier``) keeps experts in the backend's memory within its slots, counts
        the bytes it holds, and its forms compute the routed experts bit for bit as the
        RAM tier's forms of the same experts do."""
        if backend.device_memory() is None:
            pytest.skip(f"the {backend.name} backend keeps its arrays in host RAM: it has no device tier")
        if kind != "f32" and not backend.keeps_stored(kind, "linear"):
            pytest.skip(f"the {backend.name} backend computes {kind} experts from float32 forms (the f32 case covers them)")
        rng = seeded("device tier", kind)
        shapes = {"gate": (24, 96), "up": (24, 96), "down": (96, 24)}
        experts = [ExpertWeights({role: pack(kind, normal(rng, *shape)) if kind != "f32" else normal(rng, *shape)
                                  for role, shape in shapes.items()}, 0) for _ in range(3)]
        own = backend.device_tier
        tier_class = DeviceTier if own is None else import_object(own) if isinstance(own, str) else own
        tier = tier_class(1, 2, backend)
        held = [tier.put(0, e, w) for e, w in enumerate(experts)]
        assert [tier.holds(0, e) for e in range(3)] == [False, True, True], "two slots: the first expert is evicted"
        assert tier.resident_bytes == held[1].nbytes + held[2].nbytes > 0, "the tier's count of the bytes it holds"
        x = self.act(backend, normal(rng, 3, 96))
        indices = np.array([[1, 2], [2, 0], [0, 1]], dtype=np.int64)
        weights = rng.random((3, 2)).astype(np.float32)
        in_ram = [w.prepared(backend) for w in experts]
        want = backend.to_host(backend.routed_experts(x, indices, weights, lambda e: in_ram[e]))
        got = backend.to_host(backend.routed_experts(x, indices, weights, lambda e: held[e]))
        assert np.array_equal(got, want), "the device tier's experts compute other bits than the RAM tier's"

    @pytest.mark.parametrize("kind", ["f32", "q8", "q4"])
    def test_batch_invariant_rows_are_bit_identical_to_one_row(self, backend, kind):
        """The batched engine gives ``linear`` up to ``batch_invariant_rows`` rows at once
        and promises each row the bits it gets alone."""
        w, _ = self.weight(backend, kind, (24, 64), seeded("invariant", kind))
        n = backend.batch_invariant_rows("linear", [w])
        assert type(n) is int and n >= 1, f"batch_invariant_rows gave {n!r}"
        rows = min(n, 9)
        x = normal(seeded("invariant rows", kind), rows, 64)
        together = backend.to_host(backend.linear(self.act(backend, x), w))
        for i in range(rows):
            alone = backend.to_host(backend.linear(self.act(backend, x[i : i + 1]), w))
            assert np.array_equal(together[i : i + 1], alone), f"{kind}: row {i} of {rows} differs from the row alone"

    @pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
    @pytest.mark.parametrize("rows", ROWS)
    @pytest.mark.parametrize("kind", WEIGHT_KINDS)
    def test_linear(self, backend, kind, rows, bias):
        rng = seeded("linear", kind, rows, bias)
        w, truth = self.weight(backend, kind, (40, 96), rng)
        x, b = normal(rng, rows, 96), normal(rng, 40) if bias else None
        got = backend.linear(self.act(backend, x), w, None if b is None else self.act(backend, b))
        self.check(backend, got, self.ref.linear(x, truth, b), f"linear {kind} x {rows} rows", kind)

    @pytest.mark.parametrize("rows", ROWS)
    @pytest.mark.parametrize("kind", WEIGHT_KINDS)
    def test_linears(self, backend, kind, rows):
        rng = seeded("linears", kind, rows)
        prepared = [self.weight(backend, kind, (n, 96), rng) for n in (40, 24, 24)]
        x, biases = normal(rng, rows, 96), [normal(rng, 40), None, normal(rng, 24)]
        got = backend.linears(self.act(backend, x), [w for w, _ in prepared],
                              [None if b is None else self.act(backend, b) for b in biases])
        assert len(got) == 3
        for i, (y, (_, truth), b) in enumerate(zip(got, prepared, biases)):
            self.check(backend, y, self.ref.linear(x, truth, b), f"linears {kind} x {rows} rows, projection {i}", kind)

    @pytest.mark.parametrize("rows", (1, 70))
    @pytest.mark.parametrize("with_weight", [False, True], ids=["noweight", "weight"])
    def test_rms_norm(self, backend, with_weight, rows):
        rng = seeded("rms", with_weight, rows)
        x, w = normal(rng, rows, 48, scale=3.0), normal(rng, 48) if with_weight else None
        got = backend.rms_norm(self.act(backend, x), None if w is None else backend.prepare_weight(w, "array"), 1e-6)
        self.check(backend, got, self.ref.rms_norm(x, w, 1e-6), "rms_norm")

    @pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
    @pytest.mark.parametrize("with_weight", [False, True], ids=["noweight", "weight"])
    def test_layer_norm(self, backend, with_weight, with_bias):
        rng = seeded("layer norm", with_weight, with_bias)
        x = normal(rng, 5, 48, scale=3.0) + 1.0
        w, b = (normal(rng, 48) if with_weight else None), (normal(rng, 48) if with_bias else None)
        prepared = [None if p is None else backend.prepare_weight(p, "array") for p in (w, b)]
        self.check(backend, backend.layer_norm(self.act(backend, x), *prepared, 1e-6), self.ref.layer_norm(x, w, b, 1e-6),
                   "layer_norm")

    @pytest.mark.parametrize("step", ["prefill", "decode"])
    @pytest.mark.parametrize("rotary_dim", [16, 8], ids=["full", "partial"])
    @pytest.mark.parametrize("layout", ["rope", "rope_interleaved"])
    def test_rope(self, ops, layout, rotary_dim, step):
        t, start = STEPS[step]
        rng = seeded("rope", layout, rotary_dim, step)
        rope = build_rope({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, rotary_dim)
        cos, sin = rope.cos_sin(np.arange(start, start + t))
        x = normal(rng, t, 3, 16)
        got = getattr(ops, layout)(self.act(ops, x), ops.asarray(cos), ops.asarray(sin), rotary_dim)
        self.check(ops, got, getattr(self.ref, layout)(x, cos, sin, rotary_dim), f"{layout}, rotary_dim {rotary_dim}")

    # -- attention ----------------------------------------------------------------------------
    def _attention_inputs(self, name, group, step, d=16, dv=12, hkv=2):
        t, start = STEPS[step]
        rng = seeded(name, group, step)
        s = start + t
        return rng, t, start, s, normal(rng, t, hkv * group, d), normal(rng, hkv, s, d), normal(rng, hkv, s, dv)

    @pytest.mark.parametrize("step", list(STEPS))
    @pytest.mark.parametrize("group", [1, 2, 4], ids=["mha", "gqa2", "gqa4"])
    def test_attention(self, backend, group, step):
        _, _, start, _, q, k, v = self._attention_inputs("attention", group, step)
        got = backend.attention(self.act(backend, q), self.cached(backend, k), self.cached(backend, v), start, 0.3)
        self.check(backend, got, self.ref.attention(q, k, v, start, 0.3), f"attention, {group} query heads per KV head")

    @pytest.mark.parametrize("group", [1, 4], ids=["mha", "gqa4"])
    def test_attention_rows_claimed_exact_are_each_row_alone(self, backend, group):
        """Where ``batch_invariant_rows("attention", [])`` claims more than one row (a
        verification's drafted positions then go through one call), every query row of a
        call equals that row decoded alone, bit for bit; 1 claims nothing."""
        n = backend.batch_invariant_rows("attention", [])
        assert type(n) is int and n >= 1, f"batch_invariant_rows gave {n!r}"
        t, start = min(n, 5), 7
        rng = seeded("attention rows", group)
        q, k, v = normal(rng, t, 2 * group, 16), normal(rng, 2, start + t, 16), normal(rng, 2, start + t, 12)
        together = backend.to_host(backend.attention(self.act(backend, q), self.cached(backend, k),
                                                     self.cached(backend, v), start, 0.3))
        for i in range(t):
            alone = backend.to_host(backend.attention(self.act(backend, q[i : i + 1]),
                                                      self.cached(backend, k[:, : start + i + 1]),
                                                      self.cached(backend, v[:, : start + i + 1]), start + i, 0.3))
            assert np.array_equal(together[i : i + 1], alone), f"row {i} of {t} differs from the row alone"

    @pytest.mark.parametrize("step", list(STEPS))
    @pytest.mark.parametrize("group", [1, 2, 4], ids=["mha", "gqa2", "gqa4"])
    def test_sparse_attention(self, ops, group, step):
        rng, t, start, s, q, k, v = self._attention_inputs("sparse", group, step)
        chosen = selection(rng, t, start, s, min(4, s))
        got = ops.sparse_attention(self.act(ops, q), self.cached(ops, k), self.cached(ops, v), start, 0.3,
                                       ops.asarray(chosen, "int64"))
        self.check(ops, got, self.ref.sparse_attention(q, k, v, start, 0.3, chosen), "sparse_attention")
        # -1 pads a row of fewer positions: the same attention
        padded = padded_selection(rng, chosen)
        got = ops.sparse_attention(self.act(ops, q), self.cached(ops, k), self.cached(ops, v), start, 0.3,
                                       ops.asarray(padded, "int64"))
        self.check(ops, got, self.ref.sparse_attention(q, k, v, start, 0.3, chosen), "sparse_attention, -1 padding")

    @pytest.mark.parametrize("window", [None, 3], ids=["unwindowed", "window3"])
    @pytest.mark.parametrize("step", list(STEPS))
    @pytest.mark.parametrize("group", [1, 4], ids=["mha", "gqa4"])
    def test_attention_relative_bias(self, ops, group, step, window):
        """A bias per query, head and distance (3 profiles mixed) over fewer distances (5)
        than most of the keys, so that farther keys get none; with and without a window."""
        rng, t, start, _, q, k, v = self._attention_inputs("relative bias", group, step)
        rel, table = normal(rng, t, q.shape[1], 3), normal(rng, 3, 5, scale=2.0)
        got = ops.attention_relative_bias(self.act(ops, q), self.cached(ops, k), self.cached(ops, v),
                                              start, 0.3, self.act(ops, rel), ops.prepare_weight(table, "array"),
                                              window)
        want = self.ref.attention_relative_bias(q, k, v, start, 0.3, rel, table, window)
        self.check(ops, got, want, f"attention_relative_bias, window {window}")

    def test_attention_relative_bias_without_bias_or_window_is_attention(self, ops):
        _, t, start, _, q, k, v = self._attention_inputs("relative bias zero", 2, "chunk")
        rel, zero = normal(seeded("relative bias zero"), t, q.shape[1], 2), np.zeros((2, 3), np.float32)
        got = ops.attention_relative_bias(self.act(ops, q), self.cached(ops, k), self.cached(ops, v),
                                              start, 0.3, self.act(ops, rel), ops.prepare_weight(zero, "array"))
        self.check(ops, got, self.ref.attention(q, k, v, start, 0.3), "attention_relative_bias with a zero bias")

    @pytest.mark.parametrize("sinks", [False, True], ids=["nosinks", "sinks"])
    @pytest.mark.parametrize("window", [None, 3], ids=["unwindowed", "window3"])
    @pytest.mark.parametrize("step", list(STEPS))
    @pytest.mark.parametrize("group", [1, 4], ids=["mha", "gqa4"])
    def test_windowed_attention(self, ops, group, step, window, sinks):
        """A sliding window (3, shorter than most keys) and sink logits per query head
        (large enough to take much of the softmax)."""
        rng, _, start, _, q, k, v = self._attention_inputs("windowed", group, step)
        sink = normal(rng, q.shape[1], scale=2.0) if sinks else None
        got = ops.windowed_attention(self.act(ops, q), self.cached(ops, k), self.cached(ops, v), start, 0.3,
                                         window, None if sink is None else self.act(ops, sink))
        want = self.ref.windowed_attention(q, k, v, start, 0.3, window, sink)
        self.check(ops, got, want, f"windowed_attention, window {window}, sinks {sinks}")

    @pytest.mark.parametrize("step", list(STEPS))
    def test_attention_reads_keys_and_values_in_every_kv_dtype(self, backend, step):
        """Each dtype a backend lists in ``kv_dtypes`` (``--kv-cache``): keys and values of
        that dtype, in ``attention`` and ``windowed_attention`` (sliding layers), give what
        their values in float32 give."""
        for dtype in backend.kv_dtypes:
            _, _, start, _, q, k, v = self._attention_inputs(f"kv {dtype}", 2, step)
            kd, vd = backend.asarray(k, dtype), backend.asarray(v, dtype)
            k32, v32 = (np.asarray(backend.to_host(a), dtype=np.float32) for a in (kd, vd))  # the numbers it holds
            got = backend.attention(self.act(backend, q), kd, vd, start, 0.3)
            self.check(backend, got, self.ref.attention(q, k32, v32, start, 0.3), f"attention, {dtype} keys and values")
            got = backend.windowed_attention(self.act(backend, q), kd, vd, start, 0.3, 3, None)
            want = self.ref.windowed_attention(q, k32, v32, start, 0.3, 3, None)
            self.check(backend, got, want, f"windowed_attention, {dtype} keys and values")

    def test_windowed_attention_reduces_to_attention(self, ops):
        """No sinks and a window covering every key is attention; sinks of -1e30 weigh nothing."""
        _, t, start, s, q, k, v = self._attention_inputs("windowed wide", 2, "chunk")
        want = self.ref.attention(q, k, v, start, 0.3)
        dev = self.act(ops, q), self.cached(ops, k), self.cached(ops, v)
        self.check(ops, ops.windowed_attention(*dev, start, 0.3, s), want, "windowed_attention, window >= keys")
        far = self.act(ops, np.full(q.shape[1], -1e30, np.float32))
        self.check(ops, ops.windowed_attention(*dev, start, 0.3, None, far), want,
                   "windowed_attention, sinks of -1e30")

    # -- routed experts with biases, a fused gate_up and another activation (gpt-oss) ------------
    CLAMPED = GatedActivation(alpha=1.702, limit=1.5, up_offset=1.0)

    def test_gated_activation(self, ops):
        rng = seeded("gated activation")
        gate, up = normal(rng, 9, 40, scale=3.0), normal(rng, 9, 40, scale=3.0)  # many beyond the limit
        got = ops.gated_activation(self.act(ops, gate), self.act(ops, up), self.CLAMPED)
        self.check(ops, got, self.ref.gated_activation(gate, up, self.CLAMPED), "gated_activation (clamped)")
        plain = ops.gated_activation(self.act(ops, gate), self.act(ops, up), GatedActivation())
        self.check(ops, plain, self.ref.silu_mul(gate, up), "gated_activation() against silu_mul")

    def _glu_expert(self, backend, kind, rng, layout, hidden=96, inter=24):
        """(prepared, truth) expert weights of a layout: "split" (gate, up and their biases)
        or "fused" (gate_up, gate rows first)."""
        shapes = {"down": (hidden, inter)}
        if layout == "split":
            shapes.update(gate=(inter, hidden), up=(inter, hidden))
        else:
            shapes.update(gate_up=(2 * inter, hidden))
        mats = {role: self.weight(backend, kind, shape, rng) for role, shape in shapes.items()}
        prepared, truth = {r: m[0] for r, m in mats.items()}, {r: m[1] for r, m in mats.items()}
        for role in [r for r in shapes if r != "down"] + ["down"]:
            bias = normal(rng, shapes[role][0], scale=0.5)
            prepared[f"{role}_bias"], truth[f"{role}_bias"] = backend.prepare_weight(bias, "array"), bias
        return ExpertWeights(prepared, 0), truth

    @pytest.mark.parametrize("layout", ["split", "fused"])
    @pytest.mark.parametrize("tokens", (1, 5))
    @pytest.mark.parametrize("kind", ("f32", "mxfp4"))
    def test_routed_glu_experts(self, ops, kind, tokens, layout):
        rng = seeded("routed glu", kind, tokens, layout)
        n_experts, k = 6, 2
        experts, truths = zip(*(self._glu_expert(ops, kind, rng, layout) for _ in range(n_experts)))
        x = normal(rng, tokens, 96)
        indices = np.argsort(rng.random((tokens, n_experts)), axis=1)[:, :k].astype(np.int64)
        weights = rng.random((tokens, k)).astype(np.float32)
        want = self.ref.routed_glu_experts(x, indices, weights, lambda e: truths[e], self.CLAMPED)
        used = sorted(set(indices.ravel().tolist()))
        for window in (1, 8):
            fetch = _Fetcher(list(experts))
            out = ops.routed_glu_experts(self.act(ops, x), indices, weights, fetch, self.CLAMPED, window)
            label = f"routed_glu_experts {kind}, {layout}, {tokens} tokens, window {window}"
            assert fetch.order == used, f"{label}: fetched {fetch.order}; each expert once, ascending: {used}"
            assert fetch.most_held <= window, f"{label}: held {fetch.most_held} fetched experts at once"
            self.check(ops, out, want, label, kind)

    @pytest.mark.parametrize("tokens", (1, 5))
    @pytest.mark.parametrize("kind", ("f32", "mxfp4"))
    def test_routed_ungated_experts(self, backend, kind, tokens):
        """Experts without a gate (Nemotron-H's): down(max(up(x) + up_bias, 0)^2) + down_bias,
        against numpy, through ``routed_glu_experts`` with an ``UngatedActivation``."""
        rng = seeded("routed ungated", kind, tokens)
        n_experts, k, hidden, inter = 5, 2, 96, 24
        experts, truths = [], []
        for _ in range(n_experts):
            mats = {role: self.weight(backend, kind, shape, rng) for role, shape in (("up", (inter, hidden)),
                                                                                     ("down", (hidden, inter)))}
            biases = {"up_bias": normal(rng, inter, scale=0.5), "down_bias": normal(rng, hidden, scale=0.5)}
            prepared = {**{r: m[0] for r, m in mats.items()}, **{r: backend.prepare_weight(b, "array") for r, b in biases.items()}}
            experts.append(ExpertWeights(prepared, 0))
            truths.append({**{r: m[1] for r, m in mats.items()}, **biases})
        x = normal(rng, tokens, hidden)
        indices = np.argsort(rng.random((tokens, n_experts)), axis=1)[:, :k].astype(np.int64)
        weights = rng.random((tokens, k)).astype(np.float32)
        want = np.zeros_like(x)
        for t in range(tokens):
            for e, wt in zip(indices[t], weights[t]):
                w = truths[e]
                want[t] += wt * (w["down"] @ np.square(np.maximum(w["up"] @ x[t] + w["up_bias"], 0)) + w["down_bias"])
        out = backend.routed_glu_experts(self.act(backend, x), indices, weights, _Fetcher(experts), UngatedActivation())
        self.check(backend, out, want, f"routed ungated experts {kind}, {tokens} tokens", kind)

    # -- MLA and DSA ---------------------------------------------------------------------------
    MLA = dict(h=4, nope=8, rope=4, v=6, rank=16)

    def _mla_inputs(self, backend, name, step):
        t, start = STEPS[step]
        rng = seeded(name, step)
        h, nope, rope, v, rank = (self.MLA[key] for key in ("h", "nope", "rope", "v", "rank"))
        s = start + t
        host = dict(q_nope=normal(rng, t, h, nope), q_rot=normal(rng, t, h, rope), latent=normal(rng, s, rank),
                    k_rot=normal(rng, s, rope), kv_b=normal(rng, h * (nope + v), rank, scale=0.3))
        dev = {name: self.cached(backend, a) if name in ("latent", "k_rot") else self.act(backend, a)
               for name, a in host.items() if name != "kv_b"}
        dev["kv_b"] = backend.prepare_weight(host["kv_b"], "array")
        return rng, t, start, s, host, dev

    @pytest.mark.parametrize("step", list(STEPS))
    def test_mla_expand(self, ops, step):
        _, _, _, _, host, dev = self._mla_inputs(ops, "mla expand", step)
        got = ops.mla_expand(dev["q_nope"], dev["q_rot"], dev["latent"], dev["k_rot"], dev["kv_b"], self.MLA["nope"],
                                 self.MLA["v"])
        want = self.ref.mla_expand(host["q_nope"], host["q_rot"], host["latent"], host["k_rot"], host["kv_b"],
                                   self.MLA["nope"], self.MLA["v"])
        for name, a, b in zip(("queries", "keys", "values"), got, want):
            self.check(ops, a, b, f"mla_expand {name}")

    @pytest.mark.parametrize("step", list(STEPS))
    def test_mla_absorb_query_and_output(self, ops, step):
        rng, t, _, _, host, dev = self._mla_inputs(ops, "mla absorb", step)
        nope, v = self.MLA["nope"], self.MLA["v"]
        self.check(ops, ops.mla_absorb_query(dev["q_nope"], dev["kv_b"], nope, v),
                   self.ref.mla_absorb_query(host["q_nope"], host["kv_b"], nope, v), "mla_absorb_query")
        o_lat = normal(rng, t, self.MLA["h"], self.MLA["rank"])
        self.check(ops, ops.mla_absorb_output(self.act(ops, o_lat), dev["kv_b"], nope, v),
                   self.ref.mla_absorb_output(o_lat, host["kv_b"], nope, v), "mla_absorb_output")

    @pytest.mark.parametrize("selected", [False, True], ids=["dense", "dsa"])
    @pytest.mark.parametrize("step", list(STEPS))
    def test_mla_attention(self, ops, step, selected):
        rng, t, start, s, host, dev = self._mla_inputs(ops, "mla attention", step)
        chosen = selection(rng, t, start, s, min(3, s)) if selected else None
        q_lat = normal(rng, t, self.MLA["h"], self.MLA["rank"])
        got = ops.mla_attention(self.act(ops, q_lat), dev["q_rot"], dev["latent"], dev["k_rot"], start, 0.2,
                                    None if chosen is None else ops.asarray(chosen, "int64"))
        want = self.ref.mla_attention(q_lat, host["q_rot"], host["latent"], host["k_rot"], start, 0.2, chosen)
        self.check(ops, got, want, "mla_attention")
        if chosen is not None:
            got = ops.mla_attention(self.act(ops, q_lat), dev["q_rot"], dev["latent"], dev["k_rot"], start, 0.2,
                                        ops.asarray(padded_selection(rng, chosen), "int64"))
            self.check(ops, got, want, "mla_attention, -1 padding")

    @pytest.mark.parametrize("selected", [False, True], ids=["dense", "dsa"])
    @pytest.mark.parametrize("step", list(STEPS))
    def test_mla_attention_kv(self, ops, step, selected):
        """The cache's rows as MLA keeps them, [latent | k_rot] side by side in one array,
        read as a slice of a larger one (the cache's capacity)."""
        rng, t, start, s, host, dev = self._mla_inputs(ops, "mla attention kv", step)
        chosen = selection(rng, t, start, s, min(3, s)) if selected else None
        q_lat = normal(rng, t, self.MLA["h"], self.MLA["rank"])
        rows = np.concatenate([host["latent"], host["k_rot"]], 1)
        kv = self.cached(ops, np.concatenate([rows, normal(rng, 3, rows.shape[1])]))[:s]
        got = ops.mla_attention_kv(self.act(ops, q_lat), dev["q_rot"], kv, start, 0.2,
                                   None if chosen is None else ops.asarray(chosen, "int64"))
        want = self.ref.mla_attention(q_lat, host["q_rot"], host["latent"], host["k_rot"], start, 0.2, chosen)
        self.check(ops, got, want, "mla_attention_kv")

    def test_mla_rows_claimed_exact_are_each_row_alone(self, backend):
        """Where ``batch_invariant_rows("mla", [kv_b])`` claims more than one row (a
        verification's drafted positions then go through absorbed MLA at once), each
        query row of the absorbed form equals that row as a step of its own, bit for bit."""
        h, nope, rope, v, rank = (self.MLA[key] for key in ("h", "nope", "rope", "v", "rank"))
        rng = seeded("mla rows")
        kv_b = backend.prepare_weight(normal(rng, h * (nope + v), rank, scale=0.3), "array")
        n = backend.batch_invariant_rows("mla", [kv_b])
        assert type(n) is int and n >= 1, f"batch_invariant_rows gave {n!r}"
        t, start = min(n, 5), 7
        q_nope, q_rot = normal(rng, t, h, nope), normal(rng, t, h, rope)
        kv = self.cached(backend, normal(rng, start + t, rank + rope))

        def absorbed(rows, at):
            q_lat = backend.mla_absorb_query(self.act(backend, q_nope[rows]), kv_b, nope, v)
            o_lat = backend.mla_attention_kv(q_lat, self.act(backend, q_rot[rows]), kv[: at + rows.stop - rows.start], at,
                                             0.2)
            return backend.to_host(backend.mla_absorb_output(o_lat, kv_b, nope, v))

        together = absorbed(slice(0, t), start)
        for i in range(t):
            alone = absorbed(slice(i, i + 1), start + i)
            assert np.array_equal(together[i : i + 1], alone), f"row {i} of {t} differs from the row alone"

    @pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
    @pytest.mark.parametrize("rows", ROWS)
    def test_router_logits(self, backend, rows, bias):
        """The logits every router chooses from: host float32 x @ weight.T (+ bias)."""
        rng = seeded("router_logits", rows, bias)
        x, w, b = normal(rng, rows, 32), normal(rng, 16, 32), normal(rng, 16) if bias else None
        got = backend.router_logits(self.act(backend, x), backend.prepare_weight(w, "array"),
                                    None if b is None else self.act(backend, b))
        assert isinstance(got, np.ndarray) and got.dtype == np.float32, "router logits are host float32"
        self.assert_close(got, self.ref.linear(x, w, b), self.tol(backend), "router_logits")

    @pytest.mark.parametrize("router", ["logits", "softmax", "softmax-bias", "sigmoid-grouped", "scored"])
    def test_router_rows_claimed_exact_are_each_row_alone(self, backend, router):
        """Where ``batch_invariant_rows("router", [w])`` claims more than one row, every
        router gives each row the experts and the bits it gives the row alone."""
        rng = seeded("router rows", router)
        x, w = normal(rng, 6, 32), normal(rng, 16, 32)
        bias = rng.integers(0, 3, 16).astype(np.float32)
        weight = backend.prepare_weight(w, "array")
        n = backend.batch_invariant_rows("router", [weight])
        assert type(n) is int and n >= 1, f"batch_invariant_rows gave {n!r}"
        rows = min(n, 6)

        def route(xs):
            xs = self.act(backend, xs)
            if router == "logits":
                return (backend.router_logits(xs, weight),)
            if router.startswith("softmax"):
                return backend.softmax_top_k(xs, weight, 4, True,
                                             self.act(backend, bias / 8) if router.endswith("bias") else None)
            if router == "sigmoid-grouped":
                return backend.sigmoid_grouped_top_k(xs, weight, bias / 8, 4, 4, 2, True, 2.5)
            return backend.scored_top_k(xs, weight, bias / 8, 4, "sqrtsoftplus", 1.5)

        together = route(x[:rows])
        for i in range(rows):
            alone = route(x[i : i + 1])
            for a, b in zip(together, alone):
                assert np.array_equal(np.asarray(a)[i : i + 1], np.asarray(b)), f"{router}: row {i} of {rows} differs"

    @pytest.mark.parametrize("selected", [False, True], ids=["dense", "dsa"])
    @pytest.mark.parametrize("step", list(STEPS))
    def test_mla_absorbed_attention_equals_expanded(self, ops, step, selected):
        """The two forms of MLA the core switches between compute the same attention."""
        rng, t, start, s, host, dev = self._mla_inputs(ops, "mla forms", step)
        nope, v = self.MLA["nope"], self.MLA["v"]
        chosen = selection(rng, t, start, s, min(3, s)) if selected else None
        sel = None if chosen is None else ops.asarray(chosen, "int64")
        q, keys, values = ops.mla_expand(dev["q_nope"], dev["q_rot"], dev["latent"], dev["k_rot"], dev["kv_b"], nope, v)
        expanded = (ops.attention(q, keys, values, start, 0.2) if sel is None
                    else ops.sparse_attention(q, keys, values, start, 0.2, sel))
        q_lat = ops.mla_absorb_query(dev["q_nope"], dev["kv_b"], nope, v)
        o_lat = ops.mla_attention(q_lat, dev["q_rot"], dev["latent"], dev["k_rot"], start, 0.2, sel)
        absorbed = ops.mla_absorb_output(o_lat, dev["kv_b"], nope, v)
        self.check(ops, absorbed, ops._to_host(expanded), "absorbed MLA against expanded MLA")

    @pytest.mark.parametrize("step", list(STEPS))
    def test_dsa_index_scores(self, ops, step):
        t, start = STEPS[step]
        rng = seeded("dsa", step)
        q, k, w = normal(rng, t, 4, 8), normal(rng, start + t, 8), normal(rng, t, 4)
        got = ops.dsa_index_scores(self.act(ops, q), self.cached(ops, k), self.act(ops, w), 0.35, start)
        self.check(ops, got, self.ref.dsa_index_scores(q, k, w, 0.35, start), "dsa_index_scores")

    # -- routing ---------------------------------------------------------------------------------
    @pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
    def test_top_k(self, backend, ties):
        rng = seeded("top_k", ties)
        scores = (rng.integers(0, 4, (5, 12)) if ties else rng.standard_normal((5, 12))).astype(np.float32)
        scores[0, 7:] = -np.inf  # masked positions (DSA) are never preferred to visible ones
        self.check(backend, backend.top_k(backend.asarray(scores), 5), self.ref.top_k(scores, 5),
                   "top_k indices (largest first, ties to the lower index)")

    @pytest.mark.parametrize("renormalise", [False, True], ids=["raw", "renormalised"])
    @pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
    @pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
    @pytest.mark.parametrize("rows", ROWS)
    def test_softmax_top_k(self, backend, rows, ties, bias, renormalise):
        rng = seeded("softmax_top_k", rows, ties, bias, renormalise)
        x, w = router_input(rng, rows, 16, 12, ties)
        # a bias in steps of 1/16 keeps distinct logits distinct (and equal ones equal when constant)
        b = (np.full(12, 0.25) if ties else rng.permutation(12) / 16 % 0.25).astype(np.float32) if bias else None
        indices, weights = backend.softmax_top_k(self.act(backend, x), backend.prepare_weight(w, "array"), 3, renormalise,
                                                 None if b is None else self.act(backend, b))
        want_indices, want_weights = self.ref.softmax_top_k(x, w, 3, renormalise, b)
        assert isinstance(indices, np.ndarray) and isinstance(weights, np.ndarray), "routers return host arrays"
        self.assert_close(indices, want_indices, 0, "softmax_top_k experts")
        self.assert_close(weights, want_weights, self.tol(backend), "softmax_top_k weights")

    @pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
    @pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
    @pytest.mark.parametrize("groups", [(1, 1), (4, 2)], ids=["ungrouped", "4groups-top2"])
    @pytest.mark.parametrize("rows", (1, 70))
    def test_sigmoid_grouped_top_k(self, backend, rows, groups, ties, bias):
        rng = seeded("sigmoid_grouped_top_k", rows, groups, ties, bias)
        x, w = router_input(rng, rows, 16, 16, ties)
        # whole-number biases keep distinct scores (all within (0, 1)) distinct
        b = rng.integers(0, 3, 16).astype(np.float32) if bias else None
        n_group, topk_group = groups
        got = backend.sigmoid_grouped_top_k(self.act(backend, x), backend.prepare_weight(w, "array"), b, 4, n_group,
                                            topk_group, True, 2.5)
        want = self.ref.sigmoid_grouped_top_k(x, w, b, 4, n_group, topk_group, True, 2.5)
        assert all(isinstance(a, np.ndarray) for a in got), "routers return host arrays"
        self.assert_close(got[0], want[0], 0, "sigmoid_grouped_top_k experts")
        self.assert_close(got[1], want[1], self.tol(backend), "sigmoid_grouped_top_k weights")

    # -- experts --------------------------------------------------------------------------------
    def _expert(self, backend, kind, rng, hidden=96, inter=24):
        mats = {role: self.weight(backend, kind, shape, rng) for role, shape in
                (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)))}
        return ExpertWeights({r: m[0] for r, m in mats.items()}, 0), {r: m[1] for r, m in mats.items()}

    @pytest.mark.parametrize("rows", ROWS)
    @pytest.mark.parametrize("kind", WEIGHT_KINDS)
    def test_swiglu_expert(self, backend, kind, rows):
        rng = seeded("swiglu", kind, rows)
        prepared, truth = self._expert(backend, kind, rng)
        x = normal(rng, rows, 96)
        got = backend.swiglu_expert(self.act(backend, x), prepared["gate"], prepared["up"], prepared["down"])
        self.check(backend, got, self.ref.swiglu_expert(x, truth["gate"], truth["up"], truth["down"]),
                   f"swiglu_expert {kind} x {rows} rows", kind)

    @pytest.mark.parametrize("tokens", ROWS)
    @pytest.mark.parametrize("kind", WEIGHT_KINDS)
    def test_routed_experts(self, backend, kind, tokens):
        rng = seeded("routed", kind, tokens)
        n_experts, k = 8, 2
        experts, truths = zip(*(self._expert(backend, kind, rng) for _ in range(n_experts)))
        x = normal(rng, tokens, 96)
        indices = np.argsort(rng.random((tokens, n_experts)), axis=1)[:, :k].astype(np.int64)
        weights = rng.random((tokens, k)).astype(np.float32)
        want = self.ref.routed_experts(x, indices, weights, lambda e: truths[e])
        used = sorted(set(indices.ravel().tolist()))
        results = []
        for window in (1, 2, 8):
            for ready_name, ready in (("none", None), ("all", lambda e: True), ("some", lambda e: e % 3 != 1)):
                fetch = _Fetcher(list(experts))
                out = backend.to_host(backend.routed_experts(self.act(backend, x), indices, weights, fetch, window, ready))
                label = f"routed_experts {kind}, {tokens} tokens, window {window}, ready {ready_name}"
                assert fetch.order == used, f"{label}: fetched {fetch.order}; each expert once, ascending: {used}"
                assert fetch.most_held <= window, f"{label}: held {fetch.most_held} fetched experts at once"
                self.assert_close(out, want, self.tol(backend, kind), label)
                results.append((label, out))
        for label, out in results[1:]:
            assert np.array_equal(out, results[0][1]), f"{label}: not bit-identical to {results[0][0]}"

    # -- elementwise and row operations -----------------------------------------------------------
    @pytest.mark.parametrize("op", ["silu", "silu_mul", "sigmoid", "softplus", "softmax", "l2_norm", "clip"])
    def test_elementwise(self, backend, op):
        rng = seeded("elementwise", op)
        x, y = normal(rng, 70, 33, scale=4.0), normal(rng, 70, 33)
        x[0, :12] = [-100, -30, -20.5, -1, 0, 1, 19.9, 20, 20.1, 30, 100, 88]  # softplus' threshold, exp's limits
        args = {"silu_mul": (y,), "l2_norm": (1e-6,), "clip": (2.5,)}.get(op, ())
        dev_args = [self.act(backend, a) if isinstance(a, np.ndarray) else a for a in args]
        got = getattr(backend, op)(self.act(backend, x), *dev_args)
        self.check(backend, got, getattr(self.ref, op)(x, *args), op)

    @pytest.mark.parametrize("axis", [0, 1, -1])
    def test_concat(self, backend, axis):
        rng = seeded("concat", axis)
        parts = [normal(rng, 3, 4, 5), normal(rng, 3, 4, 5), normal(rng, 3, 4, 5)]
        got = backend.concat([self.act(backend, p) for p in parts], axis)
        self.check(backend, got, np.concatenate(parts, axis=axis), f"concat on axis {axis}")

    def test_take_rows_and_add_rows(self, backend):
        rng = seeded("rows")
        x, y = normal(rng, 10, 6), normal(rng, 4, 6)
        rows = np.array([7, 2, 2, 9], dtype=np.int64)
        self.check(backend, backend.take_rows(self.act(backend, x), rows), x[rows], "take_rows")
        distinct, scale = np.array([7, 0, 3, 9], dtype=np.int64), rng.random(4).astype(np.float32)
        want = self.ref.add_rows(x.copy(), distinct, y, scale)
        got = backend.add_rows(self.act(backend, x.copy()), distinct, self.act(backend, y), scale)  # may work in place
        self.check(backend, got, want, "add_rows")

    @pytest.mark.parametrize("iters", [1, 3, 20])
    def test_sinkhorn(self, ops, iters):
        """mHC's comb matrices: softmax rows (positive, some near zero) over 2 and 4 streams."""
        rng = seeded("sinkhorn", iters)
        for n in (2, 4):
            x = self.ref.softmax(normal(rng, 7, n, n, scale=3.0)) + np.float32(1e-6)
            got = ops.sinkhorn(self.act(ops, x), iters, 1e-6)
            want = self.ref.sinkhorn(x, iters, 1e-6)
            self.check(ops, got, want, f"sinkhorn {n}x{n}, {iters} iterations")
            # columns are normalised last: they sum to 1 (up to eps)
            self.assert_close(ops._to_host(got).sum(-2), np.ones((7, n), np.float32), 1e-4, "sinkhorn column sums")

    # -- DeepSeek-V4: attention over chosen keys, grouped output, scored routers ----------------
    @pytest.mark.parametrize("sinks", [False, True], ids=["nosinks", "sinks"])
    @pytest.mark.parametrize("step", list(STEPS))
    @pytest.mark.parametrize("group", [1, 4], ids=["mha", "gqa4"])
    def test_masked_attention(self, ops, group, step, sinks):
        """A window's mask is ``windowed_attention``; a random mask (each query seeing at
        least one key) the reference's; k and v may be one array (V4's K = V)."""
        rng, t, start, s, q, k, v = self._attention_inputs("masked", group, step)
        sink = normal(rng, q.shape[1], scale=2.0) if sinks else None
        dev_sink = None if sink is None else self.act(ops, sink)
        pos, keys = start + np.arange(t)[:, None], np.arange(s)[None, :]
        window = (keys <= pos) & (keys > pos - 3)
        got = ops.masked_attention(self.act(ops, q), self.cached(ops, k), self.cached(ops, v), 0.3,
                                       window, dev_sink)
        self.check(ops, got, self.ref.windowed_attention(q, k, v, start, 0.3, 3, sink), "masked_attention, a window")
        mask = rng.random((t, s)) < 0.4
        mask[np.arange(t), rng.integers(0, s, t)] = True
        shared = self.cached(ops, k)
        got = ops.masked_attention(self.act(ops, q), shared, shared, 0.3, mask, dev_sink)
        self.check(ops, got, self.ref.masked_attention(q, k, k, 0.3, mask, sink), "masked_attention, K = V, random mask")

    @pytest.mark.parametrize("rows", (1, 9))
    def test_grouped_linear(self, ops, rows):
        """Each of 4 groups of 6 features times its own 5 rows: block-diagonal."""
        rng = seeded("grouped_linear", rows)
        x, w = normal(rng, rows, 24), normal(rng, 20, 6)
        got = ops.grouped_linear(self.act(ops, x), ops.prepare_weight(w, "array"), 4)
        want = np.concatenate([self.ref.linear(x[:, 6 * g : 6 * g + 6], w[5 * g : 5 * g + 5]) for g in range(4)], axis=1)
        self.check(ops, got, want, "grouped_linear")

    @pytest.mark.parametrize("chosen", [False, True], ids=["topk", "chosen"])
    @pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
    @pytest.mark.parametrize("rows", (1, 70))
    def test_scored_top_k(self, backend, rows, scoring, chosen):
        rng = seeded("scored_top_k", rows, scoring, chosen)
        x, w = router_input(rng, rows, 16, 16, False)
        b = rng.integers(0, 3, 16).astype(np.float32)  # whole numbers: distinct scores stay distinct
        fixed = np.stack([rng.permutation(16)[:4] for _ in range(rows)]) if chosen else None
        got = backend.scored_top_k(self.act(backend, x), backend.prepare_weight(w, "array"), None if chosen else b, 4,
                                   scoring, 1.5, fixed)
        want = self.ref.scored_top_k(x, w, None if chosen else b, 4, scoring, 1.5, fixed)
        assert all(isinstance(a, np.ndarray) for a in got), "routers return host arrays"
        self.assert_close(got[0], want[0], 0, f"scored_top_k {scoring} experts")
        self.assert_close(got[1], want[1], self.tol(backend), f"scored_top_k {scoring} weights")
        self.assert_close(got[1].sum(-1), np.full(rows, 1.5, np.float32), 1e-5, "scored_top_k weights sum to the scaling")
        if chosen:
            self.assert_close(got[0], fixed, 0, "scored_top_k keeps the chosen experts")

    # -- recurrent layers -------------------------------------------------------------------------
    def test_causal_conv1d_carries_its_state(self, ops):
        rng = seeded("conv")
        x, weight = normal(rng, 9, 12), ops.prepare_weight(normal(rng, 12, 4), "array")
        whole, whole_state = self.ref.causal_conv1d(x, ops._to_host(weight), np.zeros((3, 12), np.float32))
        state, outs = ops.zeros((3, 12), "float32"), []
        for a, b in ((0, 5), (5, 6), (6, 9)):  # a prompt, one token, a chunk
            out, state = ops.causal_conv1d(self.act(ops, x[a:b]), weight, state)
            outs.append(ops._to_host(out))
        self.assert_close(np.concatenate(outs), whole, self.tol(ops), "causal_conv1d fed in pieces")
        self.check(ops, state, whole_state, "causal_conv1d state")

    def _delta_inputs(self, backend, rep, name):
        rng = seeded(name, rep)
        t, hk, dk, dv = 12, 2, 8, 6
        hv = hk * rep
        q, k = normal(rng, t, hk, dk), normal(rng, t, hk, dk)
        q, k = q / np.linalg.norm(q, axis=-1, keepdims=True) * dk**-0.5, k / np.linalg.norm(k, axis=-1, keepdims=True)
        host = dict(q=q.astype(np.float32), k=k.astype(np.float32), v=normal(rng, t, hv, dv),
                    g=(-rng.random((t, hv)) * 0.5).astype(np.float32), beta=rng.random((t, hv)).astype(np.float32),
                    state=normal(rng, hv, dk, dv, scale=0.1))
        dev = {n: (backend.asarray(a) if n == "state" else self.act(backend, a)) for n, a in host.items()}
        return host, dev

    def _check_chunked(self, ops, rule, host, dev, chunk):
        """``{rule}_chunked`` in chunks of ``chunk`` against the reference's."""
        chunked = f"{rule}_chunked"
        out, state = getattr(ops, chunked)(*dev.values(), chunk)
        want_out, want_state = getattr(self.ref, chunked)(*host.values(), chunk)
        self.check(ops, out, want_out, f"{chunked} (chunks of {chunk}) output")
        self.check(ops, state, want_state, f"{chunked} (chunks of {chunk}) state")

    def _check_step_equals_chunked(self, ops, rule, host, dev):
        """``{rule}_step`` against the reference's, and ``{rule}_chunked`` against it."""
        step, chunked = f"{rule}_step", f"{rule}_chunked"
        out, state = getattr(ops, step)(*dev.values())
        want_out, want_state = getattr(self.ref, step)(*host.values())
        self.check(ops, out, want_out, f"{step} output")
        self.check(ops, state, want_state, f"{step} state")
        chunked_out, chunked_state = getattr(ops, chunked)(*dev.values(), 5)
        self.check(ops, chunked_out, ops._to_host(out), f"{chunked} against {step}")
        self.check(ops, chunked_state, ops._to_host(state), f"{chunked} state against {step}")

    @pytest.mark.parametrize("rep", [1, 2], ids=["heads", "repeated-key-heads"])
    @pytest.mark.parametrize("chunk", [4, 5, 64])
    def test_gated_delta_chunked(self, ops, chunk, rep):
        self._check_chunked(ops, "gated_delta", *self._delta_inputs(ops, rep, "delta chunked"), chunk)

    @pytest.mark.parametrize("rep", [1, 2], ids=["heads", "repeated-key-heads"])
    def test_gated_delta_step_equals_chunked(self, ops, rep):
        self._check_step_equals_chunked(ops, "gated_delta", *self._delta_inputs(ops, rep, "delta step"))

    def _channel_delta_inputs(self, backend, rep, name):
        """``_delta_inputs`` with a decay per key channel: g (T, Hv, Dk), strong enough that
        channels differ by orders of magnitude over a chunk."""
        host, _ = self._delta_inputs(backend, rep, name)
        rng = seeded(name, rep, "channels")
        t, hv = host["g"].shape
        host["g"] = (-rng.random((t, hv, host["k"].shape[-1])) * 2.0).astype(np.float32)
        dev = {n: (backend.asarray(a) if n == "state" else self.act(backend, a)) for n, a in host.items()}
        return host, dev

    @pytest.mark.parametrize("rep", [1, 2], ids=["heads", "repeated-key-heads"])
    @pytest.mark.parametrize("chunk", [4, 5, 64])
    def test_gated_delta_channel_chunked(self, ops, chunk, rep):
        self._check_chunked(ops, "gated_delta_channel", *self._channel_delta_inputs(ops, rep, "channel delta chunked"),
                            chunk)

    @pytest.mark.parametrize("rep", [1, 2], ids=["heads", "repeated-key-heads"])
    def test_gated_delta_channel_step_equals_chunked(self, ops, rep):
        self._check_step_equals_chunked(ops, "gated_delta_channel",
                                        *self._channel_delta_inputs(ops, rep, "channel delta step"))

    def test_gated_delta_channel_with_equal_channels_is_gated_delta(self, ops):
        """A decay equal across the key channels is the scalar gated delta rule."""
        host, dev = self._delta_inputs(ops, 2, "channel delta scalar")
        dk = host["k"].shape[-1]
        wide = np.ascontiguousarray(np.repeat(host["g"][..., None], dk, axis=-1))
        args = dict(dev, g=self.act(ops, wide))
        for name, got in (("chunked", ops.gated_delta_channel_chunked(*args.values(), 5)),
                          ("step", ops.gated_delta_channel_step(*args.values()))):
            want_out, want_state = self.ref.gated_delta_step(*host.values())
            self.check(ops, got[0], want_out, f"gated_delta_channel_{name} with equal channels output")
            self.check(ops, got[1], want_state, f"gated_delta_channel_{name} with equal channels state")

    # -- the batched engine on whole models --------------------------------------------------
    # colibri's scheduler (colibri_core.engine.scheduler) computing with this backend, on
    # the tiny models of colibri_core.testing.tiny_models. Its steps run on the engine's
    # own thread, not on the thread that made the backend and loaded the model.
    @staticmethod
    def run_requests(sched: Scheduler, requests: list[Request], **kw) -> list:
        handles = [sched.submit(r, **kw) for r in requests]
        for h in handles:
            assert h.wait(120), "the engine did not finish a request within 120 s"
            assert h.finish_reason != "error", f"the engine failed a request: {h.error!r}"
        return handles

    @pytest.mark.parametrize("tiny_model", tiny_models.NAMES)
    def test_engine_tokens_alone_equal_tokens_among_others_and_model_generate(self, backend, tiny_model,
                                                                               tmp_path_factory):
        path = tiny_models.model_dir(tiny_model, tmp_path_factory)
        # the demo streams its experts: a quarter of them fit, as this backend holds them
        ram = tiny_models.DEMO.default_budget(path, backend) if tiny_model == "demo_int4" else None
        with colibri_core.load(path, backend=backend, ram=ram, history=False) as model:
            ps = tiny_models.prompts()
            lengths = [12, 5, 20, 9, 16, 3, 14, 7]  # requests end at different steps: the batch changes
            expected = [model.generate(token_ids=p, max_tokens=n, ignore_eos=True).token_ids
                        for p, n in zip(ps, lengths)]
            # with OpenAI's penalties, bias and logprobs: state of the sequence's own, no other's
            sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=7, frequency_penalty=0.5, presence_penalty=0.3,
                                     logit_bias={3: 2.0}, logprobs=2)
            with Scheduler(model, slots=8) as alone:
                first = self.run_requests(alone, [Request(ps[0], lengths[0])])[0]
                lone_sampled = self.run_requests(alone, [Request(ps[1], 10, sampled)])[0]
            with Scheduler(model, slots=8) as busy:
                handles = self.run_requests(busy, [Request(p, n) for p, n in zip(ps, lengths)]
                                            + [Request(ps[1], 10, sampled)])
                assert busy.stats()["steps"] < sum(lengths), "decode steps did not carry several sequences"
        assert first.token_ids == expected[0], "a request alone: not Model.generate's tokens"
        assert [h.token_ids for h in handles[:8]] == expected, "requests in a batch: not Model.generate's tokens"
        assert handles[8].token_ids == lone_sampled.token_ids and len(lone_sampled.token_ids) == 10, \
            "a sampled request: other tokens in a batch than alone"
        assert handles[8].logprobs == lone_sampled.logprobs and len(lone_sampled.logprobs) == 10, \
            "a sampled request: other logprobs in a batch than alone"
        assert all(h.finish_reason == "length" for h in handles)
        assert handles[0].usage == {"prompt_tokens": len(ps[0]), "completion_tokens": 12, "cached_tokens": 0}

    @pytest.mark.parametrize("tiny_model", tiny_models.NAMES)
    def test_engine_batched_step_gives_each_row_the_bits_of_a_one_row_step(self, backend, tiny_model, tmp_path_factory):
        path = tiny_models.model_dir(tiny_model, tmp_path_factory)
        with colibri_core.load(path, backend=backend, history=False) as model:
            lm, ops = model.lm, model.backend
            alone, batched = [], []
            for p in tiny_models.prompts(8, seed=1):
                for caches in (alone, batched):
                    cache = lm.new_cache(ops)
                    lm.forward(np.asarray(p), cache, ops)
                    caches.append(cache)
            feed = [(np.asarray([t]), c) for t, c in zip(range(10, 18), batched)]
            for step in range(3):  # three decode steps, each sequence at its own position
                rows = lm.forward_batch(feed, RowInvariantOps(ops))
                for i, ((ids, _), cache, row) in enumerate(zip(feed, alone, rows)):
                    one = lm.forward(ids, cache, ops)
                    assert np.array_equal(one, row), f"decode step {step}, row {i}: other logits than the row alone"
                feed = [(np.asarray([int(np.argmax(r))]), c) for r, (_, c) in zip(rows, feed)]

    @pytest.mark.parametrize("tiny_model", tiny_models.NAMES)
    def test_engine_drafts_change_no_token(self, backend, tiny_model, tmp_path_factory):
        """Speculative decoding in the batched engine: sequences verifying drafts (every
        third one wrong) beside sequences without, greedy and sampled: each request's
        tokens and logprobs are those it gets without drafts."""
        from colibri_core.testing.drafts import ScriptedSource

        path = tiny_models.model_dir(tiny_model, tmp_path_factory)
        with colibri_core.load(path, backend=backend, history=False) as model:
            ps, lengths = tiny_models.prompts(6, seed=2), [12, 5, 20, 9, 16, 11]
            sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=7, frequency_penalty=0.5, logprobs=2)
            requests = [Request(p, n, sampled if i % 3 == 2 else SamplingParams()) for i, (p, n) in
                        enumerate(zip(ps, lengths))]
            with Scheduler(model, slots=8) as sched:
                plain = self.run_requests(sched, requests)
            source = ScriptedSource([(r.prompt_ids, h.token_ids) for r, h in zip(requests, plain)], model.lm.vocab_size)
            drafting = [Request(r.prompt_ids, r.max_tokens, r.sampling, draft=source if i % 2 == 0 else None)
                        for i, r in enumerate(requests)]
            with Scheduler(model, slots=8) as sched:
                drafted = self.run_requests(sched, drafting)
                stats = sched.stats()
        for i, (a, b) in enumerate(zip(plain, drafted)):
            assert b.token_ids == a.token_ids, f"request {i}: other tokens with drafts in the batch"
            assert b.logprobs == a.logprobs, f"request {i}: other logprobs with drafts in the batch"
        assert 0 < stats["accepted_tokens"] < stats["drafted_tokens"], stats

    @pytest.mark.parametrize("tiny_model", ["olmoe", "deepseek_v3", "qwen3_next", "demo_int4"])
    def test_engine_prefix_reuse_gives_cold_tokens_and_skips_the_prefix(self, backend, tiny_model, tmp_path_factory,
                                                                         monkeypatch):
        path = tiny_models.model_dir(tiny_model, tmp_path_factory)
        with colibri_core.load(path, backend=backend, history=False) as model:
            first = [(3 + 7 * i) % tiny_models.VOCAB for i in range(13)]
            with Scheduler(model, prefill_chunk=4) as sched:
                turn1 = self.run_requests(sched, [Request(first, 6)])[0]
                second = first + turn1.token_ids + [9, 8, 7]  # the next turn of a chat
                before = sched.stats()["prefill_tokens"]
                turn2 = self.run_requests(sched, [Request(second, 8)])[0]
                # whole chunks of the first prompt (13 -> 12) are reused, the rest is prefilled
                assert turn2.usage["cached_tokens"] == 12
                assert sched.stats()["prefill_tokens"] - before == len(second) - 12
                assert sched.stats()["prefix_hits_tokens"] == 12
                branch = first[:10] + [3, 4, 5, 6]  # shares 10 tokens: reuse stops at the boundary 8
                turn3 = self.run_requests(sched, [Request(branch, 5)])[0]
                assert turn3.usage["cached_tokens"] == 8
            with Scheduler(model, prefill_chunk=4, prefix_reuse=False) as cold:
                cold2, cold3 = self.run_requests(cold, [Request(second, 8), Request(branch, 5)])
                assert cold.stats()["prefix_hits_tokens"] == 0 and cold2.usage["cached_tokens"] == 0
            monkeypatch.setattr(generation, "PREFILL_CHUNK", 4)
            expected = model.generate(token_ids=second, max_tokens=8, ignore_eos=True).token_ids
        assert turn2.token_ids == cold2.token_ids == expected, "a reused prefix: not a cold prefill's tokens"
        assert turn3.token_ids == cold3.token_ids, "a reused prefix: not a cold prefill's tokens"

    @pytest.mark.parametrize("tiny_model", ["olmoe", "deepseek_v3", "qwen3_next"])
    def test_engine_prefix_spilled_to_disk_gives_cold_tokens_after_a_restart(self, backend, tiny_model,
                                                                            tmp_path_factory):
        """``prefix_disk``: a scheduler that stops spills its retained prefixes; another one
        (a restarted server) reads the longest back and prefills only the rest, with the
        tokens of a cold prefill (KV rows, MLA latents, a recurrent state at the boundary)."""
        from colibri_core.engine.prefix_disk import PrefixDisk

        path = tiny_models.model_dir(tiny_model, tmp_path_factory)
        where = tmp_path_factory.mktemp("kv-disk")
        with colibri_core.load(path, backend=backend, history=False) as model:
            first = [(3 + 7 * i) % tiny_models.VOCAB for i in range(13)]
            disk = PrefixDisk(model, 1 << 30, 4, where)
            with Scheduler(model, prefill_chunk=4, prefix_disk=disk) as sched:
                turn1 = self.run_requests(sched, [Request(first, 6)])[0]
            disk.close()
            assert disk.stats()["kv_disk_files"] == 1 and disk.stats()["kv_disk_writes"] == 1
            second = first + turn1.token_ids + [9, 8, 7]
            disk = PrefixDisk(model, 1 << 30, 4, where)
            with Scheduler(model, prefill_chunk=4, prefix_disk=disk) as sched:
                warm = self.run_requests(sched, [Request(second, 8)])[0]
                stats = sched.stats()
            disk.close()
            assert warm.usage["cached_tokens"] == 12 and stats["kv_disk_hit_tokens"] == 12
            assert stats["prefill_tokens"] == len(second) - 12
            with Scheduler(model, prefill_chunk=4, prefix_reuse=False) as cold:
                expected = self.run_requests(cold, [Request(second, 8)])[0]
        assert warm.token_ids == expected.token_ids, "a prefix read back from disk: not a cold prefill's tokens"

    @pytest.mark.parametrize("tiny_model", ["olmoe", "deepseek_v3", "qwen3_next", "demo_int4"])
    def test_engine_continues_a_kept_cache_as_if_never_stopped(self, backend, tiny_model, tmp_path_factory):
        """A chat's next turn continues the cache the previous turn kept (Request.keep_cache,
        start_cache): only the new ids are computed; the kept cache saved to a file and
        bound again continues with the same tokens, in a batch or alone; and what it
        computes is the conversation's (logits within 1e-4 of a cold prefill's)."""
        from colibri_core.engine.sampling import Sampler
        from colibri_core.engine.state import bind, capture, read_state

        path = tiny_models.model_dir(tiny_model, tmp_path_factory)
        ram = tiny_models.DEMO.default_budget(path, backend) if tiny_model == "demo_int4" else None
        tmp = tmp_path_factory.mktemp("kept")
        with colibri_core.load(path, backend=backend, ram=ram, history=False) as model:
            lm, ops = model.lm, model.backend
            first = [(3 + 7 * i) % tiny_models.VOCAB for i in range(13)]
            with Scheduler(model, prefill_chunk=4) as sched:
                turn1 = self.run_requests(sched, [Request(first, 6, keep_cache=True)])[0]
                kept = turn1.kept
                assert kept is not None and kept.token_ids == first + turn1.token_ids  # the last one not fed yet
                assert kept.cache.length == len(first) + 5
                # on the engine's thread, where the cache's arrays were made (MLX binds them to it)
                state = sched.call(lambda: capture(model, kept.cache, kept.token_ids, len(first), SamplingParams(),
                                                   False, Sampler(SamplingParams())))
                state.save(tmp / "turn1.state")
                second = kept.token_ids + [9, 8, 7]  # the next turn: the kept ids, then the new message (4 to feed)
                before = sched.stats()["prefill_tokens"]
                other = Request(tiny_models.prompts(1, seed=5)[0], 7)  # another conversation in the batch
                turn2, _ = self.run_requests(sched, [Request(second, 8, start_cache=kept.cache, keep_cache=True), other])
                assert turn2.usage["cached_tokens"] == len(second) - 4
                assert sched.stats()["prefill_tokens"] - before == 4 + len(other.prompt_ids), "the kept ids were computed again"
                assert turn2.kept is not None and turn2.kept.token_ids[: len(second)] == second
                # a next turn that parts from the kept ids inside turn 2's reply: back to where
                # they part (KV rows forgotten, or a recurrent state's snapshot at the prompt's end)
                kept2 = turn2.kept
                branch = second + [(kept2.token_ids[len(second)] + 1) % tiny_models.VOCAB, 3]
                back = sched.call(lambda: kept2.start(branch))
                assert back is kept2.cache and back.length == len(second)
                branched = sched.call(lambda: lm.forward(np.asarray(branch[len(second):]), back, ops, all_logits=True))
            saved = read_state(tmp / "turn1.state")
            with Scheduler(model, slots=1, prefill_chunk=4) as sched:
                bound = sched.call(lambda: bind(saved, model))
                resumed = self.run_requests(sched, [Request(second, 8, start_cache=bound)])[0]
            assert resumed.token_ids == turn2.token_ids, "a kept cache saved and bound again: other tokens"
            cache = bind(saved, model)
            n = cache.length
            warm = lm.forward(np.asarray(second[n:]), cache, ops, all_logits=True)  # host logits
            cold = model.logits(second)[n:]
            scale = max(1.0, float(np.abs(cold).max()))
            assert np.abs(np.asarray(warm) - cold).max() <= 1e-4 * scale, "a continued cache: not the conversation's logits"
            cold = model.logits(branch)[len(second):]
            assert np.abs(np.asarray(branched) - cold).max() <= 1e-4 * scale, "a cache gone back: not the branch's logits"

    def test_engine_cancel_frees_the_slot_for_the_queued_request(self, backend, tmp_path_factory):
        path = tiny_models.model_dir("demo_int4", tmp_path_factory)  # built without transformers
        with colibri_core.load(path, backend=backend, history=False) as model:
            with Scheduler(model, slots=1, prefix_reuse=False) as sched:
                seen = []

                def on_event(event):
                    seen.append(event)
                    if len(seen) == 3:
                        long.cancel()

                long = sched.submit(Request([5, 6, 7], 100), on_event=on_event)
                queued = sched.submit(Request([8, 9], 4))
                assert queued.wait(60) and long.wait(60)
                assert long.finish_reason == "cancelled", f"finished {long.finish_reason!r}: {long.error!r}"
                assert len(long.token_ids) == 3 and seen[-1] is None
                assert queued.finish_reason == "length" and len(queued.token_ids) == 4, \
                    f"the queued request finished {queued.finish_reason!r}: {queued.error!r}"
                long.cancel()  # idempotent
                stats = sched.stats()
                assert stats["active"] == 0 and stats["kv_reserved_bytes"] == 0 and stats["queue_depth"] == 0
