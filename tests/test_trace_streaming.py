"""benchmarks/trace_streaming.py: a trace recorded on colibri-trained's OLMoE-geometry model
holds the routing the model computed, and replayed on a small synthetic checkpoint of the
same geometry (16 MoE layers x 64 experts, top-8) it decides exactly which experts the
store is asked for, prompt and decode alike (without it, the checkpoint's own router
asks for others)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
STEPS = 12  # recorded tokens
PROMPT, DECODE = 4, 6  # replayed: a 4-row prompt, then 5 one-row decode steps (the last token is never run)


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ts():
    return _module("trace_streaming")


@pytest.fixture(scope="module")
def recorded(ts, trained_olmoe, tmp_path_factory):
    out = tmp_path_factory.mktemp("traces")
    ts.main(["record", "--model", str(trained_olmoe), "--domains", "python", "--tokens", str(STEPS), "--out", str(out)])
    return out / "python.npz"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """OLMoE's routing geometry at toy widths: what the trace needs, in a few MB."""
    out = tmp_path_factory.mktemp("tiny") / "olmoe"
    _module("synthetic_olmoe").main(["--out", str(out), "--hidden", "32", "--layers", "16", "--heads", "2",
                                     "--experts", "64", "--top-k", "8", "--intermediate", "16", "--vocab", "8192"])
    return out


def test_the_trace_holds_what_the_model_routed(ts, trained_olmoe, recorded):
    import colibri_core

    trace = ts.Trace.load(recorded)
    m = trace.manifest
    assert (m["domain"], m["tokens"], m["moe_layers"], m["experts"], m["top_k"]) == ("python", STEPS, 16, 64, 8)
    assert m["model_sha256"] == ts.sha256_of(Path(trained_olmoe) / "model.safetensors")
    assert trace.experts.shape == (STEPS, 16, 8) and trace.predicted.shape == (STEPS, 16, 8)
    # the first MoE layer has no predictor; every other layer has a full prediction
    assert (trace.predicted[:, 0] == ts.NO_PREDICTION).all() and (trace.predicted[:, 1:] >= 0).all()
    assert 0 < m["statistics"]["lookahead_precision"] <= 1
    # the routing as colibri reports it itself (forward's ``routing`` list), token by token
    with colibri_core.load(trained_olmoe, history=False) as model:
        cache = model.lm.new_cache(model.backend)
        for t, token in enumerate(trace.tokens):
            routing = []
            model.lm.forward(np.asarray([token]), cache, model.backend, routing=routing)
            assert [sorted(ix[0]) for _, ix in routing] == [sorted(e) for e in trace.experts[t].tolist()], t


def _requests(ts, tiny: Path, trace=None):
    """Run PROMPT trace tokens + DECODE generated ones on ``tiny`` (a small RAM budget,
    prefetch on), the trace installed or not: the store's requests (layer, experts) in order."""
    import colibri_core

    with colibri_core.load(tiny, cap=12, prefetch=True, history=False) as model:
        cursor = ts.install_trace(model, trace) if trace is not None else None
        asked, request = [], model.store.request

        def recording_request(layer, experts):
            asked.append((layer, tuple(int(e) for e in experts)))
            return request(layer, experts)

        model.store.request = recording_request
        prompt = (trace.tokens[:PROMPT] if trace is not None else np.arange(PROMPT) + 100).tolist()
        model.generate(token_ids=prompt, max_tokens=DECODE, ignore_eos=True, temperature=1.0, seed=0)
        return asked, cursor


def test_replayed_requests_are_the_trace(ts, recorded, tiny):
    trace = ts.Trace.load(recorded)
    asked, cursor = _requests(ts, tiny, trace)
    # the prompt's one batch asks for the union of its rows' experts; each decode step for its own
    groups = [slice(0, PROMPT)] + [slice(t, t + 1) for t in range(PROMPT, PROMPT + DECODE - 1)]
    expected = [(layer, tuple(np.unique(trace.experts[rows, layer]).tolist()))
                for rows in groups for layer in range(16)]
    assert asked == expected
    assert cursor.position == PROMPT + DECODE - 1
    # the checkpoint's own router routes elsewhere: the equality above is the trace's doing
    own, _ = _requests(ts, tiny)
    assert own != expected and len(own) == len(expected)


def test_the_child_replays_the_trace_and_counts_the_decode(ts, recorded, tiny):
    result = ts.child({"model": str(tiny), "options": {"prefetch": True, "history": False, "cap": 12},
                       "tokens": DECODE, "prompt_tokens": PROMPT, "seed": 0, "trace": str(recorded)})
    assert result["routing"] == "trace" and result["trace_steps_replayed"] == PROMPT + DECODE - 1
    assert result["decode_lookups"] == (DECODE - 1) * 16 * 8  # one-row steps: top-8 distinct experts per layer
    assert 0 <= result["decode_hit_rate"] <= 1 and result["decode_prefetch_precision"] is not None


def test_a_trace_of_another_geometry_is_refused(ts, recorded, tiny, tmp_path):
    import colibri_core

    trace = ts.Trace.load(recorded)
    trace.manifest = {**trace.manifest, "moe_layers": 12}
    with colibri_core.load(tiny, history=False) as model, pytest.raises(SystemExit, match="geometry"):
        ts.install_trace(model, trace)
    # and a replay past the trace's end stops instead of inventing routing
    trace = ts.Trace.load(recorded)
    with colibri_core.load(tiny, history=False) as model:
        ts.install_trace(model, trace)
        with pytest.raises(RuntimeError, match="the trace ends"):
            model.generate(token_ids=trace.tokens[:PROMPT].tolist(), max_tokens=STEPS, ignore_eos=True)
