"""The backend conformance kit on the backends colibri ships (CPU with and without its
kernels, the reference) and on "boxed", a backend offering the contract and nothing
more; the boxed backend's arrays refuse everything beyond the array protocol; and
deliberately broken backends fail the kit's checks."""

import numpy as np
import pytest

import boxed_backend
from boxed_backend import Box, BoxedBackend, ProtocolError
from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.compute.reference import ReferenceBackend
from colibri_core.plugins.discovery import create_backend, get_registry
from colibri_core.testing import registered_plugin
from colibri_core.testing.backend_kit import BackendConformanceSuite


class TestCpuBackend(BackendConformanceSuite):
    def make_backend(self):
        return CpuBackend()


class TestCpuBackendWithoutKernels(BackendConformanceSuite):
    def make_backend(self):
        return CpuBackend(kernels=False)


class TestReferenceBackend(BackendConformanceSuite):
    def make_backend(self):
        return ReferenceBackend()


class TestBoxedBackend(BackendConformanceSuite):
    def make_backend(self):
        return BoxedBackend()


def test_boxed_registers_as_a_backend():
    with registered_plugin(boxed_backend, "boxed-backend"):
        backend = create_backend(get_registry(), "boxed")
    assert isinstance(backend, BoxedBackend)


@pytest.mark.parametrize("misuse", [
    pytest.param(lambda x: np.asarray(x), id="np.asarray"),
    pytest.param(lambda x: np.exp(x), id="numpy-function"),
    pytest.param(lambda x: x * np.float32(2.0), id="numpy-scalar-operand"),
    pytest.param(lambda x: np.float64(2.0) + x, id="numpy-scalar-left"),
    pytest.param(lambda x: x + np.ones(3, np.float32), id="host-array-operand"),
    pytest.param(lambda x: x[np.array([0, 1])], id="fancy-index"),
    pytest.param(lambda x: x[np.int64(0)], id="numpy-int-index"),
    pytest.param(lambda x: x.astype("float32"), id="astype"),
    pytest.param(lambda x: x.nbytes, id="nbytes"),
    pytest.param(lambda x: list(x), id="iteration"),
    pytest.param(lambda x: bool(x), id="truth"),
    pytest.param(lambda x: x.reshape(np.int64(3), 3), id="numpy-int-shape"),
])
def test_boxes_refuse_what_the_protocol_does_not_offer(misuse):
    x = BoxedBackend().asarray(np.ones((3, 3), np.float32))
    with pytest.raises((ProtocolError, TypeError, AttributeError)):
        misuse(x)


def test_boxed_ops_refuse_host_arrays_for_backend_arrays():
    backend = BoxedBackend()
    with pytest.raises(ProtocolError):
        backend.silu(np.ones(3, np.float32))
    with pytest.raises(ProtocolError):
        backend.take_rows(backend.asarray(np.ones((3, 2), np.float32)), Box(np.zeros(1, np.int64)))


# -- the kit fails backends that break the contract ----------------------------------------
class WrongSoftmax(ReferenceBackend):
    def softmax(self, x):
        return super().softmax(x * 0.9)


class NoCausalMask(ReferenceBackend):
    def attention(self, q, k, v, start, scale):
        return super().attention(q, k, v, k.shape[1] - 1, scale)  # every query sees every key


class TiesToHigherIndex(ReferenceBackend):
    def top_k(self, scores, k):
        flipped = scores[:, ::-1]
        return (scores.shape[1] - 1 - super().top_k(flipped, k)).astype(np.int64)


class FetchPerToken(ReferenceBackend):
    def routed_experts(self, x, indices, weights, fetch, window=8, ready=None):
        out = self.zeros(tuple(x.shape))
        for t in range(indices.shape[0]):
            for e, w in zip(indices[t], weights[t]):
                m = fetch(int(e))
                out[t] += w * self.swiglu_expert(x[t : t + 1], m["gate"], m["up"], m["down"])[0]
        return out


class ChannelDecayIgnored(ReferenceBackend):
    def gated_delta_channel_chunked(self, q, k, v, g, beta, state, chunk_size):
        first = np.repeat(g[..., :1], g.shape[-1], axis=-1)  # one decay per head: channel 0's
        return super().gated_delta_channel_chunked(q, k, v, first, beta, state, chunk_size)


class DecayAfterTheRead(ReferenceBackend):
    def gated_delta_channel_step(self, q, k, v, g, beta, state):  # S decays after k^T S is read
        outs = []
        for t in range(q.shape[0]):
            read = np.einsum("hk,hkv->hv", k[t], state)
            state = state * np.exp(g[t])[..., None]
            state = state + k[t][..., None] * ((v[t] - read) * beta[t][:, None])[:, None, :]
            outs.append(np.einsum("hk,hkv->hv", q[t], state))
        return np.stack(outs), state


class BiasProfileReversed(ReferenceBackend):
    def attention_relative_bias(self, q, k, v, start, scale, rel, table, window=None):  # distance counted from the far end
        return super().attention_relative_bias(q, k, v, start, scale, rel, np.ascontiguousarray(table[:, ::-1]), window)


class WindowOneTooWide(ReferenceBackend):
    def attention_relative_bias(self, q, k, v, start, scale, rel, table, window=None):
        return super().attention_relative_bias(q, k, v, start, scale, rel, table, None if window is None else window + 1)


class SinksIgnored(ReferenceBackend):
    def windowed_attention(self, q, k, v, start, scale, window=None, sinks=None):
        return super().windowed_attention(q, k, v, start, scale, window, None)


class WindowOneWider(ReferenceBackend):
    def windowed_attention(self, q, k, v, start, scale, window=None, sinks=None):
        return super().windowed_attention(q, k, v, start, scale, None if window is None else window + 1, sinks)


class OneSidedClamps(ReferenceBackend):  # gate unclamped, up clamped above only
    def gated_activation(self, gate, up, act):
        if act.limit is None:
            return super().gated_activation(gate, up, act)
        return super().gated_activation(gate, np.minimum(up, np.float32(act.limit)), type(act)(act.alpha, None, act.up_offset))


class DownBiasDropped(ReferenceBackend):
    def glu_expert(self, x, w, act):
        return super().glu_expert(x, {r: a for r, a in w.arrays.items() if r != "down_bias"}, act)


class Kit(BackendConformanceSuite):  # not collected: the checks are called directly below
    pass


@pytest.mark.parametrize("broken, check, args, message", [
    (WrongSoftmax, "test_elementwise", {"op": "softmax"}, "softmax: off by"),
    (NoCausalMask, "test_attention", {"group": 2, "step": "prefill"}, "attention"),
    (TiesToHigherIndex, "test_top_k", {"ties": True}, "top_k indices"),
    (FetchPerToken, "test_routed_experts", {"kind": "f32", "tokens": 3}, "each expert once, ascending"),
    (ChannelDecayIgnored, "test_gated_delta_channel_chunked", {"chunk": 5, "rep": 1}, "gated_delta_channel_chunked"),
    (DecayAfterTheRead, "test_gated_delta_channel_step_equals_chunked", {"rep": 1}, "gated_delta_channel_step"),
    (SinksIgnored, "test_windowed_attention", {"group": 4, "step": "chunk", "window": None, "sinks": True},
     "windowed_attention"),
    (WindowOneWider, "test_windowed_attention", {"group": 1, "step": "prefill", "window": 3, "sinks": False},
     "windowed_attention"),
    (OneSidedClamps, "test_gated_activation", {}, "gated_activation"),
    (DownBiasDropped, "test_routed_glu_experts", {"kind": "f32", "tokens": 5, "layout": "fused"},
     "routed_glu_experts"),
    (BiasProfileReversed, "test_attention_relative_bias", {"group": 1, "step": "chunk", "window": None},
     "attention_relative_bias"),
    (WindowOneTooWide, "test_attention_relative_bias", {"group": 4, "step": "decode", "window": 3},
     "attention_relative_bias"),
])
def test_the_kit_fails_a_broken_backend(broken, check, args, message):
    getattr(Kit(), check)(ReferenceBackend(), **args)  # the check passes on the reference
    with pytest.raises(AssertionError, match=message):
        getattr(Kit(), check)(broken(), **args)
