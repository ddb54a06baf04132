"""A host reference of lightning attention (``colibri_core.nn.lightning.LightningAttention``)
and a way to build one with random weights on any backend, for tests.

``reference_lightning`` is the plain recurrence, one position after another, in float64
numpy, written from transformers' ``MiniMaxLightningAttention`` (its stepwise decode
form): qkv = silu(qkv_proj x), per head [q | k | v]; per head S = exp(-s) S + k^T v,
o = q S; then out_proj(rms_norm(o) * w * sigmoid(output_gate x)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_core.nn.layers import Linear, RMSNorm
from colibri_core.nn.lightning import NORM_EPS, LightningAttention, lightning_slopes
from colibri_core.testing.mamba import param


@dataclass
class LightningShape:
    hidden: int = 32
    heads: int = 4
    head_dim: int = 8
    block: int = 8
    layer: int = 1
    layers: int = 4

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def slopes(self) -> np.ndarray:
        return lightning_slopes(self.heads, self.layer, self.layers)


def random_weights(shape: LightningShape, seed: int) -> dict[str, np.ndarray]:
    """Host float32 weights of a lightning attention layer, as a checkpoint stores them."""
    rng = np.random.default_rng(seed)
    s = shape

    def normal(*dims, scale=1.0):
        return (rng.standard_normal(dims) * scale).astype(np.float32)

    return {
        "qkv_proj": normal(3 * s.inner, s.hidden, scale=s.hidden**-0.5),
        "output_gate": normal(s.inner, s.hidden, scale=s.hidden**-0.5),
        "norm": 1.0 + normal(s.inner, scale=0.2),
        "out_proj": normal(s.hidden, s.inner, scale=s.inner**-0.5),
    }


def build_mixer(ops, shape: LightningShape, w: dict[str, np.ndarray], layer: int = 0) -> LightningAttention:
    """A ``LightningAttention`` at cache index ``layer`` on backend ``ops`` with weights
    ``w`` (its decay rates those of ``shape.layer`` of ``shape.layers``)."""
    s = shape

    def linear(name):
        return Linear(param(ops, w[name], "linear"))

    return LightningAttention(layer=layer, qkv_proj=linear("qkv_proj"), output_gate=linear("output_gate"),
                              norm=RMSNorm(param(ops, w["norm"]), NORM_EPS), out_proj=linear("out_proj"),
                              slopes=s.slopes, n_heads=s.heads, head_dim=s.head_dim, block_size=s.block)


def reference_lightning(shape: LightningShape, w: dict[str, np.ndarray], x: np.ndarray,
                        kv: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The layer over positions ``x`` (T, hidden) from state ``kv`` (H, D, D), position by
    position in float64. Returns the output (T, hidden) and the new state, float32."""
    s = shape
    f = {k: v.astype(np.float64) for k, v in w.items()}
    h, d = s.heads, s.head_dim
    x64 = x.astype(np.float64)
    qkv = x64 @ f["qkv_proj"].T
    qkv = (qkv / (1.0 + np.exp(-qkv))).reshape(len(x), h, 3, d)  # silu
    decay = np.exp(-s.slopes.astype(np.float64)).reshape(h, 1, 1)
    state = kv.astype(np.float64).copy()
    outs = []
    for t in range(len(x)):
        q, k, v = qkv[t, :, 0], qkv[t, :, 1], qkv[t, :, 2]  # (H, D) each
        state = decay * state + k[:, :, None] * v[:, None, :]
        outs.append(np.einsum("hd,hde->he", q, state).reshape(-1))
    o = np.stack(outs)
    normed = o / np.sqrt((o**2).mean(-1, keepdims=True) + NORM_EPS) * f["norm"]
    gate = 1.0 / (1.0 + np.exp(-(x64 @ f["output_gate"].T)))
    return ((normed * gate) @ f["out_proj"].T).astype(np.float32), state.astype(np.float32)


class LightningChecks:
    """Mixed into a ``FamilyOracleSuite`` of a model with lightning attention layers
    (MiniMax-Text-01 / M1): every such layer of the model computes the same fed at once
    or in pieces (blocks, chunks and single tokens)."""

    def test_lightning_layer_in_pieces_matches_at_once(self, case_name, tmp_path_factory):
        import colibri_core

        fx = self._fixture(case_name, tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            assert check_lightning_in_pieces(model)


def check_lightning_in_pieces(model) -> list:
    """``colibri_core.testing.deltanet.check_layers_in_pieces`` for lightning attention:
    outputs within 1e-5, the state within 1e-5 of its largest entry (at least 1e-5). The
    state sums k^T v over every position, barely decayed in the last layers (their rates
    shrink to 1e-5 of the first's), so it grows with the sequence, and the block form sums
    in another order than the stepwise one: float32 rounding relative to its size."""
    from colibri_core.testing.deltanet import PIECES, POSITIONS, run_layer

    lm, ops = model.lm, model.backend
    rng = np.random.default_rng(0)
    layers = [(i, layer.attn) for i, layer in enumerate(lm.layers) if isinstance(layer.attn, LightningAttention)]
    assert layers
    for i, layer in layers:
        x = rng.standard_normal((POSITIONS, lm.embed.weight.value.shape[1])).astype(np.float32)
        whole, whole_state = run_layer(layer, i, x, [POSITIONS], ops, len(lm.layers))
        pieces, piece_state = run_layer(layer, i, x, PIECES, ops, len(lm.layers))
        assert np.abs(whole - pieces).max() < 1e-5, f"layer {i}: outputs"
        a, b = ops.to_host(whole_state["kv"]), ops.to_host(piece_state["kv"])
        assert np.abs(a - b).max() < 1e-5 * max(1.0, float(np.abs(a).max())), f"layer {i}: kv state"
        assert whole_state.length == piece_state.length == POSITIONS
    return [layer for _, layer in layers]
