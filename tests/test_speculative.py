"""Speculative decoding (colibri_core.engine.speculative): prompt lookup drafts, and a
generation that verifies drafts ends exactly where one without them ends. Every family's
oracle suite and the backend kit check the tokens and logits with drafts on."""

import json
import random

import pytest

import colibri_core
from colibri_core.engine.speculative import NgramDrafter
from colibri_core.testing import tiny_models
from colibri_core.testing.cli import run_colibri
from colibri_core.testing.drafts import ScriptedSource


def brute_force_lookup(tokens, k, min_n, max_n):
    """What prompt lookup should propose, by scanning (no index)."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest earlier occurrence with a token after it
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_drafts_continue_the_latest_earlier_occurrence_of_the_longest_suffix():
    d = NgramDrafter(min_n=2, max_n=3)
    assert d.propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2) == [7, 8]  # the latest of two occurrences
    assert NgramDrafter(2, 3).propose([5, 6, 7, 5, 6], 4) == [7, 5, 6]  # what follows, up to the end
    assert NgramDrafter(2, 3).propose([1, 2, 3, 4], 3) == []  # no suffix occurred before
    assert NgramDrafter(2, 3).propose([1, 2, 1, 2], 0) == []


def test_ngram_index_grown_token_by_token_proposes_what_a_scan_finds():
    rng = random.Random(0)
    for trial in range(40):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        drafter = NgramDrafter(min_n=1 + trial % 2, max_n=3)
        for end in range(1, len(tokens) + 1):  # the index grows as a generation's sequence does
            got = drafter.propose(tokens[:end], 5)
            assert got == brute_force_lookup(tokens[:end], 5, drafter.min_n, drafter.max_n), (tokens[:end], got)


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    if tiny_models.missing("olmoe"):
        pytest.skip(tiny_models.missing("olmoe"))
    return tiny_models.model_dir("olmoe", tmp_path_factory)


def drafted_run(model, prompt, plain, **kwargs):
    source = ScriptedSource([(prompt, plain.token_ids)], model.lm.vocab_size, wrong_every=4)
    return model.generate(token_ids=prompt, draft=source, draft_depth=5, **kwargs)


def most_positions_at_once(model_dir, calls: list, **load) -> int:
    """Decode with drafts (wrong every fourth) and without: the tokens and every row's
    logits the same bit for bit; returns the most positions the patched token mixer took
    in one call during the decode (``calls``: the (rows, start) it recorded)."""
    import numpy as np

    with colibri_core.load(model_dir, history=False, **load) as model:
        prompt = list(range(5, 17))
        plain = model.generate(token_ids=prompt, max_tokens=24, ignore_eos=True, return_logits=True)
        calls.clear()
        drafted = drafted_run(model, prompt, plain, max_tokens=24, ignore_eos=True, return_logits=True)
    assert drafted.token_ids == plain.token_ids and drafted.stats.accepted_tokens > 8
    assert all(np.array_equal(a, b) for a, b in zip(drafted.logits, plain.logits))
    return max(rows for rows, start in calls if start >= len(prompt))  # the decode's, not the prompt's


def test_a_stop_token_max_tokens_and_the_context_end_a_drafting_generation_where_they_end_one_without(olmoe):
    prompt = tiny_models.prompts(1, seed=4)[0]
    with colibri_core.load(olmoe, history=False) as model:
        reference = model.generate(token_ids=prompt, max_tokens=24, ignore_eos=True)
        # a stop token in the middle of accepted drafts: the tokens before it, finish "stop"
        stop = reference.token_ids[9]
        model.eos_ids = [stop]
        plain = model.generate(token_ids=prompt, max_tokens=24)
        drafted = drafted_run(model, prompt, reference, max_tokens=24)
        assert plain.finish_reason == drafted.finish_reason == "stop"
        assert drafted.token_ids == plain.token_ids == reference.token_ids[: reference.token_ids.index(stop)]
        # max_tokens inside a verification's accepted drafts
        for n in (1, 2, 7, 13):
            run = drafted_run(model, prompt, reference, max_tokens=n, ignore_eos=True)
            assert run.token_ids == reference.token_ids[:n] and run.finish_reason == "length", n
        # the context fills: drafts never go past it
        room = model.lm.max_context - 5
        long_prompt = (prompt * room)[:room]
        plain = model.generate(token_ids=long_prompt, max_tokens=20, ignore_eos=True)
        drafted = drafted_run(model, long_prompt, plain, max_tokens=20, ignore_eos=True)
        assert plain.finish_reason == drafted.finish_reason == "context"
        # the last token is sampled with the context full
        assert drafted.token_ids == plain.token_ids and len(plain.token_ids) == 6
        assert drafted.stats.drafted_tokens > 0


def test_drafting_statistics_add_up(olmoe):
    prompt = tiny_models.prompts(1, seed=6)[0]
    with colibri_core.load(olmoe, history=False) as model:
        plain = model.generate(token_ids=prompt, max_tokens=30, ignore_eos=True)
        s = drafted_run(model, prompt, plain, max_tokens=30, ignore_eos=True).stats
    assert s.draft_source == "scripted"
    assert 0 < s.accepted_tokens < s.drafted_tokens
    assert s.draft_acceptance == pytest.approx(s.accepted_tokens / s.drafted_tokens)
    assert s.draft_verifications > 0 and s.draft_replayed_tokens == 0  # KV caches rewind: nothing fed again
    # every forward pass after the first token gains one token, plus the drafts it accepted
    assert s.tokens_per_forward == pytest.approx(29 / (29 - s.accepted_tokens))


def test_bad_draft_options_are_one_line_before_the_model_loads(olmoe):
    out = run_colibri("run", "--model", olmoe, "--token-ids", "1,2,3", "--draft", "oracle")
    assert out.returncode == 2 and "no draft source named 'oracle'" in out.stderr and "ngram" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    out = run_colibri("run", "--model", olmoe, "--token-ids", "1,2,3", "--draft", "ngram", "--draft-depth", "0")
    assert out.returncode == 2 and "--draft-depth must be an integer from 1 to 16" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_colibri_run_with_ngram_drafts_reports_them_and_keeps_the_tokens(olmoe):
    ids = ",".join(map(str, [7, 8, 9, 10] * 6))
    runs = [json.loads(run_colibri("run", "--model", olmoe, "--token-ids", ids, "--max-tokens", "16", "--ignore-eos",
                                   "--json", *extra).stdout) for extra in ((), ("--draft", "ngram"))]
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    assert runs[0]["stats"]["draft_source"] == "" and runs[1]["stats"]["draft_source"] == "ngram"
    assert runs[1]["stats"]["drafted_tokens"] > 0


def test_the_draft_gate_verifies_the_depth_its_measurements_say_pays():
    from colibri_core.engine.speculative import DraftGate

    gate = DraftGate()
    assert gate.depth(4) == 0  # no plain step timed yet
    gate.observe(0, 1.0)
    assert gate.depth(4) == 0  # the prior (half the drafts right, a draft costing half a step) does not pay
    gate.score(10, 10)  # shadow drafts that were right
    k = gate.depth(4)
    assert k >= 2  # right ~90% of the time at the prior cost: several drafts pay
    gate.observe(k, 1.0 + 1.5 * k)  # but each drafted token cost 1.5 plain steps here
    assert gate.beta == 1.5 and gate.depth(4) == 0
    for _ in range(DraftGate.RETRY - 1):
        gate.observe(0, 1.0)
        assert gate.depth(4) == 0
    gate.observe(0, 1.0)
    assert gate.depth(4) > 0  # a cost measured too high is tried again now and then
    gate.observe(1, 1.2)  # and it is cheaper now
    assert gate.depth(4) > 0
    gate.score(0, 40)  # then the drafts stop being right
    assert gate.acceptance < 0.2 and gate.depth(4) == 0


def _timed_generation(model, prompt, source, drafted_s: float):
    """A generation with ``source`` behind a DraftGate, on a clock where a plain step takes
    1 s and a step verifying k drafts 1 + drafted_s * k."""
    from colibri_core.engine.speculative import DraftGate, Speculation

    generation = model.stream(token_ids=prompt, max_tokens=60, ignore_eos=True)
    now, calls = [0.0], [0]

    def clock():  # read at a step's start, then its end
        calls[0] += 1
        if calls[0] % 2 == 0:
            now[0] += 1.0 + drafted_s * generation.speculation._drafting
        return now[0]

    generation.speculation = Speculation(model.lm, model.backend, source.new_drafter(), 4, "scripted", DraftGate(), clock)
    return generation.run()


def test_auto_never_verifies_drafts_it_scores_wrong_and_keeps_the_tokens(olmoe):
    """--draft auto: a source that always drafts wrong tokens is scored on shadow drafts
    and never verified: it costs no forward pass."""
    prompt = tiny_models.prompts(1, seed=8)[0]
    with colibri_core.load(olmoe, history=False) as model:
        plain = model.generate(token_ids=prompt, max_tokens=60, ignore_eos=True)
        wrong = ScriptedSource([(prompt, plain.token_ids)], model.lm.vocab_size, wrong_every=1)
        run = _timed_generation(model, prompt, wrong, drafted_s=0.5)
        right = ScriptedSource([(prompt, plain.token_ids)], model.lm.vocab_size, wrong_every=10**9)
        good = _timed_generation(model, prompt, right, drafted_s=0.2)
    assert run.token_ids == plain.token_ids == good.token_ids
    s = run.stats
    assert s.draft_verifications == 0 and s.draft_gated_steps == 58  # every decode step but the last (no room)
    g = good.stats  # drafts always right and cheap: verified, deep, from the first steps on
    assert g.accepted_tokens == g.drafted_tokens > 0 and g.draft_gated_steps <= 3
    assert g.tokens_per_forward > 3



def test_a_costly_drafter_proposes_shadow_drafts_rarely_once_they_lose(olmoe):
    """An MTP-like drafter (costly: a proposal runs a layer) whose drafts are wrong is asked
    for a shadow draft every step only while its acceptance is unknown, then every
    SHADOW_EVERY steps; the tokens are those without drafts."""
    from colibri_core.engine.speculative import DraftGate

    prompt = tiny_models.prompts(1, seed=8)[0]
    with colibri_core.load(olmoe, history=False) as model:
        plain = model.generate(token_ids=prompt, max_tokens=60, ignore_eos=True)

        class Costly(ScriptedSource):
            costly = True
            asked = 0

            def propose(self, tokens, k):
                Costly.asked += 1
                return super().propose(tokens, k)

        run = _timed_generation(model, prompt, Costly([(prompt, plain.token_ids)], model.lm.vocab_size, wrong_every=1),
                                drafted_s=0.5)
    assert run.token_ids == plain.token_ids and run.stats.draft_verifications == 0
    assert 58 // DraftGate.SHADOW_EVERY <= Costly.asked <= 58 // DraftGate.SHADOW_EVERY + 6, Costly.asked


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_drafted_positions_go_through_attention_in_one_call_where_the_backend_says_exact(olmoe, backend, monkeypatch):
    """A verification's positions of one sequence are one attention call on a backend
    whose attention computes each row as alone (the CPU kernels), and a call each on one
    that does not say so; the tokens and every row's logits are the plain run's bit for
    bit either way (every family's oracle suite checks the same)."""
    from colibri_core.compute.reference import ReferenceBackend
    from colibri_core.nn.layers import Attention

    calls = []
    attend = Attention._attend

    def counted(self, q, k, v, step, gate=None):
        calls.append((q.shape[0], int(step.start)))
        return attend(self, q, k, v, step, gate)

    monkeypatch.setattr(Attention, "_attend", counted)
    kwargs = {} if backend == "cpu" else {"backend": ReferenceBackend()}
    merged = most_positions_at_once(olmoe, calls, **kwargs)
    assert merged > 1 if backend == "cpu" else merged == 1, calls


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v32"])
def test_drafted_positions_go_through_absorbed_mla_at_once_where_exact(name, tmp_path_factory, monkeypatch):
    """MLA: a verification's positions of one sequence go through the absorbed form in
    one call on the CPU kernels (their per-head products and latent attention compute a
    row as alone), except with a DSA indexer (its scores are not row-exact: a call per
    position); the tokens and every row's logits are the plain run's bit for bit."""
    import numpy as np

    from colibri_core.nn.mla import MLAttention

    if tiny_models.missing(name):
        pytest.skip(tiny_models.missing(name))
    calls = []
    attend = MLAttention._attend

    def counted(self, x, q, q_resid, compressed, step, absorbed=False):
        calls.append((x.shape[0], int(step.start)))
        return attend(self, x, q, q_resid, compressed, step, absorbed)

    monkeypatch.setattr(MLAttention, "_attend", counted)
    merged = most_positions_at_once(tiny_models.model_dir(name, tmp_path_factory), calls)
    assert merged > 1 if name == "deepseek_v3" else merged == 1, calls

