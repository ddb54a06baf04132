"""A host reference of the Mamba-2 mixer (``colibri_core.nn.mamba.Mamba2Mixer``) and a way
to build one with random weights on any backend, for tests.

``reference_mamba2`` is the plain recurrence, one position after another, in float64
numpy, written from transformers' Mamba-2 mixers (modeling_nemotron_h /
modeling_granitemoehybrid, torch_forward): in_proj -> [z | x, B, C | dt]; depthwise causal
conv1d (+ bias) and silu over [x, B, C]; dt = softplus(dt + dt_bias), clamped to
``dt_limit`` where transformers' chunked scan clamps it (a prompt), not in its stepwise
update (a decoded token); per head S = exp(dt A) S + dt x B^T, y = S C + D x; then
out_proj(grouped_rms_norm(y * silu(z)) * w).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from colibri_core.nn.layers import Linear
from colibri_core.nn.mamba import Mamba2Mixer
from colibri_core.nn.weights import Param
from colibri_core.testing import memory_param


@dataclass
class MambaShape:
    hidden: int = 32
    heads: int = 4
    head_dim: int = 8
    groups: int = 2
    state: int = 16
    kernel: int = 4
    chunk: int = 8
    eps: float = 1e-5
    conv_bias: bool = True
    proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, math.inf)

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state


def random_weights(shape: MambaShape, seed: int) -> dict[str, np.ndarray]:
    """Host float32 weights of a Mamba-2 mixer, as a checkpoint stores them (conv1d
    (C, 1, K), A_log) but with a (C, K) conv; dt_bias spread so that dt covers a range."""
    rng = np.random.default_rng(seed)
    s = shape

    def normal(*dims, scale=1.0):
        return (rng.standard_normal(dims) * scale).astype(np.float32)

    w = {
        "in_proj": normal(2 * s.inner + 2 * s.groups * s.state + s.heads, s.hidden, scale=s.hidden**-0.5),
        "conv": normal(s.conv_dim, s.kernel, scale=0.5),
        "dt_bias": np.linspace(-4.0, 1.0, s.heads).astype(np.float32),
        "A_log": np.log(np.arange(1, s.heads + 1, dtype=np.float32)) + normal(s.heads, scale=0.1),
        "D": 1.0 + normal(s.heads, scale=0.2),
        "norm": 1.0 + normal(s.inner, scale=0.2),
        "out_proj": normal(s.hidden, s.inner, scale=s.inner**-0.5),
    }
    if s.conv_bias:
        w["conv_bias"] = normal(s.conv_dim, scale=0.2)
    if s.proj_bias:
        w["in_proj_bias"] = normal(w["in_proj"].shape[0], scale=0.2)
        w["out_proj_bias"] = normal(s.hidden, scale=0.2)
    return w


def param(ops, value: np.ndarray, use: str = "array") -> Param:
    """A Param holding ``value`` prepared by backend ``ops`` (as a model load would)."""
    return memory_param(value, lambda v: ops.prepare_weight(v, use))


def build_mixer(ops, shape: MambaShape, w: dict[str, np.ndarray], layer: int = 0) -> Mamba2Mixer:
    """A ``Mamba2Mixer`` of layer ``layer`` on backend ``ops`` with weights ``w``."""
    s = shape

    def linear(name):
        bias = w.get(f"{name}_bias")
        return Linear(param(ops, w[name], "linear"), None if bias is None else param(ops, bias))

    return Mamba2Mixer(layer=layer, in_proj=linear("in_proj"), conv_weight=param(ops, w["conv"]),
                       conv_bias=param(ops, w["conv_bias"]) if "conv_bias" in w else None,
                       dt_bias=param(ops, w["dt_bias"]), a_neg=param(ops, -np.exp(w["A_log"])), d=param(ops, w["D"]),
                       norm_weight=param(ops, w["norm"]), out_proj=linear("out_proj"), n_heads=s.heads,
                       head_dim=s.head_dim, n_groups=s.groups, state_size=s.state, eps=s.eps, chunk_size=s.chunk,
                       dt_limit=s.dt_limit)


def reference_mamba2(shape: MambaShape, w: dict[str, np.ndarray], x: np.ndarray, conv: np.ndarray, ssm: np.ndarray,
                     clamp: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The mixer over positions ``x`` (T, hidden) from state (``conv`` (K-1, C), ``ssm``
    (H, P, N)), position by position in float64; ``clamp``: dt clamped to ``dt_limit``
    (transformers' chunked scan) or not (its stepwise update). Returns the output (T,
    hidden) and the new conv and ssm states, float32."""
    s = shape
    f = {k: v.astype(np.float64) for k, v in w.items()}
    h, p, g, n, r = s.heads, s.head_dim, s.groups, s.state, s.heads // s.groups
    proj = x.astype(np.float64) @ f["in_proj"].T + f.get("in_proj_bias", 0.0)
    z, xbc, dt = proj[:, : s.inner], proj[:, s.inner : s.inner + s.conv_dim], proj[:, s.inner + s.conv_dim :]
    full = np.concatenate([conv.astype(np.float64), xbc])
    conv_out = np.stack([(full[t : t + s.kernel] * f["conv"].T).sum(0) for t in range(len(x))]) + f.get("conv_bias", 0.0)
    xbc = conv_out / (1.0 + np.exp(-conv_out))  # silu
    dt = np.logaddexp(0.0, dt + f["dt_bias"])  # softplus
    if clamp:
        dt = np.clip(dt, s.dt_limit[0], s.dt_limit[1])
    a = -np.exp(f["A_log"])
    state = ssm.astype(np.float64).copy()
    ys = []
    for t in range(len(x)):
        xt = xbc[t, : s.inner].reshape(h, p)
        bt = xbc[t, s.inner : s.inner + g * n].reshape(g, n)
        ct = xbc[t, s.inner + g * n :].reshape(g, n)
        y = np.empty((h, p))
        for head in range(h):
            grp = head // r
            state[head] = np.exp(dt[t, head] * a[head]) * state[head] + dt[t, head] * np.outer(xt[head], bt[grp])
            y[head] = state[head] @ ct[grp] + f["D"][head] * xt[head]
        ys.append(y.reshape(-1))
    y = np.stack(ys) * (z / (1.0 + np.exp(-z)))
    grouped = y.reshape(len(x), g, s.inner // g)
    grouped = grouped / np.sqrt((grouped**2).mean(-1, keepdims=True) + s.eps)
    out = (grouped.reshape(len(x), s.inner) * f["norm"]) @ f["out_proj"].T + f.get("out_proj_bias", 0.0)
    return out.astype(np.float32), full[len(x) :].astype(np.float32), state.astype(np.float32)


class Mamba2Checks:
    """Mixed into a ``FamilyOracleSuite`` of a model with Mamba-2 layers (Nemotron-H,
    Granite 4). The suite's pieces check runs with the dt limits lifted: transformers
    applies them in the chunked form only, so where they bind a token decoded alone
    differs from the same token in a chunk by design, while the recurrence must agree.
    Whole-model logits in pieces are held to 1e-4: the gated grouped RMSNorm divides each
    group by its small rms and later layers amplify the two forms' rounding; each mixer
    itself to 1e-5 (``check_layers_in_pieces``)."""

    pieces_tolerance = 1e-4

    def test_prompt_in_pieces_matches_prompt_at_once(self, backend, case_name, tmp_path_factory, monkeypatch):
        monkeypatch.setattr(Mamba2Mixer, "_clamped", lambda self, dt, ops: dt)
        super().test_prompt_in_pieces_matches_prompt_at_once(backend, case_name, tmp_path_factory)

    def test_mamba_layer_in_pieces_matches_at_once(self, case_name, tmp_path_factory, monkeypatch):
        """Every Mamba-2 layer computes the same fed at once or in pieces (chunks and
        single tokens), the dt limits lifted."""
        import colibri_core
        from colibri_core.testing.deltanet import check_layers_in_pieces

        monkeypatch.setattr(Mamba2Mixer, "_clamped", lambda self, dt, ops: dt)
        fx = self._fixture(case_name, tmp_path_factory)
        with colibri_core.load(fx.path, history=False) as model:
            assert check_layers_in_pieces(model, Mamba2Mixer)
