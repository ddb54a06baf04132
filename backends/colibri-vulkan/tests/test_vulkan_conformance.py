"""The conformance kit on the Vulkan backend (every shader, against the numpy reference)."""

import pytest

from colibri_core.testing.backend_kit import BackendConformanceSuite
from colibri_vulkan import probe

REASON = probe.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no Vulkan here: {REASON}")


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

    from colibri_core.engine import backend as contract
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
    wants = [contract.windowed_attention(q, k, v, 6, 0.3, 3, sinks),
             contract.relative_bias_attention(q, k, v, 6, 0.3, rel, table, 4),
             contract.gated_activation(gate, up, act)]
    for got, want in zip(results, wants):
        np.testing.assert_allclose(b.to_host(got), want, rtol=0, atol=1e-5 * np.abs(want).max())
