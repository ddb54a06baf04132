"""Real models on "boxed", the backend that offers the contract and nothing more
(``boxed_backend.py``): OLMoE (attention + softmax router), a Qwen3-Next hybrid (Gated
DeltaNet + gated attention + shared experts), DeepSeek-V3.2 (MLA + DSA + the grouped
sigmoid router) and DeepSeek-V4 (hyper-connections, window and compressed attention with
sinks, hash routing) give transformers' tokens through every test of their family's
oracle suite. That the core runs on these boxes proves it uses only the contract.

Each suite is its family's own, restricted to one case and to the boxed backend.
"""

import sys
from pathlib import Path

import pytest

import boxed_backend
from colibri_core.testing import registered_plugin

FAMILIES = Path(__file__).resolve().parents[1] / "families"
for family in ("colibri-olmoe", "colibri-qwen", "colibri-deepseek"):
    # the families' test modules import their helpers (ds_configs) by name
    if str(FAMILIES / family / "tests") not in sys.path:
        sys.path.append(str(FAMILIES / family / "tests"))

pytest.importorskip("transformers")
import test_deepseek_v32_oracle as deepseek  # noqa: E402
import test_deepseek_v4_oracle as deepseek_v4  # noqa: E402
import test_olmoe_oracle as olmoe  # noqa: E402
import test_qwen_oracle as qwen  # noqa: E402


@pytest.fixture(autouse=True)
def boxed_registered(fresh_plugin_manager):
    with registered_plugin(boxed_backend, "boxed-backend"):
        yield


def on_boxed(suite, case: str):
    """``suite`` restricted to its oracle case ``case``, run on the boxed backend."""
    return type(f"{suite.__name__}OnBoxed", (suite,), {"cases": {case: suite.cases[case]}, "backends": ("boxed",),
                                                        "__module__": __name__})


# GQA, several shards, renormalised top-k; also the fused expert layout
TestOlmoeOnBoxed = on_boxed(olmoe.TestOlmoeOracle, "sharded_gqa_norm_topk")
# a 100-token prompt crossing the DeltaNet chunk size; a dense layer; also the fused layout
TestQwen3NextOnBoxed = on_boxed(qwen.TestQwen3NextOracle, "hybrid_dense_layer")
# each query sees only its 4 best keys; sigmoid router with a correction bias
TestDeepseekV32OnBoxed = on_boxed(deepseek.TestDeepseekV32Oracle, "sparse_top4")
# hyper-connections, window + CSA + HCA attention with sinks, hash and sqrt-softplus routers
TestDeepseekV4OnBoxed = on_boxed(deepseek_v4.TestDeepseekV4Oracle, "mixed")
