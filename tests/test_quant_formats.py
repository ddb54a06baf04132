"""Weight formats: encode/decode round trips against a numpy reference, the compiled
kernels against that reference, and packed weights flowing through a whole model."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri_core.compute.cpu import _kernels
from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.io.container import SCALES_SUFFIX
from colibri_core.formats.base import QuantTensor
from colibri_core.formats.fp8 import dequantize as fp8_dequantize, e4m3_to_f32
from colibri_core.formats.integer import E2M1_VALUES, MXFP4, Int4GS64, Int8Row

shapes = st.tuples(st.integers(1, 40), st.integers(1, 300))


def roundtrip(fmt, w):
    tensors = fmt.encode("w", w)
    fmt._shapes = {"w": w.shape}  # what the container stamp tells the format
    raw, scales = tensors["w"][1], tensors["w" + SCALES_SUFFIX][1]
    return fmt.decode(_Info("w"), raw, {"w" + SCALES_SUFFIX: scales}), raw, scales


class _Info:
    def __init__(self, name):
        self.name = name


def reference_int8(w):
    s = np.abs(w).max(axis=1) / 127
    s[s == 0] = 1
    return np.clip(np.rint(w / s[:, None]), -127, 127) * s[:, None]


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_int8_row_matches_its_reference(shape, seed):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 3
    decoded, raw, scales = roundtrip(Int8Row(), w)
    assert raw.dtype == np.int8 and raw.shape == shape and scales.shape == (shape[0],)
    np.testing.assert_allclose(decoded, reference_int8(w), rtol=1e-6, atol=1e-7)
    assert np.all(np.abs(decoded - w) <= np.abs(w).max(axis=1, keepdims=True) / 254 + 1e-6)  # half a step


def reference_int4(w):
    """Per group of 64 (zero-padded): scale = the largest-magnitude value / -8, rounded
    to bfloat16 (by torch, as an independent rounding)."""
    import torch

    n, k = w.shape
    out = np.zeros_like(w)
    for r in range(n):
        for g0 in range(0, k, 64):
            group = w[r, g0 : g0 + 64]
            m = group[np.abs(group).argmax()]
            s = np.float32(torch.tensor(np.float32(m / -8.0)).to(torch.bfloat16).float().item())
            if s == 0:
                continue
            q = np.clip(np.rint(group / s) + 8, 0, 15)
            out[r, g0 : g0 + 64] = (q - 8) * s
    return out


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_int4_gs64_matches_its_reference_including_partial_groups(shape, seed):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    decoded, raw, scales = roundtrip(Int4GS64(), w)
    groups = -(-shape[1] // 64)
    assert raw.shape == (shape[0], groups * 32) and scales.shape == (shape[0], groups) and scales.dtype == np.uint16
    np.testing.assert_allclose(decoded, reference_int4(w), rtol=1e-6, atol=1e-7)


def test_int4_gs64_reads_float32_scales_too():
    """Containers written before the scales became bfloat16 hold float32 ones: the same
    weights decode the same."""
    from colibri_core.formats.base import bf16_to_f32

    w = np.random.default_rng(5).standard_normal((3, 130)).astype(np.float32)
    decoded, raw, scales = roundtrip(Int4GS64(), w)
    again = Int4GS64()
    again._shapes = {"w": w.shape}
    np.testing.assert_array_equal(again.decode(_Info("w"), raw, {"w" + SCALES_SUFFIX: bf16_to_f32(scales)}), decoded)


def reference_mxfp4(w):
    n, k = w.shape
    out = np.zeros_like(w)
    for r in range(n):
        for g0 in range(0, k, 32):
            group = w[r, g0 : g0 + 32]
            amax = np.abs(group).max()
            if amax == 0:
                continue
            x = 2.0 ** (np.floor(np.log2(amax)) - 2)
            mags = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
            nearest = mags[np.abs(np.abs(group / x)[:, None] - mags).argmin(axis=1)]
            out[r, g0 : g0 + 32] = np.sign(group) * nearest * x
    return out


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31))
def test_mxfp4_matches_its_reference(shape, seed):
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05
    decoded, raw, scales = roundtrip(MXFP4(), w)
    assert scales.dtype == np.uint8 and raw.shape == (shape[0], -(-shape[1] // 32) * 16)
    np.testing.assert_allclose(decoded, reference_mxfp4(w), rtol=1e-6, atol=1e-9)
    assert set(np.unique(np.abs(decoded / np.ldexp(1.0, scales.astype(int) - 127).repeat(32, 1)[:, : shape[1]]))) <= set(
        np.abs(E2M1_VALUES).tolist())


def test_quantisation_error_is_what_each_format_promises():
    w = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)
    errors = {fmt.name: np.linalg.norm(roundtrip(fmt, w)[0] - w) / np.linalg.norm(w) for fmt in (Int8Row(), Int4GS64(), MXFP4())}
    assert errors["int8-row"] < 0.01 < errors["int4-gs64"] < 0.12
    assert errors["mxfp4"] < 0.15


# -- kernels against the reference ---------------------------------------------------------
def packed(kind, n, k, rng):
    """A QuantTensor of the kind and its float32 reference weight."""
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
    if kind == "bf16":
        from colibri_core.formats.base import bf16_to_f32, f32_to_bf16

        bits = f32_to_bf16(w)
        return QuantTensor("bf16", bits, None, (n, k)), bf16_to_f32(bits)
    if kind == "fp8":
        codes = rng.integers(0, 0x7F, (n, k), dtype=np.uint8) | (rng.integers(0, 2, (n, k), dtype=np.uint8) << 7)
        scale = rng.random((-(-n // 128), -(-k // 128))).astype(np.float32) + 0.5
        return QuantTensor("fp8", codes, scale, (n, k)), fp8_dequantize(e4m3_to_f32(codes), scale, (128, 128))
    fmt = {"q8": Int8Row(), "q4": Int4GS64(), "q4-f32": Int4GS64(), "mxfp4": MXFP4()}[kind]
    decoded, raw, scales = roundtrip(fmt, w)
    if kind == "q4-f32":  # the float32 scales of containers written before 2026-11-29
        from colibri_core.formats.base import bf16_to_f32

        return QuantTensor("q4", raw, bf16_to_f32(scales), (n, k)), decoded
    return QuantTensor(kind, raw, scales, (n, k)), decoded


KINDS = ["q8", "q4", "q4-f32", "mxfp4", "fp8", "bf16"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40, 65])
@pytest.mark.parametrize("n, k", [(1, 1), (7, 63), (33, 200), (130, 257), (256, 1024)])
def test_kernel_matches_the_reference_within_float32_rounding(kind, rows, n, k):
    rng = np.random.default_rng(n * 1000 + k + rows)
    w, reference = packed(kind, n, k, rng)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    backend = CpuBackend()
    ours = backend.linear(x, w)
    expected = x.astype(np.float64) @ reference.astype(np.float64).T
    # float32 accumulation over k terms: relative error ~ k * 2^-24 of the absolute sum
    bound = 8e-6 * np.sqrt(k) * (np.abs(x) @ np.abs(reference).T) + 1e-30
    if kind in ("q4", "q4-f32", "q8") and rows <= backend._row_limit(w) and _kernels.INT4_INTEGER_PATH:
        # the integer paths quantise activations per 64 inputs, to int8 for int4 weights
        # and to int16 for int8 weights (half a step of 1/127 or 1/32767 of the group's
        # largest value per element)
        groups = -(-k // 64)
        padded = np.zeros((rows, groups * 64), np.float32)
        padded[:, :k] = np.abs(x)
        amax = np.repeat(padded.reshape(rows, groups, 64).max(axis=2), 64, axis=1)[:, :k]  # each input's group's largest
        bound = bound + (amax @ np.abs(reference).T) / (65534 if kind == "q8" else 254)
    assert ours.shape == (rows, n)
    assert np.all(np.abs(ours - expected) <= bound), float(np.abs(ours - expected).max())


@pytest.mark.parametrize("n", [1, 2, 3, 5, 9, 33, 129])
@pytest.mark.parametrize("rows", [1, 3])
def test_int8_kernel_computes_every_weight_row_as_it_would_alone(n, rows):
    """The int8 kernel takes each thread's weight rows from two streams in turn (its
    first and second halves): every row must be computed once, and bit for bit as a
    weight of that one row gives it."""
    rng = np.random.default_rng(n * 10 + rows)
    w, _ = packed("q8", n, 130, rng)
    x = rng.standard_normal((rows, 130)).astype(np.float32)
    backend = CpuBackend()
    together = backend.linear(x, w)
    alone = [backend.linear(x, QuantTensor("q8", w.data[r : r + 1], w.scales[r : r + 1], (1, 130))) for r in range(n)]
    np.testing.assert_array_equal(together, np.concatenate(alone, axis=1))


@pytest.mark.parametrize("kind", ["q4", "q8"])
def test_kernel_scratch_is_reused_without_stale_values(kind):
    """The kernels keep their scratch buffers between calls: a partial last group must
    read as zeros after a larger call filled the same buffer with other values."""
    rng = np.random.default_rng(12)
    small, _ = packed(kind, 5, 70, rng)
    large, _ = packed(kind, 64, 4096, rng)
    x = rng.standard_normal((3, 70)).astype(np.float32)
    backend = CpuBackend()
    before = backend.linear(x, small)
    backend.linear(rng.standard_normal((8, 4096)).astype(np.float32) * 100, large)
    np.testing.assert_array_equal(backend.linear(x, small), before)


def test_kernels_refuse_bad_buffers():
    x = np.ones((1, 64), np.float32)
    out = np.empty((1, 4), np.float32)
    q8 = _kernels.weight("q8", np.zeros((4, 64), np.int8), np.ones(4, np.float32), 4, 64)
    with pytest.raises(ValueError, match="weight holds"):
        _kernels.weight("q4", np.zeros(10, np.uint8), np.ones((4, 1), np.float32), 4, 64)
    with pytest.raises(ValueError, match="scales holds"):
        _kernels.weight("q4", np.zeros(128, np.uint8), np.ones(3, np.float32), 4, 64)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        _kernels.weight("q4", np.zeros(128, np.uint8), np.ones(4, np.float64), 4, 64)
    with pytest.raises(ValueError, match="unknown kernel"):
        _kernels.weight("q3", np.zeros(128, np.uint8), np.ones(4, np.float32), 4, 64)
    with pytest.raises(TypeError, match="weight 0 is not a weight made by"):
        _kernels.matmul(x, ("q8", np.zeros((4, 64), np.int8)), out)
    with pytest.raises(ValueError, match="rows"):  # x is not whole rows of k floats
        _kernels.matmul(np.ones(100, np.float32), q8, np.empty((9, 4), np.float32))
    with pytest.raises(ValueError, match="out"):
        _kernels.matmul(np.ones((3, 64), np.float32), q8, np.empty((2, 4), np.float32))
    with pytest.raises(ValueError, match="weight 1 takes 32 inputs"):
        q8_32 = _kernels.weight("q8", np.zeros((4, 32), np.int8), np.ones(4, np.float32), 4, 32)
        _kernels.linears(x, [q8, q8_32], [out, out])


def test_a_prepared_weight_keeps_its_arrays():
    """The prepared form holds the weight's buffers: dropping every other reference to
    the arrays must not free the memory the kernels read."""
    rng = np.random.default_rng(0)
    w, reference = packed("q8", 16, 64, rng)
    handle = _kernels.weight(w.kind, w.data, w.scales, 16, 64)
    del w
    x = rng.standard_normal((1, 64)).astype(np.float32)
    out = np.empty((1, 16), np.float32)
    _kernels.matmul(x, handle, out)
    np.testing.assert_allclose(out, x @ reference.T, rtol=1e-3, atol=1e-3)


def test_layer_kernel_refuses_bad_routing():
    rng = np.random.default_rng(0)
    gate, _ = packed("q4", 8, 64, rng)
    up, _ = packed("q4", 8, 64, rng)
    down, _ = packed("q4", 64, 8, rng)
    expert = tuple(_kernels.weight(w.kind, w.data, w.scales, *w.shape) for w in (gate, up, down))
    x, out = np.ones((2, 64), np.float32), np.zeros((2, 64), np.float32)
    ones, off = np.ones(2, np.float32), np.array([0, 2], np.int64)
    with pytest.raises(ValueError, match="row 5 is outside"):
        _kernels.moe(x, [expert], np.array([0, 5], np.int32), ones, off, out)
    with pytest.raises(ValueError, match="off must rise"):
        _kernels.moe(x, [expert, expert], np.array([0, 1], np.int32), ones, np.array([0, 2, 1], np.int64), out)
    with pytest.raises(ValueError, match="rows"):  # off says 3 routed rows, 2 given
        _kernels.moe(x, [expert], np.array([0, 1], np.int32), ones, np.array([0, 3], np.int64), out)
    with pytest.raises(ValueError, match="gate and up"):
        _kernels.moe(x, [(expert[0], expert[1], expert[0])], np.array([0, 1], np.int32), ones, off, out)
    with pytest.raises(TypeError, match="expert 0 must be a"):
        _kernels.moe(x, [expert[:2]], np.array([0, 1], np.int32), ones, off, out)


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_linears_equal_one_linear_each(rows):
    """Several weights sharing x in one call give what each gives alone (biases added)."""
    rng = np.random.default_rng(rows)
    weights = [packed(kind, n, 130, rng)[0] for kind, n in (("q4", 40), ("q8", 24), ("mxfp4", 33), ("bf16", 8))]
    biases = [None, rng.standard_normal(24).astype(np.float32), None, None]
    x = rng.standard_normal((rows, 130)).astype(np.float32)
    backend = CpuBackend()
    together = backend.linears(x, weights, biases)
    for w, b, y in zip(weights, biases, together):
        np.testing.assert_array_equal(y, backend.linear(x, w, b))


def test_compiled_rms_norm_matches_numpy():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 3, 96)).astype(np.float32) * 3
    w = rng.standard_normal(96).astype(np.float32)
    numpy_only = CpuBackend(kernels=False)
    for weight in (w, None):
        np.testing.assert_allclose(CpuBackend().rms_norm(x, weight, 1e-6), numpy_only.rms_norm(x, weight, 1e-6),
                                   rtol=2e-6, atol=1e-6)


def test_int4_integer_path_stays_close_to_float_math():
    """The int8 activations of the int4 path cost little next to the int4 weights' own error."""
    rng = np.random.default_rng(11)
    w, reference = packed("q4", 512, 2048, rng)
    x = rng.standard_normal((1, 2048)).astype(np.float32)
    ours, exact = CpuBackend().linear(x, w), x @ reference.T
    cosine = float(np.sum(ours * exact) / (np.linalg.norm(ours) * np.linalg.norm(exact)))
    assert cosine > 0.9999


def test_without_compiled_kernels_weights_are_decoded():
    backend = CpuBackend(kernels=False)
    assert not backend.has_kernel("q4") and CpuBackend().has_kernel("q4")


@pytest.mark.parametrize("kind", ["q8", "q4", "mxfp4", "bf16"])
def test_packed_embeddings_decode_the_rows_looked_up(kind):
    rng = np.random.default_rng(5)
    table, reference = packed(kind, 50, 70, rng)
    backend = CpuBackend()
    assert backend.keeps_stored(kind, "embedding") and not backend.keeps_stored(kind, "array")
    ids = np.array([3, 0, 49, 3])
    np.testing.assert_allclose(backend.embedding(table, ids), reference[ids], rtol=1e-6, atol=1e-7)
    assert not backend.keeps_stored("fp8", "embedding")


@pytest.mark.parametrize("kinds", [("q4", "q4", "q4"), ("q8", "q8", "q8"), ("mxfp4", "q4", "bf16"), ("fp8", "fp8", "fp8")])
@pytest.mark.parametrize("rows", [1, 5])
def test_fused_expert_kernel_equals_three_matmuls(kinds, rows):
    rng = np.random.default_rng(rows)
    hidden, inter = 200, 136
    gate, g_ref = packed(kinds[0], inter, hidden, rng)
    up, u_ref = packed(kinds[1], inter, hidden, rng)
    down, d_ref = packed(kinds[2], hidden, inter, rng)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    backend = CpuBackend()
    fused = backend.swiglu_expert(x, gate, up, down)
    g, u = x.astype(np.float64) @ g_ref.T, x.astype(np.float64) @ u_ref.T
    with np.errstate(over="ignore"):  # exp(-g) overflows to inf for very negative g: silu is then -0
        expected = (g / (1 + np.exp(-g)) * u) @ d_ref.T.astype(np.float64)
    assert fused.shape == (rows, hidden)
    tolerance = 2e-2 if "q4" in kinds and _kernels.INT4_INTEGER_PATH else 2e-4  # int8 activations for int4 weights
    np.testing.assert_allclose(fused, expected, rtol=tolerance, atol=tolerance * np.abs(expected).max())


@pytest.mark.parametrize("kind", ["q4", "q8", "fp8"])
def test_routed_experts_do_not_depend_on_the_batching(kind):
    """One kernel call per batch of experts: the batch size (the store's read window) and
    experts taking too many rows for the kernels (computed apart) leave the sums alone."""
    from colibri_core.experts.tiers import ExpertWeights

    rng = np.random.default_rng(7)
    hidden, inter, n_experts, tokens, k = 96, 40, 6, 20, 3  # ~10 rows per expert: over fp8's 8
    experts, refs = [], []
    for _ in range(n_experts):
        mats = {r: packed(kind, *shape, rng) for r, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                                                              ("down", (hidden, inter)))}
        experts.append(ExpertWeights({r: m[0] for r, m in mats.items()}, 0))
        refs.append({r: m[1].astype(np.float64) for r, m in mats.items()})
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    indices = np.argsort(rng.random((tokens, n_experts)), axis=1)[:, :k]
    weights = rng.random((tokens, k)).astype(np.float32)
    backend = CpuBackend()
    results = [backend.routed_experts(x, indices, weights, experts.__getitem__, window) for window in (1, 2, 8)]
    # experts not yet read split a batch (what is held is computed first)
    results.append(backend.routed_experts(x, indices, weights, experts.__getitem__, 8, lambda e: e % 3 != 1))
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])
    expected = np.zeros((tokens, hidden))
    for t in range(tokens):
        for slot in range(k):
            r = refs[indices[t, slot]]
            g, u = r["gate"] @ x[t], r["up"] @ x[t]
            with np.errstate(over="ignore"):  # silu of a very negative g is -0
                expected[t] += weights[t, slot] * (r["down"] @ (g / (1 + np.exp(-g)) * u))
    tolerance = 2e-2 if kind == "q4" and _kernels.INT4_INTEGER_PATH else 2e-4
    np.testing.assert_allclose(results[0], expected, rtol=tolerance, atol=tolerance * np.abs(expected).max())
    # one token: the decode path
    single = backend.routed_experts(x[:1], indices[:1], weights[:1], experts.__getitem__)
    np.testing.assert_allclose(single, expected[:1], rtol=tolerance, atol=tolerance * np.abs(expected).max())
    # ... which, every expert at hand, is one call; the general path gives the same sums
    general = backend.routed_experts(x[:1], indices[:1], weights[:1], experts.__getitem__, 8, lambda e: True)
    np.testing.assert_array_equal(single, general)


def test_decode_fetches_each_expert_once_when_one_has_no_kernel():
    """An expert the kernels cannot take (float32 arrays) sends decode down the general
    path, without fetching the others twice (the store counts every fetch as a use)."""
    from collections import Counter

    from colibri_core.experts.tiers import ExpertWeights

    rng = np.random.default_rng(8)
    hidden, inter = 64, 32
    experts, refs = [], []
    for e in range(4):
        mats = {r: packed("q4", *shape, rng) for r, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                                                              ("down", (hidden, inter)))}
        refs.append({r: m[1] for r, m in mats.items()})
        experts.append(ExpertWeights({r: (m[1] if e == 2 else m[0]) for r, m in mats.items()}, 0))
    fetched = Counter()

    def fetch(e):
        fetched[e] += 1
        return experts[e]

    x = rng.standard_normal((1, hidden)).astype(np.float32)
    indices, weights = np.array([[3, 2, 0]]), np.array([[0.5, 0.3, 0.2]], np.float32)
    out = CpuBackend().routed_experts(x, indices, weights, fetch)
    assert fetched == {0: 1, 2: 1, 3: 1}
    expected = sum(w * (refs[e]["down"] @ (lambda g, u: g / (1 + np.exp(-g)) * u)(refs[e]["gate"] @ x[0], refs[e]["up"] @ x[0]))
                   for e, w in zip(indices[0], weights[0]))
    np.testing.assert_allclose(out[0], expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


@pytest.mark.parametrize("t, start, hq, hkv", [(1, 0, 4, 4), (1, 9, 8, 2), (5, 0, 6, 3), (3, 4, 4, 1)])
def test_compiled_attention_matches_numpy(t, start, hq, hkv):
    rng = np.random.default_rng(t * 100 + start)
    d, dv, capacity = 16, 12, 64
    s = start + t
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    cache_k = rng.standard_normal((hkv, capacity, d)).astype(np.float32)
    cache_v = rng.standard_normal((hkv, capacity, dv)).astype(np.float32)
    k, v = cache_k[:, :s], cache_v[:, :s]  # views over a longer buffer, as the KV cache hands out
    ours, numpy_only = CpuBackend(), CpuBackend(kernels=False)
    np.testing.assert_allclose(ours.attention(q, k, v, start, 0.3), numpy_only.attention(q, k, v, start, 0.3),
                               rtol=1e-5, atol=1e-6)
    selected = np.stack([rng.choice(s, size=min(3, s), replace=False) for _ in range(t)])
    np.testing.assert_allclose(ours.sparse_attention(q, k, v, start, 0.3, selected),
                               numpy_only.sparse_attention(q, k, v, start, 0.3, selected), rtol=1e-5, atol=1e-6)


def _compiled_attention(q, k, v, start, scale, visible=None):
    out = np.empty((q.shape[0], q.shape[1], v.shape[-1]), np.float32)
    args = (np.ascontiguousarray(q), k, v, start, scale, out)
    _kernels.attention(*(args + ((visible,) if visible is not None else ())))
    return out


@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2), (16, 1), (20, 2), (6, 3)])
@pytest.mark.parametrize("sparse", [False, True])
def test_compiled_attention_rows_are_independent_of_the_block(hq, hkv, sparse):
    rng = np.random.default_rng(hq * 10 + hkv)
    t, start, d, dv, capacity = 13, 5, 32, 24, 64
    s = start + t
    q = rng.standard_normal((t, hq, d)).astype(np.float32) * 2
    cache_k = rng.standard_normal((hkv, capacity, d)).astype(np.float32)
    cache_v = rng.standard_normal((hkv, capacity, dv)).astype(np.float32)
    k, v = cache_k[:, :s], cache_v[:, :s]
    visible = None
    if sparse:
        visible = (rng.random((t, s)) < 0.6).astype(np.uint8)
        visible[3] = 0  # a query with no key: zeros
    together = _compiled_attention(q, k, v, start, 0.2, visible)
    for i in range(t):  # each query alone, as a decode step sees it
        alone = _compiled_attention(q[i : i + 1], k[:, : start + i + 1], v[:, : start + i + 1], start + i, 0.2,
                           None if visible is None else np.ascontiguousarray(visible[i : i + 1, : start + i + 1]))
        assert np.array_equal(alone[0], together[i]), f"query {i} differs alone"
    if sparse:
        assert not together[3].any()


def test_compiled_attention_long_rows_match_numpy():
    rng = np.random.default_rng(7)
    t, start, hq, hkv, d = 9, 300, 8, 2, 64
    s = start + t
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    k = rng.standard_normal((hkv, s, d)).astype(np.float32)
    v = rng.standard_normal((hkv, s, d)).astype(np.float32)
    ours, numpy_only = CpuBackend(), CpuBackend(kernels=False)
    np.testing.assert_allclose(ours.attention(q, k, v, start, 0.125), numpy_only.attention(q, k, v, start, 0.125),
                               rtol=1e-5, atol=1e-6)


def test_compiled_attention_softmax_over_the_exponentials_whole_range():
    """One input per key, so each score is exact and only the exponentials and their sum
    differ from numpy: scores from -120 (underflow) to +80."""
    s = 401
    q = np.ones((1, 1, 1), np.float32)
    k = np.linspace(-120, 80, s, dtype=np.float32).reshape(1, s, 1)
    v = np.random.default_rng(3).standard_normal((1, s, 16)).astype(np.float32)
    for scale in (1.0, 0.1, 0.01):
        ours = CpuBackend().attention(q, k, v, s - 1, scale)
        numpy_only = CpuBackend(kernels=False).attention(q, k, v, s - 1, scale)
        np.testing.assert_allclose(ours, numpy_only, rtol=2e-6, atol=1e-7)


def test_compiled_attention_reads_half_keys_and_values_as_their_floats():
    """A float16 cache (--kv-cache float16) widens exactly: the same outputs, bit for bit,
    as its values in float32 (subnormal and large halves included), on every kernel path."""
    rng = np.random.default_rng(5)
    t, start, hq, hkv, d = 7, 30, 8, 2, 40
    s = start + t
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    k = (rng.standard_normal((hkv, s, d)) * np.where(rng.random((hkv, s, d)) < 0.1, 1e-6, 3)).astype(np.float16)
    v = (rng.standard_normal((hkv, s, d + 8)) * 1e4).astype(np.float16)
    assert (np.abs(k) < 6.1e-5).any() and (np.abs(v) > 1e4).any()  # subnormal and large halves
    half = _compiled_attention(q, k, v, start, 0.2)
    widened = _compiled_attention(q, k.astype(np.float32), v.astype(np.float32), start, 0.2)
    assert np.array_equal(half, widened)


def test_compiled_attention_refuses_mismatched_shapes():
    q = np.zeros((1, 3, 8), np.float32)
    kv = np.zeros((2, 4, 8), np.float32)  # 3 query heads cannot share 2 KV heads
    with pytest.raises(ValueError, match="multiple of Hkv"):
        _kernels.attention(q, kv, kv, 3, 1.0, np.zeros((1, 3, 8), np.float32))
    with pytest.raises(ValueError, match="3-d float32"):
        _kernels.attention(q, kv.astype(np.float64), kv, 3, 1.0, np.zeros((1, 3, 8), np.float32))


@pytest.mark.parametrize("rotary", [8, 16])
def test_compiled_rope_matches_numpy(rotary):
    rng = np.random.default_rng(rotary)
    x = rng.standard_normal((3, 4, 16)).astype(np.float32)
    angles = rng.random((3, rotary // 2)).astype(np.float32) * 6
    cos, sin = np.cos(np.concatenate([angles, angles], -1)), np.sin(np.concatenate([angles, angles], -1))
    np.testing.assert_allclose(CpuBackend().rope(x, cos, sin, rotary), CpuBackend(kernels=False).rope(x, cos, sin, rotary),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t, experts, k, renormalise", [(1, 64, 8, False), (1, 64, 8, True), (3, 60, 4, True), (8, 7, 7, False)])
def test_compiled_router_matches_numpy(t, experts, k, renormalise):
    rng = np.random.default_rng(t * experts + k)
    x = rng.standard_normal((t, 96)).astype(np.float32)
    w = rng.standard_normal((experts, 96)).astype(np.float32) * 0.3
    w[3] = w[2] = x.sum(axis=0) / np.sqrt(t)  # two experts that tie near the top: the lower index comes first
    indices, weights = CpuBackend().softmax_top_k(x, w, k, renormalise)
    for row in indices.tolist():
        assert row.index(2) + 1 == row.index(3)
    want_indices, want_weights = CpuBackend(kernels=False).softmax_top_k(x, w, k, renormalise)
    assert indices.dtype == np.int64 and weights.dtype == np.float32 and indices.shape == (t, k)
    np.testing.assert_array_equal(indices, want_indices)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-5, atol=1e-7)


def test_compiled_router_refuses_bad_shapes():
    x, w = np.ones((1, 16), np.float32), np.ones((4, 16), np.float32)
    out_i, out_w = np.empty((1, 5), np.int64), np.empty((1, 5), np.float32)
    with pytest.raises(ValueError, match="route picks"):
        _kernels.route(x, w, 5, True, out_i, out_w)
    with pytest.raises(ValueError, match="experts, hidden"):
        _kernels.route(x, w.astype(np.float64), 2, True, out_i, out_w)
    with pytest.raises(ValueError, match="rows of 16"):
        _kernels.route(np.ones((1, 8), np.float32), w, 2, True, out_i, out_w)


def test_fp8_kernel_reads_every_byte_as_the_scalar_decoder_does():
    """The vector path (bytes widened through half precision) against the scalar decoder,
    over all 256 byte values: subnormals, both zeros, and the NaN bytes (read as +-480)."""
    codes = np.arange(256, dtype=np.uint8).reshape(1, 256).repeat(3, axis=0)
    codes[1] = codes[1][::-1]
    codes[2] = np.roll(codes[2], 77)
    scales = np.array([[0.5, 2.0]], dtype=np.float32)
    decoded = np.empty((3, 256), np.float32)
    _kernels.dequantize("fp8", codes, scales, decoded, 3, 256, 128, 128)
    assert np.isfinite(decoded).all() and decoded[0, 0x7F] == 480 * 0.5 and decoded[0, 0xFF] == -480 * 2.0 and decoded[0, 0x01] == 2.0 ** -9 * 0.5
    x = np.eye(256, dtype=np.float32)[:8]  # picks single columns: no rounding in the sums
    for rows in (x, np.random.default_rng(0).standard_normal((5, 256)).astype(np.float32)):
        out = np.empty((rows.shape[0], 3), np.float32)
        _kernels.matmul(rows, _kernels.weight("fp8", codes, scales, 3, 256, 128, 128), out)
        np.testing.assert_allclose(out, rows.astype(np.float64) @ decoded.T.astype(np.float64), rtol=1e-5, atol=1e-5)


def _int_path_outputs(path: str) -> dict:
    """matmul outputs of the int8 and int4 kernels in a child process held to
    ``path`` (COLIBRI_KERNEL_PATH; "" for the machine's best), for 1-9 x rows and widths
    with and without a partial last group."""
    import os
    import pickle
    import subprocess
    import sys

    child = r"""
import pickle, sys
import numpy as np
from colibri_core.compute.cpu import _kernels
from colibri_core.formats.integer import Int4GS64, Int8Row
rng = np.random.default_rng(5)
found = {"path": _kernels.INT4_PATH}
for kind, fmt in (("q8", Int8Row()), ("q4", Int4GS64())):
    for k in (64, 130, 2048 + 17):
        (_, data), (_, scales) = fmt.encode("w", rng.standard_normal((37, k)).astype(np.float32) * 0.1).values()
        w = _kernels.weight(kind, data, scales, 37, k)
        for m in range(1, 10):
            x = rng.standard_normal((m, k)).astype(np.float32)
            out = np.empty((m, 37), np.float32)
            _kernels.matmul(x, w, out)
            found[kind, k, m] = out
sys.stdout.buffer.write(pickle.dumps(found))
"""
    env = {**os.environ, "COLIBRI_KERNEL_PATH": path}
    run = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, check=True)
    return pickle.loads(run.stdout)


def test_the_avx512_int_paths_give_the_avx2_paths_outputs_bit_for_bit():
    """The AVX-512 VNNI int8 and int4 kernels sum the same integers in other vector widths
    and steps: their outputs must be the AVX2 paths' exactly (placement and the machine
    change speed only, never the tokens)."""
    best = _int_path_outputs("")
    if best["path"] != "avx512-vnni":
        pytest.skip(f"this CPU has no AVX-512 VNNI path (best int4 path: {best['path']}); an AVX-512 machine runs this")
    avx2 = _int_path_outputs("avx2")
    assert avx2["path"] == "avx2"
    assert best.keys() == avx2.keys() and len(best) > 50
    for key in best:
        if key != "path":
            np.testing.assert_array_equal(best[key], avx2[key], err_msg=str(key))


# the kernel tests, re-run by the two tests below on other builds and paths of the kernels
KERNEL_TESTS = "(kernel or fused or routed or linears or every_byte or compiled_attention) and not lower_kernel_paths and not x86_paths"


@pytest.mark.parametrize("level", ["avx2", "portable"])
def test_the_lower_kernel_paths_pass_the_kernel_tests_too(level):
    """The machine picks its best path at import; the others are run here in a child
    process held to them (COLIBRI_KERNEL_PATH), so every path stays tested."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLIBRI_KERNEL_PATH": level}
    probe = subprocess.run([sys.executable, "-c", "from colibri_core.compute.cpu import _kernels; print(_kernels.INT4_PATH)"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == ("float" if level == "portable" else "avx2")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__, "-k", KERNEL_TESTS],
                         env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]


def test_the_kernels_build_and_pass_the_kernel_tests_without_the_x86_paths(tmp_path):
    """On other CPUs (ARM: Apple silicon, Graviton) the x86 blocks are not compiled and
    setup.py's optional extension would fail silently, leaving colibri on numpy. So the
    kernels are built here as they build there (-DCOLIBRI_NO_X86, without OpenMP, implicit
    declarations refused), and the kernel tests run on that build in a child process."""
    import os
    import shutil
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    import colibri_core.compute.cpu as cpu_package

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) here")
    source = Path(cpu_package.__file__).parent / "_kernels.c"
    built = tmp_path / ("_kernels" + sysconfig.get_config_var("EXT_SUFFIX"))
    compiled = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-std=c11", "-DCOLIBRI_NO_X86", "-Wall", "-Wno-unknown-pragmas",
                               "-Werror=implicit-function-declaration", "-Werror=incompatible-pointer-types",
                               f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(built)],
                              capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    assert "warning" not in compiled.stderr, compiled.stderr[-3000:]
    # the child imports the portable build under the package's own name before any test
    child = ("import importlib.util, sys\n"
             f"spec = importlib.util.spec_from_file_location('colibri_core.compute.cpu._kernels', {str(built)!r})\n"
             "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
             "sys.modules[spec.name] = module\n"
             "assert (module.INT4_PATH, module.MXFP4PAIR_PATH, module.OPENMP) == ('float', 'float', 0), module.INT4_PATH\n"
             "import pytest\n"
             f"sys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', {__file__!r}, '-k', sys.argv[1]]))\n")
    run = subprocess.run([sys.executable, "-c", child, KERNEL_TESTS], env={**os.environ, "COLIBRI_KERNEL_PATH": ""},
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert " passed" in run.stdout
