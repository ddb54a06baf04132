"""Short causal convolutions with a residual (Inkling): y = x + conv(x), a depthwise
causal conv1d over time (``Backend.causal_conv1d``) whose last K-1 inputs are per-sequence
state, a ``RecurrentState`` in the layer's ``LayerStates`` under the block's slot name.

Inkling runs four per layer: on the keys and values inside attention (``k_sconv``,
``v_sconv``) and on the outputs of the attention and MLP branches (``attn_sconv``,
``mlp_sconv``, as a ``DecoderLayer``'s ``attn_post`` / ``mlp_post``). A branch output
covers the rows of every sequence of a batched step: each sequence's rows go through
the conv with its own state.

LFM2's gated short convolution (``GatedShortConv``) is a token mixer of its own, in place
of attention: its conv state is the layer's whole state."""

from __future__ import annotations

from colibri_core.nn.cache import RecurrentState
from colibri_core.nn.layers import Step
from colibri_core.nn.weights import Param


class ShortConv:
    """x + causal_conv1d(x) over C channels with a (C, K) filter ``weight``; state slot
    ``slot`` of layer ``layer``."""

    def __init__(self, layer: int, slot: str, weight: Param):
        self.layer, self.slot, self.weight = layer, slot, weight

    @property
    def channels(self) -> int:
        return self.weight.shape[0]

    @property
    def kernel(self) -> int:
        return self.weight.shape[-1]

    def state_slots(self, backend, max_len: int) -> dict:
        return {self.slot: RecurrentState(backend, {"conv": (self.kernel - 1, self.channels)})}

    def __call__(self, x, step: Step):
        if step.segments is None:
            return self._one(x, step)
        parts = [self._one(x[a:b], seg) for seg, (a, b) in zip(step.segments, step.rows)]
        return parts[0] if len(parts) == 1 else step.ops.concat(parts, 0)

    def _one(self, x, step: Step):
        state: RecurrentState = step.cache.layers[self.layer][self.slot]
        out, conv = step.ops.causal_conv1d(x, self.weight.value, state["conv"])
        state.update(x.shape[0], conv=conv)
        return x + out


class GatedShortConv:
    """LFM2's short-convolution token mixer: B, C, h = in_proj(x) (its thirds, in that
    order), y = C * (conv(B * h) + bias), out = out_proj(y); conv a depthwise causal conv1d
    over time with a (C, K) filter ``weight``, whose last K-1 inputs are the layer's
    per-sequence state (a ``RecurrentState``, the layer's whole state)."""

    def __init__(self, layer: int, in_proj, weight: Param, out_proj, bias: Param | None = None):
        self.layer, self.in_proj, self.weight, self.out_proj, self.bias = layer, in_proj, weight, out_proj, bias

    @property
    def channels(self) -> int:
        return self.weight.shape[0]

    @property
    def kernel(self) -> int:
        return self.weight.shape[-1]

    def new_state(self, backend, max_len: int) -> RecurrentState:
        return RecurrentState(backend, {"conv": (self.kernel - 1, self.channels)})

    def __call__(self, x, step: Step):
        return self.out_proj(self._one(self.in_proj(x, step), step), step)

    def batched(self, x, step: Step):
        """A batched step: the projections on all rows, the convolution per sequence."""
        bcx = self.in_proj(x, step)
        parts = [self._one(bcx[a:b], seg) for seg, (a, b) in zip(step.segments, step.rows)]
        return self.out_proj(parts[0] if len(parts) == 1 else step.ops.concat(parts, 0), step)

    def _one(self, bcx, step: Step):
        c = self.channels
        state: RecurrentState = step.cache.layers[self.layer]
        out, conv = step.ops.causal_conv1d(bcx[:, :c] * bcx[:, 2 * c :], self.weight.value, state["conv"])
        state.update(bcx.shape[0], conv=conv)
        if self.bias is not None:
            out = out + self.bias.value
        return bcx[:, c : 2 * c] * out
