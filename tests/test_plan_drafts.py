"""colibri plan's projection of speculative decoding: what a step verifying k drafts
costs in plain steps, the acceptance above which it pays, the speed-up at a given one."""

import json

import pytest

from colibri_core.cli.demo import DemoSpec
from colibri_core.cli.plan import break_even_acceptance, draft_projection, expected_tokens
from colibri_core.testing.cli import run_colibri

SPEC = DemoSpec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts=16, num_experts_per_tok=2,
                intermediate_size=16, tokenizer_vocab=300)


def test_expected_tokens_of_a_verification():
    assert expected_tokens(0.0, 4) == 1.0  # the first draft wrong: the verification still gives one token
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


@pytest.mark.parametrize("ratio,k", [(1.2, 1), (1.9, 2), (3.5, 4)])
def test_the_break_even_acceptance_gives_as_many_tokens_as_the_step_costs(ratio, k):
    a = break_even_acceptance(ratio, k)
    assert 0 < a < 1 and expected_tokens(a, k) == pytest.approx(ratio, rel=1e-9)
    assert break_even_acceptance(k + 1.0, k) is None  # a step costing k + 1 plain steps never pays


def test_union_reads_and_row_costs_raise_the_break_even():
    base = dict(dense_s=1.0, experts_s=1.0, upload_s=0.0, prefetch=False, experts=64, top_k=4)
    free_rows = draft_projection(disk_s=0.0, row_cost=0.0, **base)
    costly_rows = draft_projection(disk_s=0.0, row_cost=1.0, **base)
    streaming = draft_projection(disk_s=4.0, row_cost=0.0, **base)
    for a, b, c in zip(free_rows, costly_rows, streaming):
        assert 1.0 < a["cost_ratio"] < b["cost_ratio"] and a["cost_ratio"] < c["cost_ratio"]
        assert a["break_even_acceptance"] < c["break_even_acceptance"]
    # deeper drafts cost more per step
    assert [r["cost_ratio"] for r in streaming] == sorted(r["cost_ratio"] for r in streaming)
    # every row a step of its own (no weight shared), no expert shared: drafts never pay
    alone = draft_projection(disk_s=0.0, row_cost=1.0, dense_s=1.0, experts_s=0.0, upload_s=0.0, prefetch=False,
                             experts=0, top_k=0)
    assert all(r["break_even_acceptance"] is None for r in alone)


def test_colibri_plan_projects_drafts_at_a_given_acceptance(demo_model):
    out = run_colibri("plan", "--model", str(demo_model), "--json", "--disk-bw", "1G", "--draft-acceptance", "0.7")
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["draft_projection"]
    assert [r["depth"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert r["speedup"]["0.7"] == pytest.approx(expected_tokens(0.7, r["depth"]) / r["cost_ratio"])
    text = run_colibri("plan", "--model", str(demo_model), "--disk-bw", "1G")
    assert "drafts (projected)" in text.stdout and "depth 4: a step costs" in text.stdout
    bad = run_colibri("plan", "--model", str(demo_model), "--draft-acceptance", "1.5")
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --draft-acceptance must be from 0 to 1, got 1.5"
