"""The Mamba-2 mixer (colibri_core.nn.mamba) against its host reference
(colibri_core.testing.mamba.reference_mamba2: the recurrence position by position), on
every installed backend: a prompt at once (several chunks), in pieces (chunks and single
decoded tokens, where transformers clamps dt and where it does not), and a batched step;
and the reference itself against transformers' NemotronHMamba2Mixer."""

import math

import numpy as np
import pytest

from colibri_core.testing import mixers
from colibri_core.testing.mamba import MambaShape, build_mixer, random_weights, reference_mamba2

SHAPES = {
    # 2 groups of 2 heads; conv bias; dt floored at 0.05 in the chunked form (binds for the first heads)
    "grouped_floor": MambaShape(dt_limit=(0.05, math.inf)),
    # one group of 4 heads, biased projections, no conv bias, kernel 3, an upper dt limit too
    "one_group_biases": MambaShape(groups=1, kernel=3, chunk=5, conv_bias=False, proj_bias=True, dt_limit=(0.0, 0.3)),
    # a group per head
    "group_per_head": MambaShape(groups=4, state=8, chunk=16),
}
POSITIONS = 30
# a prompt in chunks, then single tokens (the stepwise form), then a chunk and tokens again
CUTS = [11, 12, 13, 21, 22, POSITIONS]
TOLERANCE = 2e-5


@pytest.fixture(params=mixers.backend_fixture_params())
def ops(request):
    return mixers.backend(request.param)


def run(mixer, ops, x, cuts):
    """``mixer`` fed the rows of ``x`` up to each cut in turn from a fresh state."""
    got, cache = mixers.feed(mixer, ops, x, cuts)
    return got, cache.layers[0]


def reference_in(shape, w, x, cuts):
    """The reference fed the same pieces: a piece of one token after the first is a
    decode step (no clamp), any other a prompt chunk (clamped), as transformers computes."""
    conv = np.zeros((shape.kernel - 1, shape.conv_dim), np.float32)
    ssm = np.zeros((shape.heads, shape.head_dim, shape.state), np.float32)
    outs, start = [], 0
    for end in cuts:
        out, conv, ssm = reference_mamba2(shape, w, x[start:end], conv, ssm, clamp=not (end - start == 1 and start > 0))
        outs.append(out)
        start = end
    return np.concatenate(outs), conv, ssm


def inputs(shape, seed):
    return mixers.inputs(random_weights, shape, seed, POSITIONS)


def check(got, state, want, label):
    out, conv, ssm = want
    mixers.check(got, state, out, {"conv": conv, "ssm": ssm}, label, TOLERANCE)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_mixer_matches_the_reference_at_once_and_in_pieces(ops, name):
    shape = SHAPES[name]
    w, x = inputs(shape, len(name))
    mixer = build_mixer(ops, shape, w)
    for cuts in ([POSITIONS], CUTS, [1, 2, 3, 4, POSITIONS]):
        got, state = run(mixer, ops, x, cuts)
        check(got, state, reference_in(shape, w, x, cuts), f"{name}, cuts {cuts}")
        assert state.length == POSITIONS


def test_the_clamp_matters_where_transformers_applies_it():
    """The floor binds in the chunked form: without it the reference (and the mixer)
    differ, so the tests above see the clamp."""
    shape = SHAPES["grouped_floor"]
    w, x = inputs(shape, 3)
    conv = np.zeros((shape.kernel - 1, shape.conv_dim), np.float32)
    ssm = np.zeros((shape.heads, shape.head_dim, shape.state), np.float32)
    clamped, unclamped = (reference_mamba2(shape, w, x, conv, ssm, clamp)[0] for clamp in (True, False))
    assert np.abs(clamped - unclamped).max() > 1e-3


def test_batched_step_is_each_sequence_alone(ops):
    """A batched step (two sequences, one decoding a token and one a chunk) computes each
    as alone."""
    shape = SHAPES["grouped_floor"]
    w, x = inputs(shape, 7)
    got, rows, caches = mixers.batched_two(build_mixer(ops, shape, w), ops, x, 9, 4, 10)
    for (a, b), cuts, cache in zip(rows, ([9, 10], [4, 10]), caches):
        want = reference_in(shape, w, x[:10], cuts)
        n = b - a
        assert np.abs(got[a:b] - want[0][-n:]).max() < TOLERANCE
        assert np.abs(ops.to_host(cache.layers[0]["ssm"]) - want[2]).max() < TOLERANCE


def test_reference_matches_transformers():
    """The reference against transformers' own Mamba-2 mixer (Nemotron-H's, whose chunked
    scan floors dt at time_step_min), the same weights, a whole sequence."""
    torch = pytest.importorskip("torch")
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    shape = SHAPES["grouped_floor"]
    w, x = inputs(shape, 11)
    config = NemotronHConfig(hidden_size=shape.hidden, mamba_num_heads=shape.heads, mamba_head_dim=shape.head_dim,
                             n_groups=shape.groups, ssm_state_size=shape.state, conv_kernel=shape.kernel,
                             chunk_size=shape.chunk, layer_norm_epsilon=shape.eps, time_step_min=shape.dt_limit[0],
                             layers_block_type=["linear_attention"], use_conv_bias=True)
    mixer = NemotronHMamba2Mixer(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, value in (("in_proj.weight", w["in_proj"]), ("conv1d.weight", w["conv"][:, None, :]),
                            ("conv1d.bias", w["conv_bias"]), ("dt_bias", w["dt_bias"]), ("A_log", w["A_log"]),
                            ("D", w["D"]), ("norm.weight", w["norm"]), ("out_proj.weight", w["out_proj"])):
            mixer.get_parameter(name).copy_(torch.from_numpy(value))
        theirs = mixer(torch.from_numpy(x)[None])[0].numpy()
    conv = np.zeros((shape.kernel - 1, shape.conv_dim), np.float32)
    ssm = np.zeros((shape.heads, shape.head_dim, shape.state), np.float32)
    ours = reference_mamba2(shape, w, x, conv, ssm, clamp=True)[0]
    assert np.abs(ours - theirs).max() < 1e-5
