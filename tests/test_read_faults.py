"""A weight file that fails to read while a model runs: the error names the file, and
once the file is whole again the next generation reads it, whether it was put back in
place or by renaming a copy over it (a new file: the drive opens it), with no failure
left over from the step that failed."""

import os

import numpy as np
import pytest

import colibri_core
from colibri_core.cli.demo import DemoSpec
from colibri_core.io.drives import ReadFailed

SPEC = DemoSpec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
                intermediate_size=16, tokenizer_vocab=300, shard_bytes=30_000, router_std=1.0)
PROMPT = list(range(5, 25))


@pytest.fixture
def model_dir(model_dir, tmp_path, monkeypatch):
    """tests/conftest.py's copy of the model, with a user cache dir of the test's own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return model_dir


def generate(model):
    return model.generate(token_ids=PROMPT, max_tokens=8, ignore_eos=True, return_logits=True)


def same(a, b):
    assert a.token_ids == b.token_ids
    assert all(np.array_equal(x, y) for x, y in zip(a.logits, b.logits))


def truncate_all(model_dir) -> dict:
    """Cut every shard short under the running model; returns their bytes."""
    saved = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        saved[shard] = shard.read_bytes()
        os.truncate(shard, 200)
    return saved


def restore_in_place(saved):
    for shard, data in saved.items():
        with open(shard, "r+b") as f:
            f.write(data)


def restore_by_rename(saved):
    for shard, data in saved.items():
        copy = shard.with_name(shard.name + ".restored")
        copy.write_bytes(data)
        os.replace(copy, shard)


def failing_read(model, shards) -> ReadFailed:
    with pytest.raises(ReadFailed) as failed:
        generate(model)
    assert failed.value.path in {str(s) for s in shards}
    assert str(failed.value).startswith(failed.value.path + ": ")
    return failed.value


@pytest.mark.parametrize("restore", [restore_in_place, restore_by_rename], ids=["in_place", "by_rename"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["demand", "prefetch"])
def test_a_truncated_shard_fails_naming_it_and_reads_again_once_restored(model_dir, restore, prefetch):
    with colibri_core.load(model_dir, cap=1, history=False, prefetch=prefetch) as model:
        reference = generate(model)
        saved = truncate_all(model_dir)
        assert "short read at offset" in str(failing_read(model, saved))
        failing_read(model, saved)  # and again while the file stays short
        restore(saved)
        same(generate(model), reference)
        same(generate(model), reference)


def test_a_shard_replaced_by_something_unreadable_is_a_read_error_naming_it(model_dir):
    with colibri_core.load(model_dir, cap=1, history=False) as model:
        reference = generate(model)
        saved = truncate_all(model_dir)
        failing_read(model, saved)
        for shard in saved:  # the file put back is a directory: the drive opens it, and cannot read it
            shard.unlink()
            shard.mkdir()
        error = failing_read(model, saved)
        assert "cannot read: Is a directory" in str(error)
        for shard in saved:
            shard.rmdir()
        restore_by_rename(saved)
        same(generate(model), reference)
