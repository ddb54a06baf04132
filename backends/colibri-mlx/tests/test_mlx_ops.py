"""Every dense, attention, MLA/DSA and recurrent operation of the MLX backend against the
numpy reference, on random inputs: one and several tokens, grouped KV heads, partial
rotary dimensions, causal and selected key sets."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_checks import assert_close, host, mlx_backend, reference, rng  # noqa: F401 (fixtures)


def f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def test_memory_members(mlx_backend):
    x = mlx_backend.asarray(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert isinstance(x, mx.array) and x.dtype == mx.float32
    before = mlx_backend.host_syncs
    np.testing.assert_array_equal(mlx_backend.to_host(x), np.arange(6, dtype=np.float32).reshape(2, 3))
    assert mlx_backend.host_syncs == before + 1
    assert mlx_backend.nbytes(x) == 24
    for dtype, size in (("float32", 4), ("bfloat16", 2), ("float16", 2), ("int64", 8), ("int32", 4), ("uint8", 1)):
        z = mlx_backend.zeros((3, 5), dtype)
        assert mlx_backend.nbytes(z) == 15 * size
        assert not host(mlx_backend, z).any()
    np.testing.assert_array_equal(host(mlx_backend, mlx_backend.asarray([1.5, -2.0], "bfloat16")), [1.5, -2.0])
    with pytest.raises(ValueError, match="float64"):
        mlx_backend.zeros((2,), "float64")
    assert mlx_backend.unified_memory
    assert mlx_backend.device_memory() > 1 << 30  # the host's memory on the CPU build
    assert mlx_backend.float_dtypes == ("float32",)


def test_runs_on_its_own_stream_whatever_the_default(mlx_backend, reference, rng):
    x = f32(rng, 4, 8)
    with mx.stream(mx.new_stream(mx.cpu)):
        y = mlx_backend.silu(mlx_backend.asarray(x))
    assert_close(mlx_backend, y, reference.silu(x))
    assert mlx_backend.device in (mx.cpu, mx.gpu)


@pytest.mark.parametrize("t", [1, 5])
def test_elementwise_and_norms(mlx_backend, reference, rng, t):
    m, r = mlx_backend, reference
    x, y = f32(rng, t, 40, scale=3.0), f32(rng, t, 40)
    x[0, :4] = [-120.0, 120.0, 25.0, -0.0]  # exp overflow, softplus threshold, signed zero
    w, b = f32(rng, 40), f32(rng, 40)
    mx_x, mx_y = m.asarray(x), m.asarray(y)
    assert_close(m, m.silu(mx_x), r.silu(x))
    assert_close(m, m.silu_mul(mx_x, mx_y), r.silu_mul(x, y))
    assert_close(m, m.sigmoid(mx_x), r.sigmoid(x))
    assert_close(m, m.softplus(mx_x), r.softplus(x))
    assert_close(m, m.softmax(mx_x), r.softmax(x))
    assert_close(m, m.clip(mx_x, 2.5), r.clip(x, 2.5))
    assert_close(m, m.l2_norm(mx_x, 1e-6), r.l2_norm(x, 1e-6))
    assert_close(m, m.rms_norm(mx_x, m.asarray(w), 1e-6), r.rms_norm(x, w, 1e-6))
    assert_close(m, m.rms_norm(mx_x, None, 1e-6), r.rms_norm(x, None, 1e-6))
    assert_close(m, m.layer_norm(mx_x, m.asarray(w), m.asarray(b), 1e-5), r.layer_norm(x, w, b, 1e-5))
    assert_close(m, m.layer_norm(mx_x, None, None, 1e-5), r.layer_norm(x, None, None, 1e-5))
    assert_close(m, m.concat([mx_x, mx_y], 1), r.concat([x, y], 1))


@pytest.mark.parametrize("rotary_dim", [16, 8])
@pytest.mark.parametrize("t", [1, 6])
def test_rope(mlx_backend, reference, rng, t, rotary_dim):
    m, r = mlx_backend, reference
    x = f32(rng, t, 3, 16)
    angles = rng.uniform(0, 6.3, (t, rotary_dim // 2)).astype(np.float32)
    cos = np.cos(np.concatenate((angles, angles), axis=-1))
    sin = np.sin(np.concatenate((angles, angles), axis=-1))
    args = (m.asarray(x), m.asarray(cos), m.asarray(sin), rotary_dim)
    assert_close(m, m.rope(*args), r.rope(x, cos, sin, rotary_dim))
    assert_close(m, m.rope_interleaved(*args), r.rope_interleaved(x, cos, sin, rotary_dim))


def test_rows(mlx_backend, reference, rng):
    m, r = mlx_backend, reference
    x, out, y = f32(rng, 7, 12), f32(rng, 7, 12), f32(rng, 3, 12)
    rows, scale = np.array([5, 0, 3]), f32(rng, 3)
    assert_close(m, m.take_rows(m.asarray(x), rows), r.take_rows(x, rows))
    assert_close(m, m.add_rows(m.asarray(out), rows, m.asarray(y), scale), r.add_rows(out.copy(), rows, y, scale))


@pytest.mark.parametrize("t,start,s", [(1, 9, 10), (4, 0, 4), (4, 6, 10), (3, 2, 9)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 1)])
def test_attention(mlx_backend, reference, rng, t, start, s, hq, hkv):
    """Causal attention with every grouping of query heads, queries at the end of the
    cache or before its end (keys a query may not see yet)."""
    m, r = mlx_backend, reference
    q, k, v = f32(rng, t, hq, 16), f32(rng, hkv, s, 16), f32(rng, hkv, s, 12)
    ours = m.attention(m.asarray(q), m.asarray(k), m.asarray(v), start, 0.25)
    assert_close(m, ours, r.attention(q, k, v, start, 0.25))
    selected = np.stack([rng.permutation(s)[:5] for _ in range(t)])
    selected[:, 0] = 0  # every query sees at least one selected key
    ours = m.sparse_attention(m.asarray(q), m.asarray(k), m.asarray(v), start, 0.25, m.asarray(selected, "int64"))
    assert_close(m, ours, r.sparse_attention(q, k, v, start, 0.25, selected))


@pytest.mark.parametrize("t,start", [(1, 8), (5, 0), (3, 6)])
def test_mla_expanded_and_absorbed(mlx_backend, reference, rng, t, start):
    m, r = mlx_backend, reference
    h, dn, dr, dv, rank = 4, 16, 8, 12, 24
    s = start + t
    q_nope, q_rot = f32(rng, t, h, dn), f32(rng, t, h, dr)
    latent, k_rot = f32(rng, s, rank), f32(rng, s, dr)
    kv_b = f32(rng, h * (dn + dv), rank, scale=0.2)
    mq = [m.asarray(a) for a in (q_nope, q_rot, latent, k_rot, kv_b)]
    for ours, expected in zip(m.mla_expand(*mq, dn, dv), r.mla_expand(q_nope, q_rot, latent, k_rot, kv_b, dn, dv)):
        assert_close(m, ours, expected)
    q_lat = r.mla_absorb_query(q_nope, kv_b, dn, dv)
    assert_close(m, m.mla_absorb_query(mq[0], mq[4], dn, dv), q_lat)
    selected = np.stack([rng.permutation(s)[: max(1, s // 2)] for _ in range(t)])
    selected[:, 0] = 0
    for sel in (None, selected):
        o_lat = r.mla_attention(q_lat, q_rot, latent, k_rot, start, 0.3, sel)
        ours = m.mla_attention(m.asarray(q_lat), mq[1], mq[2], mq[3], start, 0.3,
                               None if sel is None else m.asarray(sel, "int64"))
        assert_close(m, ours, o_lat)
        assert_close(m, m.mla_absorb_output(m.asarray(o_lat), mq[4], dn, dv), r.mla_absorb_output(o_lat, kv_b, dn, dv))
    # both forms are the same attention (on MLX too)
    q, keys, values = m.mla_expand(*mq, dn, dv)
    expanded = host(m, m.attention(q, keys, values, start, 0.3))
    absorbed = m.mla_absorb_output(m.mla_attention(m.mla_absorb_query(mq[0], mq[4], dn, dv), mq[1], mq[2], mq[3], start,
                                                   0.3), mq[4], dn, dv)
    assert_close(m, absorbed, expanded, tol=1e-5)


@pytest.mark.parametrize("t,start", [(1, 11), (6, 0), (4, 3)])
def test_dsa_index_scores_and_selection(mlx_backend, reference, rng, t, start):
    m, r = mlx_backend, reference
    s = start + t
    q, k, w = f32(rng, t, 4, 16), f32(rng, s, 16), f32(rng, t, 4)
    scores = r.dsa_index_scores(q, k, w, 0.25, start)
    ours = m.dsa_index_scores(m.asarray(q), m.asarray(k), m.asarray(w), 0.25, start)
    assert_close(m, ours, scores)
    selected = m.top_k(m.asarray(scores), 3)  # from the reference's scores: the selection itself is compared
    assert isinstance(selected, mx.array) and selected.dtype == mx.int64
    np.testing.assert_array_equal(host(m, selected), r.top_k(scores, 3))


@pytest.mark.parametrize("t", [1, 5])
def test_causal_conv1d(mlx_backend, reference, rng, t):
    m, r = mlx_backend, reference
    x, weight, state = f32(rng, t, 10), f32(rng, 10, 4), f32(rng, 3, 10)
    for ours, expected in zip(m.causal_conv1d(m.asarray(x), m.asarray(weight), m.asarray(state)),
                              r.causal_conv1d(x, weight, state)):
        assert_close(m, ours, expected)


@pytest.mark.parametrize("t,chunk", [(1, 64), (150, 64), (37, 16)])
@pytest.mark.parametrize("hk,hv", [(2, 2), (1, 3)])
def test_gated_delta_chunked_and_stepwise(mlx_backend, reference, rng, t, chunk, hk, hv):
    """Chunked (with a padded last chunk) and stepwise forms, each against the reference,
    and against each other."""
    m, r = mlx_backend, reference
    dk, dv = 8, 6
    q = r.l2_norm(f32(rng, t, hk, dk), 1e-6) * np.float32(dk**-0.5)
    k = r.l2_norm(f32(rng, t, hk, dk), 1e-6)
    v, state = f32(rng, t, hv, dv), f32(rng, hv, dk, dv)
    g = -np.abs(f32(rng, t, hv, scale=0.3))
    beta = rng.uniform(0, 1, (t, hv)).astype(np.float32)
    args = [m.asarray(a) for a in (q, k, v, g, beta, state)]
    chunked = m.gated_delta_chunked(*args, chunk)
    stepwise = m.gated_delta_step(*args)
    for ours, expected in zip(chunked, r.gated_delta_chunked(q, k, v, g, beta, state, chunk)):
        assert_close(m, ours, expected, tol=1e-5)
    for ours, expected in zip(stepwise, r.gated_delta_step(q, k, v, g, beta, state)):
        assert_close(m, ours, expected, tol=1e-5)
    for a, b in zip(chunked, stepwise):
        assert_close(m, a, host(m, b), tol=1e-5)
