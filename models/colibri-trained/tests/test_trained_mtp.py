"""The trained DeepSeek-V3-shaped model's MTP layer as a draft source: its logits against
the torch module it was trained as (benchmarks/train), its drafts' acceptance on held-out
text, tokens unchanged by drafting, and the int8 rule in convert and at load."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import colibri_core
from colibri_core.errors import UsageError
from colibri_core.model.blueprint import inspect_model
from colibri_core.testing.mtp import mtp_logits

colibri_trained = pytest.importorskip("colibri_trained", reason="colibri-trained is not installed")

TRAIN = Path(__file__).resolve().parents[3] / "benchmarks" / "train"
HELD_OUT = ("python", "c", "prose")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("trained") / "deepseek_v3"  # tests must not write into the installed model
    shutil.copytree(colibri_trained.path("deepseek_v3"), copy)
    return copy


def held_out(model_dir: Path, domain: str, tokens: int) -> list[int]:
    from tokenizers import Tokenizer

    text = (model_dir / "heldout" / f"{domain}.txt").read_text()
    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids[:tokens]


def test_mtp_logits_are_the_trained_modules(trained):
    """The torch reference is the module training optimised (``benchmarks/train/models.py``),
    read back by training's own loader."""
    import torch

    sys.path.insert(0, str(TRAIN))
    try:
        from train import forward_with_mtp, load_saved
    finally:
        sys.path.remove(str(TRAIN))
    model, mtp = load_saved(trained)
    ids = held_out(trained, "python", 48)
    with torch.no_grad():
        _, reference = forward_with_mtp(model, mtp, torch.tensor([ids]))
    with colibri_core.load(trained, history=False, mtp=True) as ours:
        np.testing.assert_allclose(mtp_logits(ours, ids), reference[0].numpy(), atol=1e-4, rtol=1e-4)


def test_mtp_drafts_are_accepted_and_change_no_token(trained):
    """Training measured the MTP layer agreeing with the main model's next-but-one token
    63-88% of the time; the drafts verified here must keep most of that."""
    with colibri_core.load(trained, history=False, mtp=True) as model:
        for domain in HELD_OUT:
            prompt = held_out(trained, domain, 40)
            off = model.generate(token_ids=prompt, max_tokens=32, ignore_eos=True)
            for depth in (1, 3):
                drafted = model.generate(token_ids=prompt, max_tokens=32, ignore_eos=True, draft="mtp", draft_depth=depth)
                assert drafted.token_ids == off.token_ids, (domain, depth)
                s = drafted.stats
                assert s.draft_source == "mtp" and s.drafted_tokens > 0
                if depth == 1:
                    assert s.draft_acceptance >= 0.5, (domain, s.draft_acceptance)
                assert s.tokens_per_forward > 1.3, (domain, depth, s.tokens_per_forward)
            sampled = dict(temperature=0.8, top_p=0.95, seed=7)
            a = model.generate(token_ids=prompt, max_tokens=24, ignore_eos=True, **sampled)
            b = model.generate(token_ids=prompt, max_tokens=24, ignore_eos=True, draft="mtp", draft_depth=2, **sampled)
            assert a.token_ids == b.token_ids


def test_mtp_needs_loading_and_a_model_that_has_one(trained):
    with colibri_core.load(trained, history=False) as model:
        with pytest.raises(UsageError, match="loaded without its multi-token-prediction layers"):
            model.generate(token_ids=[1, 2, 3], max_tokens=2, draft="mtp")
    olmoe = colibri_trained.path("olmoe")
    with pytest.raises(UsageError, match="no multi-token-prediction layers"):
        colibri_core.load(olmoe, history=False, mtp=True)


def test_convert_keeps_the_mtp_layer_int8_and_load_refuses_it_in_4_bits(trained, tmp_path):
    from colibri_core.cli.convert import convert

    out = tmp_path / "int4"
    result = convert(trained, out, experts="int4")
    assert any("multi-token-prediction layer are int8-row" in note for note in result.notes)
    bp = inspect_model(out, mtp=True)
    try:
        n = bp.config["num_hidden_layers"]
        stored = {layer: {bp.resolver.format_for(i).name for d in bp.moe if (d.layer == n) == layer
                          for i in d.matrices[0].values()} for layer in (True, False)}
    finally:
        bp.close()
    assert stored == {True: {"int8-row"}, False: {"int4-gs64"}}  # the MTP layer's experts, the model's
    with colibri_core.load(out, history=False, mtp=True) as model:
        drafted = model.generate(token_ids=held_out(trained, "python", 40), max_tokens=16, ignore_eos=True,
                                 draft="mtp", draft_depth=1)
        assert drafted.stats.draft_acceptance >= 0.5
        assert len(model.lm.mtp) == 1 and model.lm.mtp[0].index == n

    # the same layer in 4 bits: a conversion that took it for a decoder layer of the model
    deeper = tmp_path / "deeper"
    shutil.copytree(trained, deeper)
    config = json.loads((deeper / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps(config | {"num_hidden_layers": n + 1, "num_nextn_predict_layers": 0}))
    four = tmp_path / "int4-mtp"
    convert(deeper, four, experts="int4")
    (four / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=r"'model.layers.6.mlp.experts.0.gate_proj.weight' of the multi-token-prediction layer is "
                       r"stored as int4-gs64 \(4-bit\).*force it with mtp_int4"):
        colibri_core.load(four, history=False, mtp=True)
    with colibri_core.load(four, history=False, mtp=True, mtp_int4=True) as model:
        assert model.generate(token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True, draft="mtp").stats.drafted_tokens


def test_auto_drafts_with_the_mtp_layer_where_the_model_has_one(trained):
    with colibri_core.load(trained, history=False, mtp="if-usable") as model:
        assert len(model.lm.mtp) == 1
        prompt = held_out(trained, "python", 40)
        off = model.generate(token_ids=prompt, max_tokens=32, ignore_eos=True)
        auto = model.generate(token_ids=prompt, max_tokens=32, ignore_eos=True, draft="auto", draft_depth=2)
    assert auto.token_ids == off.token_ids and auto.stats.draft_source == "auto (mtp)"
    assert auto.stats.drafted_tokens + auto.stats.draft_gated_steps > 0  # verified, or scored in the shadow
    with colibri_core.load(colibri_trained.path("olmoe"), history=False, mtp="if-usable") as model:
        assert not model.lm.mtp  # none in the checkpoint: loaded without, auto is prompt lookup
        assert model.generate(token_ids=[5, 6, 7], max_tokens=4, draft="auto").stats.draft_source == "auto (ngram)"
