"""Teacher-forced scoring (colibri_core/engine/perplexity.py, ``colibri eval``) against
transformers' own cross-entropy on the same windows, the same under every placement, and
the comparison of a model with itself and with another."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

import colibri_core
from colibri_core.engine import perplexity as ppl
from colibri_core.errors import UsageError
from colibri_core.testing import tiny_models
from colibri_core.testing.cli import run_colibri

pytest.importorskip("transformers")


def tiny(name: str, tmp_path_factory):
    reason = tiny_models.missing(name)
    if reason:
        pytest.skip(reason)
    return tiny_models.model_dir(name, tmp_path_factory)


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return tiny("olmoe", tmp_path_factory)


def ids(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(1, tiny_models.VOCAB, size=n).tolist()


def transformers_nll(path, wins) -> float:
    import torch
    import transformers

    model = transformers.OlmoeForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    total = 0.0
    with torch.no_grad():
        for w in wins:
            x = torch.tensor([w.tolist()])
            logits = model(x).logits[0, :-1].double()
            total += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
    return total


def test_perplexity_matches_transformers_cross_entropy(olmoe):
    wins = ppl.windows(ids(150), 32)
    assert [len(w) for w in wins] == [32, 32, 32, 32, 22]
    with colibri_core.load(olmoe, history=False) as model:
        score = ppl.score(model, wins, batch=3)
    assert score.tokens == 150 - len(wins) and score.windows == 5
    reference = transformers_nll(olmoe, wins)
    assert abs(score.nll - reference) < 1e-3 * score.tokens
    assert math.isclose(score.perplexity, math.exp(reference / score.tokens), rel_tol=1e-3)


def test_placement_does_not_change_the_numbers(olmoe):
    wins = ppl.windows(ids(200, seed=1), 40)
    nll = set()
    for options in ({}, {"cap": 1}, {"cap": 3, "prefetch": True}):
        with colibri_core.load(olmoe, history=False, **options) as model:
            nll.add(ppl.score(model, wins, batch=4).nll)
    assert len(nll) == 1, nll


def test_a_model_against_itself_agrees_fully_and_against_another_does_not(olmoe, tmp_path_factory):
    wins = ppl.windows(ids(120, seed=2), 30)
    other = tiny("demo_int4", tmp_path_factory)
    with colibri_core.load(olmoe, history=False) as a, colibri_core.load(olmoe, history=False, cap=1) as b:
        same = ppl.compare(a, b, wins, batch=2)
        assert same.kl == pytest.approx(0.0, abs=1e-12) and same.top1_agreement == 1.0
        assert same.model.nll == same.reference.nll
        with colibri_core.load(other, history=False) as c:
            with pytest.raises(UsageError, match="vocabularies differ"):
                ppl.compare(a, c, wins)


def test_windows_and_batches_are_checked():
    with pytest.raises(UsageError, match="window"):
        ppl.windows([1, 2, 3], 1)
    assert [w.tolist() for w in ppl.windows([1, 2, 3, 4, 5], 2)] == [[1, 2], [3, 4]]  # [5] predicts nothing
    assert [w.tolist() for w in ppl.windows(range(10), 4, max_tokens=6)] == [[0, 1, 2, 3], [4, 5]]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A tiny demo-shaped model with a tokenizer (int4 experts, int8 dense weights)."""
    return tiny("demo_int4", tmp_path_factory)


SAMPLE = "Once upon a time, a small bird lived at the edge of a great forest. " * 12


def test_the_eval_command_scores_data_files_and_held_out_domains(demo, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(SAMPLE)
    args = ["eval", "--model", demo, "--perplexity", "--window", "64", "--json", "--history", "off"]
    out = run_colibri(*args, "--data", text)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)["results"][str(text)]
    assert result["tokens"] > 0 and result["perplexity"] > 1
    with colibri_core.load(demo, history=False) as model:
        direct = ppl.score(model, ppl.windows(model.encode(SAMPLE), 64, 32768), batch=8)
    assert result["nll"] == direct.nll
    capped = run_colibri(*args, "--data", text, "--cap", "1")
    assert json.loads(capped.stdout)["results"][str(text)]["nll"] == result["nll"]
    # held-out text a model directory carries, and another model as the reference
    model_copy = tmp_path / "model"
    import shutil

    shutil.copytree(demo, model_copy)
    (model_copy / "heldout").mkdir()
    (model_copy / "heldout" / "birds.txt").write_text(SAMPLE)
    compared = run_colibri(*args, "--domain", "birds", "--reference", demo, env={"COLUMNS": "200"})
    assert compared.returncode == 2 and "--domain birds" in compared.stderr  # the first model has no heldout/
    compared = run_colibri("eval", "--model", model_copy, "--perplexity", "--window", "64", "--json", "--history", "off",
                           "--domain", "birds", "--reference", demo)
    assert compared.returncode == 0, compared.stderr
    same = json.loads(compared.stdout)["results"]["birds"]
    assert same["kl"] == pytest.approx(0.0, abs=1e-12) and same["top1_agreement"] == 1.0
    assert same["perplexity"] == pytest.approx(result["perplexity"], rel=1e-12)


def test_the_eval_command_names_what_is_wrong(demo, tmp_path):
    missing = run_colibri("eval", "--model", demo, "--perplexity", "--domain", "python")
    assert missing.returncode == 2 and "--domain python" in missing.stderr and "heldout" in missing.stderr
    nothing = run_colibri("eval", "--model", demo, "--perplexity")
    assert nothing.returncode == 2 and "--data FILE or --domain NAME" in nothing.stderr
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    refused = run_colibri("eval", "--model", demo, "--perplexity", "--data", fifo, timeout=60)
    assert refused.returncode == 2 and "pipe.txt" in refused.stderr
    short = tmp_path / "short.txt"
    short.write_text("a")
    too_short = run_colibri("eval", "--model", demo, "--perplexity", "--data", short)
    assert too_short.returncode == 2 and "too short" in too_short.stderr


def test_convert_report_scores_the_held_out_text_the_source_carries(demo, tmp_path):
    import shutil

    source = tmp_path / "source"
    shutil.copytree(demo, source)
    (source / "heldout").mkdir()
    (source / "heldout" / "birds.txt").write_text(SAMPLE)
    out = run_colibri("convert", "--model", source, "--out", tmp_path / "int8", "--experts", "int8", "--report", "--json",
                      timeout=300)
    assert out.returncode == 0, out.stderr
    heldout = json.loads(out.stdout)["report"]["heldout"]
    assert list(heldout) == ["birds"]
    birds = heldout["birds"]
    with colibri_core.load(source, history=False) as model:
        direct = ppl.score(model, ppl.windows(model.encode(SAMPLE), 256, 8192))
    assert birds["reference_perplexity"] == pytest.approx(direct.perplexity, rel=1e-12)
    assert birds["kl"] >= 0 and 0.5 < birds["top1_agreement"] <= 1
    assert abs(birds["perplexity_delta"]) < 0.05 * birds["reference_perplexity"]


def test_the_held_out_directory_name_is_one_name():
    from colibri_core.cli import evaluate

    assert evaluate.HELDOUT_DIR == ppl.HELDOUT_DIR
