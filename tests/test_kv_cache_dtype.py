"""``--kv-cache float16`` (load(kv_cache=)): attention keys and values kept in half
precision on the CPU backend. The compiled kernel reads them as the numpy path does (each
half widened exactly), a row's result stays its own whatever the rows beside it, the model
stays within half precision's rounding of float32, placement and drafts still never change
its tokens, a state saved from one cache dtype is refused by the other, and a backend
without it refuses the option in one line."""

import numpy as np
import pytest

import colibri_core
from colibri_core.compute.cpu.backend import CpuBackend
from colibri_core.errors import UsageError
from colibri_core.testing import tiny_models
from colibri_core.testing.cli import run_colibri

_kernels = pytest.importorskip("colibri_core.compute.cpu._kernels")


@pytest.mark.parametrize("hq, hkv, d", [(4, 4, 32), (8, 2, 40), (6, 3, 16)])
def test_half_keys_and_values_match_the_numpy_path_and_rows_stay_their_own(hq, hkv, d):
    rng = np.random.default_rng(hq + d)
    t, start, capacity = 11, 20, 64
    s = start + t
    q = rng.standard_normal((t, hq, d)).astype(np.float32)
    k = rng.standard_normal((hkv, capacity, d)).astype(np.float16)[:, :s]
    v = rng.standard_normal((hkv, capacity, d + 8)).astype(np.float16)[:, :s]
    ours = CpuBackend().attention(q, k, v, start, 0.2)
    reference = CpuBackend(kernels=False).attention(q, k.astype(np.float32), v.astype(np.float32), start, 0.2)
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-6)
    for i in (0, 5, t - 1):  # a decode step's row is the prefill's, bit for bit
        alone = CpuBackend().attention(q[i : i + 1], k[:, : start + i + 1], v[:, : start + i + 1], start + i, 0.2)
        assert np.array_equal(alone[0], ours[i])
    with pytest.raises(ValueError, match="one dtype"):
        _kernels.attention(q, k, v.astype(np.float32), start, 0.2, np.empty((t, hq, d + 8), np.float32))


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return tiny_models.model_dir("olmoe", tmp_path_factory)


PROMPT = tiny_models.prompts(1, seed=5)[0]


def test_the_model_stays_within_half_precision_and_placement_keeps_its_tokens(olmoe):
    with colibri_core.load(olmoe, history=False) as model:
        exact = model.generate(token_ids=PROMPT, max_tokens=8, ignore_eos=True, return_logits=True)
        full_bytes = model.lm.new_cache(model.backend).bytes_per_token()
    with colibri_core.load(olmoe, history=False, kv_cache="float16") as model:
        assert model.backend.kv_cache_dtype == "float16"
        assert model.lm.new_cache(model.backend).bytes_per_token() * 2 == full_bytes
        half = model.generate(token_ids=PROMPT, max_tokens=8, ignore_eos=True, return_logits=True)
        drafted = model.generate(token_ids=PROMPT, max_tokens=8, ignore_eos=True, return_logits=True, draft="ngram")
    scale = np.abs(exact.logits).max()
    np.testing.assert_allclose(half.logits, exact.logits, atol=2e-3 * scale)
    assert not np.array_equal(half.logits, exact.logits)  # the option took effect
    assert drafted.token_ids == half.token_ids  # drafts verified on the half cache: the same tokens
    np.testing.assert_array_equal(drafted.logits, half.logits)
    with colibri_core.load(olmoe, history=False, kv_cache="float16", cap=1) as model:  # experts streamed one at a time
        streamed = model.generate(token_ids=PROMPT, max_tokens=8, ignore_eos=True, return_logits=True)
    np.testing.assert_array_equal(streamed.logits, half.logits)


def test_a_state_saved_from_one_cache_dtype_is_refused_by_the_other(olmoe, tmp_path):
    path = tmp_path / "half.state"
    with colibri_core.load(olmoe, history=False, kv_cache="float16") as model:
        model.generate(token_ids=PROMPT, max_tokens=3, ignore_eos=True, keep_state=True).state.save(path)
        resumed = model.resume(model.load_state(path), max_tokens=2)  # the same dtype resumes
        assert len(resumed.token_ids) == 2
    with colibri_core.load(olmoe, history=False) as model:
        with pytest.raises(Exception, match="float16 KV cache.*--kv-cache float16"):
            model.resume(model.load_state(path), max_tokens=2)


def test_the_option_is_checked_in_one_line(olmoe):
    with pytest.raises(UsageError, match="--kv-cache 'float8'"):
        colibri_core.load(olmoe, kv_cache="float8")
    pytest.importorskip("mlx.core")
    with pytest.raises(UsageError, match="--kv-cache float16: the mlx backend keeps keys and values in float32 only"):
        colibri_core.load(olmoe, kv_cache="float16", backend="mlx")


def test_the_command_line_takes_it(olmoe):
    result = run_colibri("run", "--model", str(olmoe), "--token-ids", ",".join(map(str, PROMPT)), "--max-tokens", "3",
                         "--kv-cache", "float16", "--json")
    assert result.returncode == 0, result.stderr
    bad = run_colibri("run", "--model", str(olmoe), "--token-ids", "1,2", "--kv-cache", "float8")
    assert bad.returncode == 2 and "--kv-cache" in bad.stderr


def test_plan_counts_the_cache_dtypes_bytes(olmoe):
    import json

    plans = {}
    for dtype in ("float32", "float16"):
        out = run_colibri("plan", "--model", str(olmoe), "--json", "--context", "100", "--kv-cache", dtype)
        assert out.returncode == 0, out.stderr
        plans[dtype] = json.loads(out.stdout)
    assert plans["float16"]["kv_bytes_per_token"] * 2 == plans["float32"]["kv_bytes_per_token"] > 0
