"""OpenAI's logit bias, frequency / presence penalties and logprobs in the sampler
(colibri_core.engine.sampling), through Model.generate and the batched engine: checked
against a plain numpy statement of OpenAI's definitions."""

import numpy as np
import pytest

import colibri_core
from colibri_core.engine.sampling import MAX_LOGPROBS, Sampler, SamplingParams
from colibri_core.engine.scheduler import Request, Scheduler
from colibri_core.errors import UsageError
from colibri_core.testing.tiny_models import model_dir, prompts


def logits(seed=0, n=50):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 3


def adjusted(x, generated, bias=None, frequency=0.0, presence=0.0):
    """OpenAI's definition: logit_bias added by id; each generated token's logit lowered
    by frequency_penalty * its count + presence_penalty once it occurred."""
    out = x.astype(np.float64).copy()
    for token, value in (bias or {}).items():
        out[token] += value
    for token in set(generated):
        out[token] -= frequency * generated.count(token) + presence
    return out


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_logit_bias_is_added_by_token_id():
    x = logits(1)
    best, second = np.argsort(-x)[:2]
    assert Sampler(SamplingParams(logit_bias={7: 100}))(x) == 7
    assert Sampler(SamplingParams(logit_bias={int(best): -100}))(x) == second
    sampled = Sampler(SamplingParams(temperature=1.0, seed=0, logit_bias={3: 100.0}))
    assert {sampled(x) for _ in range(50)} == {3}


@pytest.mark.parametrize("frequency, presence", [(0.7, 0.0), (0.0, 1.5), (0.4, 0.9), (-0.5, -0.3)])
def test_penalties_follow_openais_definition_over_a_completion(frequency, presence):
    steps = [logits(seed % 3, 20) for seed in range(40)]  # the same few distributions again and again
    bias = {4: 1.5, 11: -2.0}
    sampler = Sampler(SamplingParams(frequency_penalty=frequency, presence_penalty=presence, logit_bias=bias))
    generated = []
    for x in steps:
        want = int(np.argmax(adjusted(x, generated, bias, frequency, presence)))
        assert sampler(x) == want
        generated.append(want)
    if frequency > 0 or presence > 0:  # positive penalties move greedy decoding off its one favourite
        assert len(set(generated)) > 3


def test_logprobs_are_the_log_softmax_after_bias_and_penalties_before_temperature():
    x = logits(2, 300)
    bias = {5: 3.0}
    reference = None
    for temperature in (0.0, 0.3, 1.7):
        params = SamplingParams(temperature=temperature, top_k=40, top_p=0.8, seed=1, frequency_penalty=0.6,
                                presence_penalty=0.2, logit_bias=bias, logprobs=5)
        sampler = Sampler(params)
        generated, tops = [], []
        for _ in range(6):
            token, info = sampler.sample(x)
            want = log_softmax(adjusted(x, generated, bias, 0.6, 0.2))
            assert info.token_id == token and info.logprob == pytest.approx(want[token], abs=1e-9)
            order = sorted(range(x.size), key=lambda i: (-want[i], i))[:5]
            assert [i for i, _ in info.top] == order
            assert np.allclose([lp for _, lp in info.top], want[order], atol=1e-9)
            generated.append(token)
            tops.append(info.top[0])
        if temperature == 0.0:
            reference = (generated, tops)
    # at a temperature the tokens differ, but the first step's distribution is the same
    assert tops[0] == reference[1][0]


def test_top_logprobs_zero_reports_only_the_chosen_token_and_greedy_tokens_do_not_move():
    x = logits(3, 100)
    for n in (0, MAX_LOGPROBS):
        token, info = Sampler(SamplingParams(logprobs=n)).sample(x)
        assert token == int(np.argmax(x)) and len(info.top) == n
        assert info.logprob == pytest.approx(log_softmax(x)[token])


@pytest.mark.parametrize("kwargs", [
    {"frequency_penalty": 2.5}, {"presence_penalty": -2.01}, {"frequency_penalty": float("nan")},
    {"presence_penalty": True}, {"logprobs": 21}, {"logprobs": -1}, {"logprobs": 1.0},
    {"logit_bias": {3: 100.5}}, {"logit_bias": {3: float("inf")}}, {"logit_bias": {-1: 1.0}}, {"logit_bias": {"3": 1.0}},
    {"logit_bias": [(3, 1.0)]}])
def test_bad_parameters_are_refused_naming_them(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(UsageError, match=name):
        SamplingParams(**kwargs)


def test_a_bias_outside_the_vocabulary_is_refused():
    with pytest.raises(UsageError, match=r"logit_bias: token id 50 is outside the vocabulary \(0..49\)"):
        Sampler(SamplingParams(logit_bias={50: 1.0}))(logits())


def test_model_generate_reports_logprobs_and_applies_penalties(tmp_path_factory):
    path = model_dir("demo_int4", tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        ids = prompts(1, seed=3)[0]
        bias = {9: 2.0}
        result = model.generate(token_ids=ids, max_tokens=12, ignore_eos=True, frequency_penalty=1.2,
                                presence_penalty=0.5, logit_bias=bias, logprobs=3, return_logits=True)
        plain = model.generate(token_ids=ids, max_tokens=12, ignore_eos=True)
        with pytest.raises(UsageError, match="logit_bias: token id"):
            model.generate(token_ids=ids, max_tokens=2, logit_bias={model.lm.vocab_size: 1.0})
    assert result.token_ids != plain.token_ids  # the penalties did something
    assert len(result.logprobs) == len(result.token_ids) == 12
    for n, (token, raw, info) in enumerate(zip(result.token_ids, result.logits, result.logprobs)):
        want = adjusted(raw, result.token_ids[:n], bias, 1.2, 0.5)
        assert token == int(np.argmax(want)) == info.token_id
        assert info.logprob == pytest.approx(log_softmax(want)[token], abs=1e-9)
        assert [i for i, _ in info.top] == sorted(range(want.size), key=lambda i: (-want[i], i))[:3]
    assert result.as_dict()["logprobs"][0]["token_id"] == result.token_ids[0]
    assert plain.logprobs is None and "logprobs" not in plain.as_dict()


def test_the_batched_engine_gives_a_request_the_same_tokens_and_logprobs_alone_and_among_others(tmp_path_factory):
    path = model_dir("demo_int4", tmp_path_factory)
    with colibri_core.load(path, history=False) as model:
        ps = prompts(6, seed=5)
        params = [SamplingParams(frequency_penalty=0.8, logit_bias={5: 1.0}, logprobs=2),
                  SamplingParams(temperature=0.9, seed=3, presence_penalty=1.1, logprobs=4),
                  SamplingParams(presence_penalty=-0.4, logit_bias={int(t): -100 for t in range(10)})]
        lengths = [9, 14, 6]
        expected = [model.generate(token_ids=p, max_tokens=n, ignore_eos=True, **_kwargs(s))
                    for p, n, s in zip(ps, lengths, params)]
        with Scheduler(model, slots=8) as alone:
            lone = []
            for p, n, s in zip(ps, lengths, params):
                h = alone.submit(Request(p, n, s))
                assert h.wait(120)
                lone.append(h)
        with Scheduler(model, slots=8) as busy:
            others = [busy.submit(Request(p, 11)) for p in ps[3:]]
            mixed = [busy.submit(Request(p, n, s), on_event=None) for p, n, s in zip(ps, lengths, params)]
            events = [list(h) for h in mixed]
            assert all(h.wait(120) for h in others + mixed)
            assert busy.stats()["steps"] < sum(lengths) + 3 * 11  # decode steps carried several sequences
    for want, a, b, evs in zip(expected, lone, mixed, events):
        assert a.token_ids == b.token_ids == want.token_ids
        assert a.logprobs == b.logprobs == want.logprobs
        assert [e.logprob for e in evs if e.token_id >= 0] == (want.logprobs or [None] * len(want.token_ids))
    assert all(t >= 10 for t in expected[2].token_ids)  # banned by the bias


def _kwargs(s: SamplingParams) -> dict:
    return dict(temperature=s.temperature, seed=s.seed, frequency_penalty=s.frequency_penalty,
                presence_penalty=s.presence_penalty, logit_bias=s.logit_bias, logprobs=s.logprobs)


def test_token_bytes_give_back_the_bytes_of_byte_level_and_byte_fallback_tokens(tmp_path):
    """OpenAI's logprobs carry each token's bytes: a token holding part of a character
    must give its own bytes, not U+FFFD, so that the tokens' bytes join to the text."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from colibri_core.model.tokenizer import Tokenizer

    from colibri_core.cli.demo import build_tokenizer
    from colibri_core.testing.tiny_models import DEMO

    text = "héllo wörld 日本 ok"
    for kind in ("byte-level", "byte-fallback"):
        d = tmp_path / kind
        d.mkdir()
        if kind == "byte-level":
            hf = build_tokenizer(DEMO)
        else:  # SentencePiece's convention (Llama, Mistral): "▁" for a space, <0xNN> for a byte
            vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
            for piece in ("▁", "h", "l", "o", "w", "r", "d", "k", "▁o", "▁ok", "ll", "llo", "▁w", "rl", "rld"):
                vocab.setdefault(piece, len(vocab))
            merges = [("▁", "o"), ("▁o", "k"), ("l", "l"), ("ll", "o"), ("▁", "w"), ("r", "l"), ("rl", "d")]
            hf = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
            hf.pre_tokenizer = pre_tokenizers.Metaspace()
            hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                            decoders.Strip(" ", 1, 0)])
        hf.save(str(d / "tokenizer.json"))
        tok = Tokenizer(d)
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [tok.token_bytes(i) for i in ids]
        assert b"".join(pieces).lstrip(b" ") == text.encode(), kind  # Metaspace writes the first word's space
        assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces), kind  # some token is part of a character
