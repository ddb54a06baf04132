"""Generation, tokenizer, chat template, stop conditions and statistics on a small
synthetic OLMoE-shaped model (the demo builder with tiny sizes)."""

import json
import shutil

import numpy as np
import pytest

import colibri_core
from colibri_core.engine import generation
from colibri_core.errors import UsageError

from colibri_core.testing.cli import run_colibri
from colibri_core.testing.demo_specs import SMALL_RANDOM

SPEC = SMALL_RANDOM  # the model of demo_model and model_dir (tests/conftest.py)


def test_text_generation_streams_the_same_text_as_decoding_the_ids(demo_model):
    with colibri_core.load(demo_model) as model:
        gen = model.stream("Once upon a time", max_tokens=12, ignore_eos=True)
        pieces = [event.text for event in gen]
        result = gen.result()
        assert len(result.token_ids) == 12
        assert "".join(pieces) == result.text == model.decode(result.token_ids)
        assert result.token_ids == model.generate("Once upon a time", max_tokens=12, ignore_eos=True).token_ids


def test_stream_decoder_never_emits_half_characters(demo_model):
    text = "héllo wörld, a bird 🐦 flies; 漢字"
    with colibri_core.load(demo_model) as model:
        ids = model.encode(text)
        decoder = model.tokenizer.stream_decoder()
        pieces = [decoder.add(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_chat_templates_from_tokenizer_config_and_jinja_file(demo_model, tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with colibri_core.load(demo_model) as model:
        rendered = model.chat_prompt(messages)
    assert rendered == "<|system|>\nbe brief<|endoftext|>\n<|user|>\nhi<|endoftext|>\n<|assistant|>\n"

    copy = tmp_path / "m"
    shutil.copytree(demo_model, copy)
    (copy / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}] {{ m.content | upper }}\n{% endfor %}")
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "ignored because the .jinja file wins"}]
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with colibri_core.load(copy) as model:
        assert model.chat_prompt(messages) == "[system] BE BRIEF\n[user] HI\n"
        result = model.generate(messages=messages, max_tokens=3, ignore_eos=True)
        assert len(result.token_ids) == 3


def test_eos_from_generation_config_stops(demo_model, tmp_path):
    with colibri_core.load(demo_model) as model:
        first = model.generate(token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True).token_ids
    copy = tmp_path / "m"
    shutil.copytree(demo_model, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [999, first[2]]}))
    with colibri_core.load(copy) as model:
        assert model.eos_ids == [999, first[2]]
        result = model.generate(token_ids=[5, 6, 7], max_tokens=10)
    assert result.token_ids == first[:2] and result.finish_reason == "stop"


def test_generation_stops_when_the_context_is_full(demo_model):
    with colibri_core.load(demo_model) as model:
        result = model.generate(token_ids=list(range(10, 60)), max_tokens=100, ignore_eos=True)
        assert result.finish_reason == "context"
        assert len(result.token_ids) == SPEC.max_position_embeddings - 50 + 1
        with pytest.raises(UsageError, match="context"):
            model.generate(token_ids=list(range(64)), max_tokens=1)
        with pytest.raises(UsageError, match="vocabulary"):
            model.generate(token_ids=[1, 10**6], max_tokens=1)


def test_chunked_prefill_gives_the_same_tokens(demo_model, monkeypatch):
    prompt = list(range(20, 50))
    with colibri_core.load(demo_model) as model:
        whole = model.generate(token_ids=prompt, max_tokens=10, ignore_eos=True, return_logits=True)
        whole_logits = model.logits(prompt)
        monkeypatch.setattr(generation, "PREFILL_CHUNK", 7)
        chunked = model.generate(token_ids=prompt, max_tokens=10, ignore_eos=True, return_logits=True)
        np.testing.assert_allclose(model.logits(prompt), whole_logits, atol=1e-5)
    assert chunked.token_ids == whole.token_ids
    np.testing.assert_allclose(np.stack(chunked.logits), np.stack(whole.logits), atol=1e-5)


def test_logits_api_matches_generation_steps(demo_model):
    with colibri_core.load(demo_model, cap=1) as model:
        result = model.generate(token_ids=[3, 4, 5], max_tokens=5, ignore_eos=True, return_logits=True)
        full = model.logits([3, 4, 5] + result.token_ids[:-1])
    assert full.shape == (7, SPEC.vocab_size)
    np.testing.assert_allclose(full[2:], np.stack(result.logits), atol=1e-5)


def test_model_without_tokenizer_runs_from_token_ids(demo_model, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(demo_model, copy)
    (copy / "tokenizer.json").unlink()
    with colibri_core.load(copy) as model:
        assert model.tokenizer is None
        result = model.generate(token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)
        assert len(result.token_ids) == 4 and result.text is None
        with pytest.raises(UsageError, match="token ids"):
            model.generate("text needs a tokenizer")
    cli = run_colibri("run", "--model", copy, "--token-ids", "1,2,3", "--max-tokens", "4", "--ignore-eos", "-q")
    assert cli.returncode == 0, cli.stderr
    assert [int(t) for t in cli.stdout.split()] == result.token_ids


def test_statistics_account_for_streaming(demo_model):
    with colibri_core.load(demo_model, cap=1, history=False) as model:
        s = model.generate(token_ids=list(range(1, 9)), max_tokens=8, ignore_eos=True).stats
        assert s.prompt_tokens == 8 and s.generated_tokens == 8
        assert s.expert_misses > 0 and s.bytes_read > 0 and s.disk_reads >= s.expert_misses
        assert s.bytes_read == s.expert_misses * 3 * SPEC.hidden_size * SPEC.intermediate_size * 2  # bf16 on disk
        assert 0 <= s.hit_rate < 1
        assert s.prefill_tok_s > 0 and s.decode_tok_s > 0 and 0 < s.ttft_s
        assert s.resident_bytes == model.placement.dense_bytes + model.store.resident_bytes
        assert s.cache_slots == 1
        assert s.kv_bytes_per_token == SPEC.num_hidden_layers * 2 * SPEC.hidden_size * 4
    with colibri_core.load(demo_model, preload=True, history=False) as model:
        s = model.generate(token_ids=list(range(1, 9)), max_tokens=8, ignore_eos=True).stats
        assert s.hit_rate == 1.0 and s.bytes_read == 0


def test_cli_run_json_contract(demo_model):
    out = run_colibri("run", "--model", demo_model, "Once upon", "--max-tokens", "5", "--ignore-eos", "--json", "--cap", "2")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data) >= {"token_ids", "text", "stats"}
    assert {"decode_tok_s", "prefill_tok_s", "ttft_s", "hit_rate", "bytes_read", "resident_bytes"} <= set(data["stats"])
    assert len(data["token_ids"]) == 5 and isinstance(data["text"], str)


def test_cli_run_streams_text_and_reports_statistics(demo_model):
    out = run_colibri("run", "--model", demo_model, "Once upon a time", "--max-tokens", "6", "--ignore-eos",
                      "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "3", "--ram", "10M")
    assert out.returncode == 0, out.stderr
    again = run_colibri("run", "--model", demo_model, "Once upon a time", "--max-tokens", "6", "--ignore-eos",
                        "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "3", "-q")
    assert out.stdout == again.stdout  # same seed, same text, whatever the budget
    assert "hit rate" in out.stderr and "decode" in out.stderr


def test_cli_chat_uses_the_template(demo_model):
    with colibri_core.load(demo_model) as model:
        expected = model.generate(messages=[{"role": "user", "content": "hello"}], max_tokens=4, ignore_eos=True).text
    out = run_colibri("run", "--model", demo_model, "--chat", "hello", "--max-tokens", "4", "--ignore-eos", "-q")
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"


@pytest.mark.parametrize("args, message", [
    (["--max-tokens", "2"], "PROMPT"),
    (["hi", "--token-ids", "1", "--max-tokens", "2"], "exactly one"),
    (["--token-ids", "1,x"], "comma-separated"),
    (["--token-ids", "1", "--ram", "lots"], "cannot read size"),
    (["--token-ids", "1", "--ram", "1K"], "RAM budget"),
    (["--token-ids", "1", "--backend", "quantum"], "no backend named 'quantum'"),
])
def test_cli_usage_errors_are_one_line(demo_model, args, message):
    out = run_colibri("run", "--model", demo_model, *args)
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
