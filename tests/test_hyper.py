"""Manifold hyper-connections (nn.hyper) against transformers' own modules:
DeepseekV4HyperConnection (collapse, post, comb and the decoder layer's expand),
DeepseekV4HyperHead (the weighted final collapse) and Glm5NextTextHyperHead (the mean),
with random weights; and a decoder layer on streams with a batched step."""

import numpy as np
import pytest

from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.compute.reference import ReferenceBackend
from colibri_core.nn import Step
from colibri_core.nn.hyper import HyperConnection, HyperHead, StreamEmbedding
from colibri_core.testing import memory_param

torch = pytest.importorskip("torch")

BACKENDS = {"cpu": CpuBackend(), "reference": ReferenceBackend()}


param = memory_param


def v4_config(n, hidden, iters):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(hidden_size=hidden, hc_mult=n, hc_sinkhorn_iters=iters, hc_eps=1e-6, rms_norm_eps=1e-6)


def randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("n,iters,rows", [(4, 20, 5), (2, 3, 1), (3, 1, 7)])
def test_hyper_connection_matches_transformers(backend, n, iters, rows):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    ops, hidden = BACKENDS[backend], 16
    hc = DeepseekV4HyperConnection(v4_config(n, hidden, iters)).eval()
    randomise(hc, n * 100 + iters)
    ours = HyperConnection(param(hc.fn.detach().numpy()), param(hc.base.detach().numpy()),
                           param(hc.scale.detach().numpy()), n_streams=n, sinkhorn_iters=iters, eps=1e-6, norm_eps=1e-6)
    rng = np.random.default_rng(n + rows)
    streams = (rng.standard_normal((rows, n, hidden)) * 2).astype(np.float32)
    y = rng.standard_normal((rows, hidden)).astype(np.float32)
    with torch.no_grad():
        post, comb, collapsed = hc(torch.from_numpy(streams)[None])
        # the decoder layer's expand (DeepseekV4DecoderLayer / Glm5NextTextDecoderLayer)
        expanded = post.unsqueeze(-1) * torch.from_numpy(y)[None].unsqueeze(-2) + torch.matmul(
            comb.transpose(-1, -2), torch.from_numpy(streams)[None])
    step = Step(ops, np.arange(rows), None)
    h, our_post, our_comb = ours.collapse(ops.asarray(streams), step)
    for name, got, want in (("collapsed", h, collapsed), ("post", our_post, post), ("comb", our_comb, comb)):
        np.testing.assert_allclose(ops.to_host(got), want[0].numpy(), atol=1e-5, rtol=0, err_msg=name)
    out = ours.expand(ops.asarray(y), ops.asarray(streams), our_post, our_comb, step)
    np.testing.assert_allclose(ops.to_host(out), expanded[0].numpy(), atol=1e-5, rtol=0)
    # comb is not symmetric: using it untransposed would not match
    assert np.abs(ops.to_host(our_comb) - ops.to_host(our_comb).transpose(0, 2, 1)).max() > 1e-3


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_hyper_heads_match_transformers(backend):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperHead

    ops, n, hidden = BACKENDS[backend], 4, 16
    head = DeepseekV4HyperHead(v4_config(n, hidden, 20)).eval()
    randomise(head, 7)
    ours = HyperHead(n, param(head.hc_fn.detach().numpy()), param(head.hc_base.detach().numpy()),
                     param(head.hc_scale.detach().numpy()), eps=1e-6, norm_eps=1e-6)
    streams = (np.random.default_rng(3).standard_normal((6, n, hidden)) * 2).astype(np.float32)
    step = Step(ops, np.arange(6), None)
    with torch.no_grad():
        want = head(torch.from_numpy(streams)[None])[0].numpy()
        mean = Glm5NextTextHyperHead()(torch.from_numpy(streams)[None])[0].numpy()
    np.testing.assert_allclose(ops.to_host(ours(ops.asarray(streams), step)), want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(ops.to_host(HyperHead(n)(ops.asarray(streams), step)), mean, atol=1e-6, rtol=0)
    assert np.abs(want - mean).max() > 1e-2  # the two heads differ: each test can fail


def test_stream_embedding_repeats_each_row():
    ops = BACKENDS["cpu"]
    table = np.arange(20, dtype=np.float32).reshape(5, 4)
    out = StreamEmbedding(param(table), 3)(np.array([4, 1]), Step(ops, np.arange(2), None))
    assert out.shape == (2, 3, 4)
    np.testing.assert_array_equal(out, np.repeat(table[[4, 1]][:, None, :], 3, axis=1))


def test_sinkhorn_op_is_the_reference():
    rng = np.random.default_rng(0)
    x = np.exp(rng.standard_normal((3, 4, 4))).astype(np.float32)
    want = ReferenceBackend().sinkhorn(x, 20, 1e-6)
    np.testing.assert_allclose(CpuBackend().sinkhorn(x, 20, 1e-6), want, atol=1e-7)
    np.testing.assert_allclose(want.sum(-1), 1.0, atol=1e-4)
    np.testing.assert_allclose(want.sum(-2), 1.0, atol=1e-4)
