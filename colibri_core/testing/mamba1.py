"""A host reference of the Mamba (v1) mixer (``colibri_core.nn.mamba1.Mamba1Mixer``) and a
way to build one with random weights on any backend, for tests.

``reference_mamba1`` is the plain recurrence, one position after another, in float64
numpy, written from transformers' Jamba mixer (modeling_jamba, JambaMambaMixer without
the CUDA kernels: ``mamba_selective_scan`` / ``mamba_selective_state_update``): in_proj
-> [x | z]; depthwise causal conv1d (+ bias) and silu over x; x_proj -> [dt | B | C], each
RMS-normed where the mixer has the norms (Jamba); dt = softplus(dt_proj(dt)) (with its
bias); per channel s = exp(dt A) s + dt x B, y = s . C + D x; then out_proj(y * silu(z)).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from colibri_core.nn.layers import Linear
from colibri_core.nn.mamba1 import Mamba1Mixer
from colibri_core.testing.mamba import param


@dataclass
class Mamba1Shape:
    hidden: int = 24
    inner: int = 48
    state: int = 8
    dt_rank: int = 4
    kernel: int = 4
    block: int = 7
    eps: float = 1e-6
    conv_bias: bool = True
    proj_bias: bool = False
    norms: bool = True  # Jamba's dt / B / C RMS norms


def random_weights(shape: Mamba1Shape, seed: int) -> dict[str, np.ndarray]:
    """Host float32 weights of a Mamba mixer, as a checkpoint stores them (A_log) but with a
    (D, K) conv; dt_proj's bias spread so that dt covers a range."""
    rng = np.random.default_rng(seed)
    s = shape

    def normal(*dims, scale=1.0):
        return (rng.standard_normal(dims) * scale).astype(np.float32)

    w = {
        "in_proj": normal(2 * s.inner, s.hidden, scale=s.hidden**-0.5),
        "conv": normal(s.inner, s.kernel, scale=0.5),
        "x_proj": normal(s.dt_rank + 2 * s.state, s.inner, scale=s.inner**-0.5),
        "dt_proj": normal(s.inner, s.dt_rank, scale=s.dt_rank**-0.5),
        "dt_proj_bias": np.linspace(-4.0, 1.0, s.inner).astype(np.float32),
        "A_log": (np.log(np.tile(np.arange(1, s.state + 1, dtype=np.float32), (s.inner, 1)))
                  + normal(s.inner, s.state, scale=0.1)),
        "D": 1.0 + normal(s.inner, scale=0.2),
        "out_proj": normal(s.hidden, s.inner, scale=s.inner**-0.5),
    }
    if s.conv_bias:
        w["conv_bias"] = normal(s.inner, scale=0.2)
    if s.proj_bias:
        w["in_proj_bias"] = normal(2 * s.inner, scale=0.2)
        w["out_proj_bias"] = normal(s.hidden, scale=0.2)
    if s.norms:
        w["dt_norm"] = 1.0 + normal(s.dt_rank, scale=0.2)
        w["b_norm"] = 1.0 + normal(s.state, scale=0.2)
        w["c_norm"] = 1.0 + normal(s.state, scale=0.2)
    return w


def build_mixer(ops, shape: Mamba1Shape, w: dict[str, np.ndarray], layer: int = 0) -> Mamba1Mixer:
    """A ``Mamba1Mixer`` of layer ``layer`` on backend ``ops`` with weights ``w``."""
    s = shape

    def linear(name):
        bias = w.get(f"{name}_bias")
        return Linear(param(ops, w[name], "linear"), None if bias is None else param(ops, bias))

    def optional(name):
        return param(ops, w[name]) if name in w else None

    return Mamba1Mixer(layer=layer, in_proj=linear("in_proj"), conv_weight=param(ops, w["conv"]),
                       conv_bias=optional("conv_bias"), x_proj=linear("x_proj"), dt_proj=linear("dt_proj"),
                       a_neg=param(ops, -np.exp(w["A_log"])), d=param(ops, w["D"]), out_proj=linear("out_proj"),
                       inner=s.inner, state_size=s.state, dt_rank=s.dt_rank, dt_norm=optional("dt_norm"),
                       b_norm=optional("b_norm"), c_norm=optional("c_norm"), eps=s.eps, block=s.block)


def _rms(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    if weight is None:
        return x
    return weight * (x / np.sqrt((x**2).mean(-1, keepdims=True) + eps))


def reference_mamba1(shape: Mamba1Shape, w: dict[str, np.ndarray], x: np.ndarray, conv: np.ndarray,
                     ssm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The mixer over positions ``x`` (T, hidden) from state (``conv`` (K-1, D), ``ssm``
    (D, N)), position by position in float64. Returns the output (T, hidden) and the new
    conv and ssm states, float32."""
    s = shape
    f = {k: v.astype(np.float64) for k, v in w.items()}
    r, n = s.dt_rank, s.state
    proj = x.astype(np.float64) @ f["in_proj"].T + f.get("in_proj_bias", 0.0)
    xs, z = proj[:, : s.inner], proj[:, s.inner :]
    full = np.concatenate([conv.astype(np.float64), xs])
    conv_out = np.stack([(full[t : t + s.kernel] * f["conv"].T).sum(0) for t in range(len(x))]) + f.get("conv_bias", 0.0)
    xs = conv_out / (1.0 + np.exp(-conv_out))  # silu
    dbc = xs @ f["x_proj"].T
    dt = _rms(dbc[:, :r], f.get("dt_norm"), s.eps)
    b = _rms(dbc[:, r : r + n], f.get("b_norm"), s.eps)
    c = _rms(dbc[:, r + n :], f.get("c_norm"), s.eps)
    dt = np.logaddexp(0.0, dt @ f["dt_proj"].T + f["dt_proj_bias"])  # softplus, (T, D)
    a = -np.exp(f["A_log"])  # (D, N)
    state = ssm.astype(np.float64).copy()
    ys = []
    for t in range(len(x)):
        state = np.exp(dt[t][:, None] * a) * state + (dt[t] * xs[t])[:, None] * b[t][None, :]
        ys.append(state @ c[t] + f["D"] * xs[t])
    y = np.stack(ys) * (z / (1.0 + np.exp(-z)))
    out = y @ f["out_proj"].T + f.get("out_proj_bias", 0.0)
    return out.astype(np.float32), full[len(x) :].astype(np.float32), state.astype(np.float32)


class Mamba1Checks:
    """Mixed into a ``FamilyOracleSuite`` of a model with Mamba (v1) layers (Jamba): every
    Mamba layer computes the same fed at once or in pieces (``check_layers_in_pieces``)."""

    def test_mamba_layer_in_pieces_matches_at_once(self, case_name, tmp_path_factory):
        import colibri_core
        from colibri_core.testing.deltanet import check_layers_in_pieces

        fx = self._fixture(case_name, tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            assert check_layers_in_pieces(model, Mamba1Mixer)
