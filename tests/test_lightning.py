"""Lightning attention (colibri_core.nn.lightning) against its host reference
(colibri_core.testing.lightning.reference_lightning: the recurrence position by position in
float64), on every installed backend: a prompt at once (several blocks), in pieces
(blocks, odd chunks and single decoded tokens), split at every point, a batched step, a
snapshot restored; and the reference itself against transformers' MiniMaxLightningAttention
(its block-wise prefill and its stepwise decode)."""

import numpy as np
import pytest

from colibri_core.nn import Cache
from colibri_core.nn.lightning import lightning_slopes
from colibri_core.testing import mixers
from colibri_core.testing.lightning import LightningShape, build_mixer, random_weights, reference_lightning

SHAPES = {
    # 4 heads of 8, blocks of 8, the second of 4 layers
    "blocks_of_8": LightningShape(),
    # 2 wide heads, blocks of 5, the first layer (the fastest decay)
    "wide_heads_odd_block": LightningShape(heads=2, head_dim=16, block=5, layer=0, layers=3),
    # 8 narrow heads, one block bigger than the prompt, the last layer (decay 1e-5 * rate)
    "one_block_last_layer": LightningShape(heads=8, head_dim=4, block=64, layer=5, layers=6),
}
POSITIONS = 30
# a prompt in blocks, then single tokens (the stepwise form), then a chunk and tokens again
CUTS = [11, 12, 13, 21, 22, POSITIONS]
TOLERANCE = 2e-5


@pytest.fixture(params=mixers.backend_fixture_params())
def ops(request):
    return mixers.backend(request.param)


def run(mixer, ops, x, cuts, cache=None, start=0):
    """``mixer`` fed the rows of ``x`` from ``start`` up to each cut in turn (from a fresh
    state unless ``cache`` is given)."""
    got, cache = mixers.feed(mixer, ops, x, cuts, cache, start)
    return got, cache.layers[0]


def fresh(shape):
    return np.zeros((shape.heads, shape.head_dim, shape.head_dim), np.float32)


def inputs(shape, seed):
    return mixers.inputs(random_weights, shape, seed, POSITIONS)


def check(got, state, want, label):
    out, kv = want
    mixers.check(got, state, out, {"kv": kv}, label, TOLERANCE)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_mixer_matches_the_reference_at_once_and_in_pieces(ops, name):
    shape = SHAPES[name]
    w, x = inputs(shape, len(name))
    mixer = build_mixer(ops, shape, w)
    want = reference_lightning(shape, w, x, fresh(shape))
    for cuts in ([POSITIONS], CUTS, [1, 2, 3, 4, POSITIONS], list(range(1, POSITIONS + 1))):
        got, state = run(mixer, ops, x, cuts)
        check(got, state, want, f"{name}, cuts {cuts}")
        assert state.length == POSITIONS


def test_every_split_point_equals_the_whole(ops):
    """A prompt cut in two at any point (inside a block, on its edge) gives the outputs
    and state of the whole."""
    shape = SHAPES["blocks_of_8"]
    w, x = inputs(shape, 5)
    mixer = build_mixer(ops, shape, w)
    whole, whole_state = run(mixer, ops, x, [POSITIONS])
    for split in range(1, POSITIONS):
        got, state = run(mixer, ops, x, [split, POSITIONS])
        assert np.abs(got - whole).max() < TOLERANCE, f"split at {split}"
        assert np.abs(ops.to_host(state["kv"]) - ops.to_host(whole_state["kv"])).max() < TOLERANCE, f"split at {split}"


def test_snapshot_restored_resumes_the_sequence(ops):
    """A state snapshot taken mid-sequence, copied into a fresh state (a prefix snapshot),
    resumes it: the continuation equals the sequence fed without the detour."""
    shape = SHAPES["wide_heads_odd_block"]
    w, x = inputs(shape, 9)
    mixer = build_mixer(ops, shape, w)
    whole, _ = run(mixer, ops, x, [POSITIONS])
    _, state = run(mixer, ops, x, [7, 13])
    snap = state.snapshot()
    run(mixer, ops, x, [20, 21], Cache([state]), start=13)  # the original moves on
    restored = mixer.new_state(ops, 1024)
    state.copy_prefix(restored, 13, snap)
    cache = Cache([restored])
    cache.length = 13
    got, after = run(mixer, ops, x, [14, POSITIONS], cache, start=13)
    assert after.length == POSITIONS
    assert np.abs(got - whole[13:]).max() < TOLERANCE


def test_batched_step_is_each_sequence_alone(ops):
    """A batched step (two sequences, one decoding a token and one a chunk) computes each
    as alone."""
    shape = SHAPES["blocks_of_8"]
    w, x = inputs(shape, 7)
    got, rows, caches = mixers.batched_two(build_mixer(ops, shape, w), ops, x, 9, 4, 14)
    for (a, b), end, cache in zip(rows, (10, 14), caches):
        out, kv = reference_lightning(shape, w, x[:end], fresh(shape))
        assert np.abs(got[a:b] - out[end - (b - a) :]).max() < TOLERANCE
        assert np.abs(ops.to_host(cache.layers[0]["kv"]) - kv).max() < TOLERANCE


def test_the_decay_matters():
    """The decay is seen: the reference with every slope zero differs, and the slopes
    shrink with depth as transformers' do."""
    shape = SHAPES["wide_heads_odd_block"]
    w, x = inputs(shape, 3)
    flat = LightningShape(heads=2, head_dim=16, block=5, layer=2, layers=3)  # factor 1e-5: nearly no decay
    assert np.abs(reference_lightning(shape, w, x, fresh(shape))[0] - reference_lightning(flat, w, x, fresh(flat))[0]).max() > 1e-2
    assert (lightning_slopes(4, 0, 4) > lightning_slopes(4, 2, 4)).all()


@pytest.mark.parametrize("name", ["blocks_of_8", "wide_heads_odd_block"])
def test_reference_matches_transformers(name):
    """The reference against transformers' own lightning attention, the same weights: its
    block-wise prefill over several blocks (with a partial last one), then its stepwise
    decode of more tokens from the cached state."""
    torch = pytest.importorskip("torch")
    from transformers import MiniMaxConfig
    from transformers.models.minimax.modeling_minimax import MiniMaxCache, MiniMaxLightningAttention

    shape = SHAPES[name]
    w, x = inputs(shape, 11)
    config = MiniMaxConfig(hidden_size=shape.hidden, num_attention_heads=shape.heads, head_dim=shape.head_dim,
                           num_hidden_layers=shape.layers, block_size=shape.block,
                           layer_types=["linear_attention"] * shape.layers)
    layer = MiniMaxLightningAttention(config, layer_idx=shape.layer).eval()
    cache = MiniMaxCache()
    with torch.no_grad():
        for n in ("qkv_proj", "output_gate", "norm", "out_proj"):
            layer.get_parameter(f"{n}.weight").copy_(torch.from_numpy(w[n]))
        theirs = [layer(torch.from_numpy(x[None, :21]), None, None, past_key_values=cache)[0][0].numpy()]
        for t in range(21, POSITIONS):
            theirs.append(layer(torch.from_numpy(x[None, t : t + 1]), None, None, past_key_values=cache)[0][0].numpy())
    theirs = np.concatenate(theirs)
    ours, kv = reference_lightning(shape, w, x, fresh(shape))
    assert np.abs(ours - theirs).max() < 1e-5
    assert np.abs(cache.get_linear_cache(shape.layer)[0].numpy() - kv).max() < 1e-5
