"""Every installed family's oracle cases through the ``ray`` compute tier: the tokens and
logits are bit for bit the local run's (the placement promise), with the experts
computed by 2 or 3 worker actors in their own processes.

The cases are the families' own (their ``FamilyOracleSuite`` subclasses, found beside
each family in this repository); the models are built by ``colibri_core.testing.oracle``.
Each suite's first case runs, the suites alternating between the pool of 2 workers and
the pool of 3 (CI time); COLIBRI_RAY_ALL_CASES=1 runs every case of every suite."""

import importlib.util
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import colibri_core
from colibri_core.testing.oracle import FamilyOracleSuite

REPO = Path(__file__).resolve().parents[3]
TOKENS = 6
BROKEN: list[str] = []  # family test modules that would not import


def _suites() -> list[type]:
    found = []
    for path in sorted([*REPO.glob("families/*/tests/test_*oracle*.py"), *REPO.glob("plugins/*/tests/test_*oracle*.py")]):
        if "colibri-ray" in str(path):
            continue
        sys.path.insert(0, str(path.parent))  # the suites import their config helpers by name
        name = f"_ray_cases_{path.parent.parent.name.replace('-', '_')}_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # reported by one test below, not as a collection error of every test
            BROKEN.append(f"{path.relative_to(REPO)}: {type(exc).__name__}: {exc}")
            continue
        found += [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, FamilyOracleSuite)
                  and v.__module__ == name and v.cases]
    return found


ALL_CASES = os.environ.get("COLIBRI_RAY_ALL_CASES") == "1"


def _cases():
    params = []
    for n, suite in enumerate(_suites()):
        names = sorted(suite.cases)
        for i, case in enumerate(names if ALL_CASES else names[:1]):
            workers = 2 + (n + i) % 2
            params.append(pytest.param(suite, case, workers, id=f"{suite.__name__}-{case}-{workers}workers"))
    return params


CASES = _cases()


def test_the_cases_cover_the_families_the_issue_names():
    assert not BROKEN, BROKEN
    classes = {p.values[0].model_class for p in CASES}
    assert {"OlmoeForCausalLM", "DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"} <= classes
    assert {p.values[2] for p in CASES} == {2, 3}


def _generate(fx, **options):
    with colibri_core.load(fx.path, history=False, **options) as model:
        return model.generate(token_ids=fx.prompt, max_tokens=TOKENS, ignore_eos=True, return_logits=True)


@pytest.mark.parametrize("suite, case, workers", CASES)
def test_ray_tier_gives_the_local_tokens_and_logits(suite, case, workers, pools, tmp_path_factory):
    fx = suite.oracle(case, tmp_path_factory)
    local = _generate(fx)
    assert local.token_ids == fx.tokens[:TOKENS]  # the local run is transformers' (the family suites check it all)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remote = _generate(fx, compute="ray", compute_options={"pool": pools[workers]})
    stats = remote.stats.compute
    # first what the workers did: a late answer's experts computed by the coordinator would explain other bits
    assert stats["fallback_experts"] == 0 and stats["requests"] > 0, {k: v for k, v in stats.items() if k != "workers"}
    assert remote.token_ids == local.token_ids
    for a, b in zip(remote.logits, local.logits):
        assert np.array_equal(a, b), "logits are not bit-identical to the local run"
    assert not caught, [str(w.message) for w in caught]
    served = [w["experts"] for w in stats["workers"].values()]
    assert len(served) == workers and sum(served) > 0
    assert stats["network_bytes_sent"] > 0 and stats["network_bytes_received"] > 0
