"""The Mamba (v1) mixer (colibri_core.nn.mamba1) against its host reference
(colibri_core.testing.mamba1.reference_mamba1: the recurrence position by position, in
float64), on every installed backend: a prompt at once (several blocks), in pieces
(blocks, single decoded tokens, cuts anywhere), a batched step, a state snapshot resumed
in a fresh state; and the reference itself against transformers' JambaMambaMixer."""

import numpy as np
import pytest

from colibri_core.nn import Cache
from colibri_core.testing import mixers
from colibri_core.testing.mamba1 import Mamba1Shape, build_mixer, random_weights, reference_mamba1

SHAPES = {
    # Jamba's: the dt / B / C norms, a conv bias, blocks of 7 positions
    "jamba": Mamba1Shape(),
    # biased in/out projections, no conv bias, kernel 3, a block of one position
    "biases_kernel3": Mamba1Shape(kernel=3, conv_bias=False, proj_bias=True, block=1, state=4, dt_rank=3),
    # plain Mamba: no dt / B / C norms; one block holds the whole prompt
    "no_norms": Mamba1Shape(norms=False, state=16, block=64),
}
POSITIONS = 30
# a prompt in blocks, then single tokens (the stepwise form), then a chunk and tokens again
CUTS = [11, 12, 13, 21, 22, POSITIONS]
TOLERANCE = 2e-5


@pytest.fixture(params=mixers.backend_fixture_params())
def ops(request):
    return mixers.backend(request.param)


feed = mixers.feed


def reference_in(shape, w, x, cuts):
    conv = np.zeros((shape.kernel - 1, shape.inner), np.float32)
    ssm = np.zeros((shape.inner, shape.state), np.float32)
    outs, start = [], 0
    for end in cuts:
        out, conv, ssm = reference_mamba1(shape, w, x[start:end], conv, ssm)
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
    for cuts in ([POSITIONS], CUTS, [1, 2, 3, 4, POSITIONS], [5, 6, 19, 20, 27, 28, 29, POSITIONS]):
        got, cache = feed(mixer, ops, x, cuts)
        state = cache.layers[0]
        check(got, state, reference_in(shape, w, x, cuts), f"{name}, cuts {cuts}")
        assert state.length == POSITIONS


def test_a_prompt_split_anywhere_is_the_prompt_at_once(ops):
    """Every split of a prompt in two (the second piece one token or more) gives the
    outputs and state of the prompt at once, to float32 rounding."""
    shape = SHAPES["jamba"]
    w, x = inputs(shape, 5)
    mixer = build_mixer(ops, shape, w)
    whole, cache = feed(mixer, ops, x, [POSITIONS])
    for cut in range(1, POSITIONS):
        pieces, split = feed(mixer, ops, x, [cut, POSITIONS])
        assert np.abs(pieces - whole).max() < 1e-5, f"cut at {cut}"
        for name in ("conv", "ssm"):
            difference = ops.to_host(split.layers[0][name]) - ops.to_host(cache.layers[0][name])
            assert np.abs(difference).max() < 1e-5, f"cut at {cut}: {name}"


def test_a_snapshot_resumes_in_a_fresh_state(ops):
    """The state snapshotted after a prefix (what prefix reuse and drafts keep) and copied
    into a fresh state continues as the uninterrupted run; kept states rewind exactly."""
    shape = SHAPES["jamba"]
    w, x = inputs(shape, 9)
    mixer = build_mixer(ops, shape, w)
    whole, _ = feed(mixer, ops, x, [POSITIONS])
    prefix, cache = feed(mixer, ops, x, [17])
    state = cache.layers[0]
    snapshot = state.snapshot()
    state.keep_states()
    feed(mixer, ops, x, [18, 19, 23], cache, start=17)  # moves on, then rewinds
    state.rewind(17)
    cache.length = 17
    rest, _ = feed(mixer, ops, x, [POSITIONS], cache, start=17)
    assert np.abs(np.concatenate([prefix, rest]) - whole).max() < 1e-5
    fresh = Cache([mixer.new_state(ops, 1024)])
    state.copy_prefix(fresh.layers[0], 17, snapshot)
    fresh.length = 17
    resumed, _ = feed(mixer, ops, x, [20, POSITIONS], fresh, start=17)
    assert np.abs(np.concatenate([prefix, resumed]) - whole).max() < 1e-5


def test_batched_step_is_each_sequence_alone(ops):
    """A batched step (two sequences, one decoding a token and one a chunk) computes each
    as alone."""
    shape = SHAPES["jamba"]
    w, x = inputs(shape, 7)
    got, rows, caches = mixers.batched_two(build_mixer(ops, shape, w), ops, x, 9, 4, 10)
    for (a, b), cuts, cache in zip(rows, ([9, 10], [4, 10]), caches):
        want = reference_in(shape, w, x[:10], cuts)
        n = b - a
        assert np.abs(got[a:b] - want[0][-n:]).max() < TOLERANCE
        assert np.abs(ops.to_host(cache.layers[0]["ssm"]) - want[2]).max() < TOLERANCE


@pytest.mark.parametrize("name", ["jamba", "biases_kernel3"])
def test_reference_matches_transformers(name):
    """The reference against transformers' own Jamba mixer (its PyTorch path), the same
    weights, a whole sequence (its stepwise update is checked through the oracle suite's
    decoding, tests of families/colibri-ai21)."""
    torch = pytest.importorskip("torch")
    from transformers import JambaConfig
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    shape = SHAPES[name]
    w, x = inputs(shape, 11)
    config = JambaConfig(hidden_size=shape.hidden, mamba_expand=shape.inner // shape.hidden, mamba_d_state=shape.state,
                         mamba_dt_rank=shape.dt_rank, mamba_d_conv=shape.kernel, mamba_conv_bias=shape.conv_bias,
                         mamba_proj_bias=shape.proj_bias, rms_norm_eps=shape.eps, num_hidden_layers=1,
                         attn_layer_period=1, attn_layer_offset=0, expert_layer_period=1, expert_layer_offset=0)
    mixer = JambaMambaMixer(config, layer_idx=0).eval()
    names = {"in_proj.weight": "in_proj", "in_proj.bias": "in_proj_bias", "conv1d.weight": "conv",
             "conv1d.bias": "conv_bias", "x_proj.weight": "x_proj", "dt_proj.weight": "dt_proj",
             "dt_proj.bias": "dt_proj_bias", "A_log": "A_log", "D": "D", "out_proj.weight": "out_proj",
             "out_proj.bias": "out_proj_bias", "dt_layernorm.weight": "dt_norm", "b_layernorm.weight": "b_norm",
             "c_layernorm.weight": "c_norm"}
    with torch.no_grad():
        for theirs, ours in names.items():
            if ours in w:
                value = w[ours][:, None, :] if ours == "conv" else w[ours]
                mixer.get_parameter(theirs).copy_(torch.from_numpy(value))
        theirs = mixer(torch.from_numpy(x)[None])[0].numpy()
    conv = np.zeros((shape.kernel - 1, shape.inner), np.float32)
    ssm = np.zeros((shape.inner, shape.state), np.float32)
    ours = reference_mamba1(shape, w, x, conv, ssm)[0]
    assert np.abs(ours - theirs).max() < 1e-5
