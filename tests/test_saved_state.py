"""Saved sequence states (colibri_core.engine.state, docs/state.md): a stop token, the
sampler's saved parameters, refusals of damaged, foreign, newer and special files (one
line naming the file), the command line's --save-state / --resume round trip, and a state
saved on one backend resumed on another. Every family's oracle suite checks the exact
resume (``test_saved_state_resumes_exactly``)."""

import hashlib
import json
import os
import shutil
import struct

import numpy as np
import pytest

import colibri_core
from colibri_core.engine.state import DIGEST_KEY, DOC_KEY, read_state
from colibri_core.errors import ColibriError, UsageError
from colibri_core.testing import tiny_models
from colibri_core.testing.cli import run_colibri
from colibri_core.testing.oracle import assert_same_logits


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return tiny_models.model_dir("olmoe", tmp_path_factory)


PROMPT = tiny_models.prompts(1, seed=11)[0]


@pytest.fixture(scope="module")
def saved(olmoe, tmp_path_factory):
    """A state of the tiny OLMoE saved after 3 tokens, and the uninterrupted run of 9."""
    path = tmp_path_factory.mktemp("saved") / "chat.state"
    with colibri_core.load(olmoe, history=False) as model:
        whole = model.generate(token_ids=PROMPT, max_tokens=9, ignore_eos=True, return_logits=True)
        part = model.generate(token_ids=PROMPT, max_tokens=3, ignore_eos=True, keep_state=True)
        part.state.save(path)
    return path, whole


def _rewrite(src, dst, change, *, redigest: bool):
    """Copy a saved state with its document changed by ``change(doc)`` (and the digest
    recomputed with ``redigest``: a well-formed file saying something else)."""
    raw = open(src, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    doc = json.loads(header["__metadata__"][DOC_KEY])
    change(doc)
    text = json.dumps(doc, separators=(",", ":"))
    header["__metadata__"][DOC_KEY] = text
    data = raw[8 + n :]
    if redigest:
        header["__metadata__"][DIGEST_KEY] = hashlib.sha256(text.encode() + data).hexdigest()
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + data)


def _one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


def test_a_resumed_state_continues_the_uninterrupted_run_and_a_state_resumes_twice(olmoe, saved):
    path, whole = saved
    state = read_state(path)
    assert state.positions == len(PROMPT) + 2 and state.generated_ids == whole.token_ids[:3]
    with colibri_core.load(olmoe, history=False) as model:
        for _ in range(2):  # the state in memory is not consumed by a resume
            rest = model.resume(state, max_tokens=6, return_logits=True)
            assert rest.token_ids == whole.token_ids[3:] and rest.finish_reason == "length"
            assert_same_logits(rest.logits, whole.logits[3:], "resumed")
        # a resume keeps its own state to save: resuming that continues again
        more = model.resume(path, max_tokens=2, keep_state=True)
        assert more.state.token_ids == tuple(PROMPT + whole.token_ids[:5]) and more.state.prompt_tokens == len(PROMPT)
        assert model.resume(more.state, max_tokens=4).token_ids == whole.token_ids[5:]
        # a caller that stops iterating between tokens leaves a state to keep as well
        generation = model.stream(token_ids=PROMPT, max_tokens=9, ignore_eos=True, keep_state=True)
        events = iter(generation)
        for _ in range(4):
            next(events)
        events.close()
        stopped = generation.result()
        assert stopped.finish_reason == "interrupted" and stopped.state.positions == len(PROMPT) + 3
        assert model.resume(stopped.state, max_tokens=5).token_ids == whole.token_ids[4:]


def test_a_stop_token_is_kept_with_the_state_and_fed_when_it_resumes(olmoe):
    with colibri_core.load(olmoe, history=False) as model:
        reference = model.generate(token_ids=PROMPT, max_tokens=12, ignore_eos=True)
        stop = next(t for i, t in enumerate(reference.token_ids) if i >= 3 and t not in reference.token_ids[:i])
        at = reference.token_ids.index(stop)
        model.eos_ids = [stop]
        ended = model.generate(token_ids=PROMPT, max_tokens=12, keep_state=True)
        assert ended.finish_reason == "stop" and ended.token_ids == reference.token_ids[:at]
        assert ended.state.token_ids[-1] == stop and ended.state.positions == len(PROMPT) + at
        # the saved run stopped at eos; ignoring it now continues as a run that ignored it
        rest = model.resume(ended.state, max_tokens=12 - at - 1, ignore_eos=True)
        assert rest.token_ids == reference.token_ids[at + 1 :]


def test_a_step_left_unfinished_is_not_kept(olmoe):
    """Layers that absorbed a step the cache did not finish (Ctrl-C inside a forward pass)
    make no state: every layer's length must be the cache's."""
    from colibri_core.engine.sampling import Sampler, SamplingParams
    from colibri_core.engine.state import capture

    with colibri_core.load(olmoe, history=False) as model:
        lm, ops = model.lm, model.backend
        cache = lm.new_cache(ops)
        lm.forward(np.asarray(PROMPT), cache, ops)

        def stop_after_first_layer(done):
            if done == 1:
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            lm.forward(np.asarray([5]), cache, ops, after_layer=stop_after_first_layer)
        params = SamplingParams()
        with pytest.raises(ValueError, match=f"layer 0 holds {len(PROMPT) + 1} positions, not {len(PROMPT)}"):
            capture(model, cache, PROMPT + [5], len(PROMPT), params, False, Sampler(params))


def test_the_saved_sampling_continues_unless_replaced(olmoe, tmp_path):
    sampling = {"temperature": 0.9, "top_p": 0.9, "seed": 7, "presence_penalty": 0.4, "logit_bias": {3: 2.0}}
    with colibri_core.load(olmoe, history=False) as model:
        whole = model.generate(token_ids=PROMPT, max_tokens=10, ignore_eos=True, **sampling)
        part = model.generate(token_ids=PROMPT, max_tokens=4, ignore_eos=True, keep_state=True, **sampling)
        part.state.save(tmp_path / "s")
        assert model.resume(tmp_path / "s", max_tokens=6).token_ids == whole.token_ids[4:]
        assert model.resume(tmp_path / "s", max_tokens=6, seed=7).token_ids == whole.token_ids[4:]  # the same seed: continues
        greedy = model.resume(tmp_path / "s", max_tokens=6, temperature=0.0, logit_bias=None, presence_penalty=0.0)
        plain = model.generate(token_ids=PROMPT + part.token_ids, max_tokens=6, ignore_eos=True)
        assert greedy.token_ids == plain.token_ids
        with pytest.raises(UsageError, match="temperature must be"):
            model.resume(tmp_path / "s", max_tokens=2, temperature=-1.0)
        with pytest.raises(UsageError, match="cannot be combined with drafts"):
            model.generate(token_ids=PROMPT, max_tokens=2, keep_state=True, draft="ngram")
        none = model.generate(token_ids=PROMPT, max_tokens=0, keep_state=True)
        assert none.state is None and "no token was sampled" in none.state_error


def test_damaged_foreign_newer_and_special_files_are_refused_in_one_line(olmoe, saved, tmp_path):
    path, _ = saved
    raw = open(path, "rb").read()
    cases = {}
    (tmp_path / "truncated").write_bytes(raw[: len(raw) - 100])
    cases["truncated"] = "truncated"
    flipped = bytearray(raw)
    flipped[-7] ^= 0x10
    (tmp_path / "flipped").write_bytes(bytes(flipped))
    cases["flipped"] = "is damaged: the SHA-256"
    _rewrite(path, tmp_path / "newer", lambda d: d.update(version=2), redigest=False)
    cases["newer"] = "has format version 2; this colibri reads version 1 (written by a newer colibri)"
    _rewrite(path, tmp_path / "ids", lambda d: d["token_ids"].__setitem__(0, d["token_ids"][0] + 1), redigest=False)
    cases["ids"] = "is damaged"  # the token ids are covered by the digest too
    os.mkfifo(tmp_path / "fifo")
    cases["fifo"] = "is a named pipe (FIFO), not a regular file"
    (tmp_path / "weights").write_bytes(open(next(olmoe.glob("*.safetensors")), "rb").read())
    cases["weights"] = "not a colibri saved state"
    for name, message in cases.items():
        with pytest.raises(ColibriError) as exc:
            read_state(tmp_path / name)
        text = _one_line(exc)
        assert str(tmp_path / name) in text and message in text, (name, text)

    # well-formed files the model refuses: another model's, a layer of another kind
    other = tmp_path / "other"
    shutil.copytree(olmoe, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config, indent=1))  # the same model? its config's bytes say not
    _rewrite(path, tmp_path / "kind", lambda d: d["layers"][0].update(kind="recurrent"), redigest=True)
    with colibri_core.load(other, history=False) as model:
        with pytest.raises(UsageError) as exc:
            model.resume(path, max_tokens=2)
        assert "belongs to another model" in _one_line(exc) and str(path) in str(exc.value)
    with colibri_core.load(olmoe, history=False) as model:
        with pytest.raises(ColibriError) as exc:
            model.resume(tmp_path / "kind", max_tokens=2)
        assert "layer 0 is a 'recurrent' state; this model's is 'kv'" in _one_line(exc)


def test_colibri_run_save_state_then_resume_equals_one_longer_run(olmoe, tmp_path):
    ids = ",".join(map(str, PROMPT))
    state = tmp_path / "run.state"
    for sampling in ((), ("--temperature", "0.8", "--seed", "3")):
        longer = json.loads(run_colibri("run", "--model", olmoe, "--token-ids", ids, "--max-tokens", "8", "--ignore-eos",
                                        "--json", *sampling).stdout)
        first = json.loads(run_colibri("run", "--model", olmoe, "--token-ids", ids, "--max-tokens", "3", "--ignore-eos",
                                       "--json", "--save-state", str(state), *sampling).stdout)
        assert first["saved_state"]["positions"] == len(PROMPT) + 2
        # no sampling options: the saved ones (temperature, seed, --ignore-eos) continue
        rest = json.loads(run_colibri("run", "--model", olmoe, "--resume", str(state), "--max-tokens", "5",
                                      "--json").stdout)
        assert first["token_ids"] + rest["token_ids"] == longer["token_ids"], sampling
        assert rest["stats"]["prompt_tokens"] == 1 and rest["stats"]["resumed_tokens"] == len(PROMPT) + 2


def test_colibri_run_state_options_are_one_line_before_the_model_loads(olmoe, tmp_path):
    bad = tmp_path / "bad.state"
    bad.write_bytes(b"\0" * 40)
    for args, message in [
        (("--resume", str(bad), "--token-ids", "1,2"), "--resume continues a saved sequence"),
        (("--resume", str(bad)), f"{bad}: not a readable saved state"),
        (("--resume", str(tmp_path / "absent")), "saved state not found"),
        (("--token-ids", "1,2", "--save-state", str(tmp_path / "no" / "dir")), "does not exist"),
        (("--token-ids", "1,2", "--save-state", str(tmp_path / "s"), "--draft", "ngram"), "cannot be combined with --draft"),
    ]:
        out = run_colibri("run", "--model", tmp_path / "no-model", *args)  # not a model: nothing may load first
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.matrix
@pytest.mark.parametrize("name", ["olmoe", "qwen3_next"])
def test_a_state_saved_on_the_cpu_resumes_on_mlx(name, tmp_path_factory, tmp_path):
    """Arrays are saved in host form: another backend takes them, and continues with the
    tokens the CPU would have given (logits within the backend's tolerance)."""
    from colibri_core.plugins.discovery import get_registry

    entry = get_registry().entries["backend"].get("mlx")
    if entry is None or entry.spec.unavailable_reason():
        pytest.skip("the mlx backend is not available here")
    path = tiny_models.model_dir(name, tmp_path_factory)
    with colibri_core.load(path, history=False, backend="cpu") as model:
        whole = model.generate(token_ids=PROMPT, max_tokens=10, ignore_eos=True, return_logits=True)
        part = model.generate(token_ids=PROMPT, max_tokens=4, ignore_eos=True, keep_state=True)
        part.state.save(tmp_path / "cpu.state")
    with colibri_core.load(path, history=False, backend="mlx") as model:
        rest = model.resume(tmp_path / "cpu.state", max_tokens=6, return_logits=True)
        tolerance = max(1e-4, model.backend.logits_tolerance)
    assert rest.token_ids == whole.token_ids[4:]
    worst = float(np.abs(np.stack(rest.logits) - np.stack(whole.logits[4:])).max())
    assert worst < tolerance, f"logits differ by {worst:.2e}"
