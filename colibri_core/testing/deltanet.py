"""A check of recurrent token mixers (Gated DeltaNet: Qwen3-Next's and Qwen3.5's linear
attention, Kimi Linear's KDA; Mamba-2) that the families' oracle suites share: a layer
fed a sequence at once or in pieces computes the same."""

from __future__ import annotations

import numpy as np

from colibri_core.nn import Cache, GatedDeltaNet, Step

POSITIONS = 150  # at once: chunks of 64 + 64 + 22
# in pieces: a prefix, single tokens, an odd chunk, then token by token
PIECES = [40, 41, 42, 43, 110] + list(range(111, POSITIONS + 1))


def check_layers_in_pieces(model, kind: type = GatedDeltaNet) -> list:
    """Every recurrent token mixer of type ``kind`` (Gated DeltaNet, Mamba-2) of the loaded
    ``model``, fed the same random positions at once or in pieces, gives the same outputs
    and state arrays (conv, recurrent, ...) within 1e-5 and the same length; returns the
    layers checked."""
    lm, ops = model.lm, model.backend
    rng = np.random.default_rng(0)
    layers = [(i, layer.attn) for i, layer in enumerate(lm.layers) if isinstance(layer.attn, kind)]
    assert layers
    for i, layer in layers:
        x = rng.standard_normal((POSITIONS, lm.embed.weight.value.shape[1])).astype(np.float32)
        whole, whole_state = run_layer(layer, i, x, [POSITIONS], ops, len(lm.layers))
        pieces, piece_state = run_layer(layer, i, x, PIECES, ops, len(lm.layers))
        assert np.abs(whole - pieces).max() < 1e-5
        for name in whole_state.arrays:
            difference = ops.to_host(whole_state[name]) - ops.to_host(piece_state[name])
            assert np.abs(difference).max() < 1e-5, name
        assert whole_state.length == piece_state.length == POSITIONS
    return [layer for _, layer in layers]


def run_layer(layer, index: int, x: np.ndarray, cuts: list[int], ops, n_layers: int):
    """``layer`` (layer ``index`` of ``n_layers``) fed the rows of ``x`` up to each of
    ``cuts`` in turn, from a fresh cache: its outputs, concatenated, and its state."""
    cache = Cache([None] * n_layers)
    cache.layers[index] = state = layer.new_state(ops, 256)
    outs, start = [], 0
    for end in cuts:
        outs.append(ops.to_host(layer(ops.asarray(x[start:end]), Step(ops, np.arange(start, end), cache))))
        cache.length = start = end
    return np.concatenate(outs), state
