"""The machinery under the backend: one submit (and one host wait) per host read, however
many dispatches and uploads came before; descriptor sets written once and reused; memory
ranges reused once their arrays are gone;
a model's decode waits on the device only where the contract needs host data."""

import gc

import numpy as np
import pytest

from colibri_vulkan import probe

REASON = probe.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no Vulkan here: {REASON}")


@pytest.fixture
def small_context(monkeypatch):
    """A context of its own whose descriptor pools and staging buffers fill after a few
    dispatches and 4 KiB."""
    from colibri_vulkan import device

    monkeypatch.setattr(device, "DESCRIPTOR_SETS", 4)
    monkeypatch.setattr(device, "STAGING_BYTES", 4096)
    ctx = device.VulkanContext()
    yield ctx
    ctx.close()


def test_one_submit_per_host_read_past_full_pools_and_staging(small_context):
    from colibri_vulkan.backend import VulkanBackend

    backend = VulkanBackend(context=small_context)
    rng = np.random.default_rng(0)
    host = rng.standard_normal((64, 64)).astype(np.float32)  # 16 KiB: more than a staging buffer
    x, want = backend.asarray(host), host.copy()
    # 24 dispatches and 12 more uploads: past several staging buffers (and, where the driver
    # enforces a pool's maxSets, several descriptor pools; lavapipe does not)
    for i in range(12):
        addend = rng.standard_normal((64, 64)).astype(np.float32)
        x = x * 0.5 + backend.asarray(addend)
        want = want * np.float32(0.5) + addend
    assert small_context.submits == 0, "recording must not wait on the device"
    got = backend.to_host(x)
    assert small_context.submits == 1
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert len(small_context.stagings) > 1


def test_descriptor_sets_are_written_once_and_reused(small_context, monkeypatch):
    """A dispatch on the same program and buffer ranges reuses its descriptor set, across
    submits; past the cache's size new sets come from the recording's pools and the cache
    is dropped at the next submit (no pending command uses it then); results stay right."""
    from colibri_vulkan import device
    from colibri_vulkan.backend import VulkanBackend

    backend = VulkanBackend(context=small_context)
    rng = np.random.default_rng(3)
    a, b = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2))
    x, y = backend.asarray(a), backend.asarray(b)
    out = backend.zeros((8, 8))
    hits = small_context.set_hits
    for round_ in range(3):
        backend._eltwise(1, out, x, y)  # out = x + y: the same program and ranges every time
        np.testing.assert_array_equal(backend.to_host(out), a + b)
    assert small_context.set_hits == hits + 2
    monkeypatch.setattr(device, "CACHED_SETS", len(small_context.sets) + 2)
    for round_ in range(3):
        outs = [backend.zeros((8, 8)) for _ in range(6)]  # six distinct output ranges: past the cache
        for i, o in enumerate(outs):
            backend._eltwise(1, o, x, y)
            backend._eltwise(3, o, o, x)  # o = (x + y) * x
        assert small_context.drop_sets
        for o in outs:
            np.testing.assert_allclose(backend.to_host(o), (a + b) * a, rtol=1e-6)
        assert not small_context.drop_sets and len(small_context.sets) <= device.CACHED_SETS


def test_ranges_are_reused_once_their_arrays_are_gone(small_context):
    from colibri_vulkan.backend import VulkanBackend

    backend = VulkanBackend(context=small_context)
    base = small_context.allocated_bytes()
    arrays = [backend.zeros((1000,)) for _ in range(50)]
    assert small_context.allocated_bytes() == base + 50 * 4096  # 4000 bytes, aligned to the block's alignment
    backend.to_host(arrays[-1])
    del arrays
    gc.collect()
    assert small_context.allocated_bytes() == base
    assert len(small_context.blocks) == 1


def test_decode_waits_only_for_host_data(tmp_path):
    """Every submit of a generation is a host sync the statistics count (routing ids, logits)."""
    import torch
    from transformers import OlmoeConfig, OlmoeForCausalLM

    import colibri_core

    torch.manual_seed(0)
    config = OlmoeConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, eos_token_id=None)
    OlmoeForCausalLM(config).to(torch.float32).save_pretrained(tmp_path / "olmoe")
    with colibri_core.load(tmp_path / "olmoe", cap=1, history=False, backend="vulkan") as model:
        ctx, syncs = model.backend.ctx, model.backend.host_syncs
        submits, hits = ctx.submits, ctx.set_hits
        model.generate(token_ids=[5, 17, 9, 3], max_tokens=6, ignore_eos=True)
        made = ctx.submits - submits
        assert made == model.backend.host_syncs - syncs > 0
        assert ctx.set_hits > hits  # decode steps reuse descriptor sets
