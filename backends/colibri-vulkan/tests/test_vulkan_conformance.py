"""The conformance kit on the Vulkan backend (every shader, against the numpy reference)."""

import pytest

from colibri_core.testing.backend_kit import BackendConformanceSuite
from colibri_vulkan import probe

REASON = probe.unavailable_reason()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=f"no Vulkan here: {REASON}"),
              pytest.mark.matrix]  # the kit on one more backend


class TestVulkanBackend(BackendConformanceSuite):
    # float32 in every shader; products sum in another order than numpy (and packed weights
    # are decoded exactly), so the kit's defaults hold
    def make_backend(self):
        from colibri_vulkan.backend import VulkanBackend

        return VulkanBackend()


def test_gpt_oss_and_inkling_operations_stay_on_the_device():
    """windowed_attention (window, sinks), attention_relative_bias and the clamped
    gated_activation run in shaders: no host sync (the contract's host references take
    one per operand), and the reference's numbers."""
    import numpy as np

    from colibri_core.compute import backend as contract, host
    from colibri_vulkan.backend import VulkanBackend

    b = VulkanBackend()
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((3, 4, 8), (2, 9, 8), (2, 9, 8)))
    sinks, rel, table = (rng.standard_normal(s).astype(np.float32) for s in ((4,), (3, 4, 2), (2, 5)))
    gate, up = (rng.standard_normal((3, 16)).astype(np.float32) for _ in range(2))
    act = contract.GatedActivation(alpha=1.702, limit=0.5, up_offset=1.0)
    dev = [b.asarray(a) for a in (q, k, v, sinks, rel, table, gate, up)]
    before = b.host_syncs
    results = [b.windowed_attention(*dev[:3], 6, 0.3, 3, dev[3]),
               b.attention_relative_bias(*dev[:3], 6, 0.3, dev[4], dev[5], 4),
               b.gated_activation(dev[6], dev[7], act)]
    assert b.host_syncs == before
    wants = [host.windowed_attention(q, k, v, 6, 0.3, 3, sinks),
             host.relative_bias_attention(q, k, v, 6, 0.3, rel, table, 4),
             host.gated_activation(gate, up, act)]
    for got, want in zip(results, wants):
        np.testing.assert_allclose(b.to_host(got), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_primitives_and_the_composites_made_of_them_stay_on_the_device():
    """exp, maximum, matmul (batch axes that do not fold into one: a dispatch per outer
    index), reduce_sum/max (of an offset view) and the composites Vulkan has no kernel of
    its own for take no host sync, and give the host reference's numbers."""
    import numpy as np

    from colibri_core.compute import host
    from colibri_core.testing.backend_kit import composed
    from colibri_vulkan.backend import VulkanBackend

    b = VulkanBackend()
    rng = np.random.default_rng(11)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    a, w, x = f(3, 2, 4, 5), f(2, 3, 5, 6), f(4, 9)
    m = np.abs(f(2, 4, 4)) + 0.1
    q, k, v, sinks = f(3, 4, 8), f(2, 9, 8), f(2, 9, 8), f(4)
    visible = rng.random((3, 9)) > 0.3
    visible[:, 0] = True
    dq, dk, dv, g, beta, state = f(3, 2, 8), f(3, 2, 8), f(3, 4, 8), -np.abs(f(3, 4, 8)), np.abs(f(3, 4)), f(4, 8, 8)
    xg, wg = f(3, 8), f(6, 4)
    dev = b.asarray
    before = b.host_syncs
    c = composed(b)
    results = [b.exp(dev(x)), b.maximum(dev(x), 0.25), b.matmul(dev(a).transpose(1, 0, 2, 3), dev(w)),
               b.reduce_sum(dev(x)[2:]), b.reduce_max(dev(x).T), c.sinkhorn(dev(m), 3, 1e-6),
               c.masked_attention(dev(q), dev(k), dev(v), 0.3, visible, dev(sinks)),
               c.grouped_linear(dev(xg), dev(wg), 2),
               *c.gated_delta_channel_step(*map(dev, (dq, dk, dv, g, beta, state)))]
    assert b.host_syncs == before and c.host_syncs == before
    wants = [np.exp(x), np.maximum(x, np.float32(0.25)), a.transpose(1, 0, 2, 3) @ w, x[2:].sum(-1, keepdims=True),
             x.T.max(-1, keepdims=True), host.sinkhorn(m, 3, 1e-6), host.masked_attention(q, k, v, 0.3, visible, sinks),
             host.grouped_linear(xg, wg, 2), *host.delta_channel_step(dq, dk, dv, g, beta, state)]
    for got, want in zip(results, wants):
        np.testing.assert_allclose(b.to_host(got), want, rtol=0, atol=1e-5 * np.abs(want).max())
