"""benchmarks/train/train.py: a few steps of each recipe give a checkpoint colibri loads,
the same weights twice from the same seed, and a report that says what it measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import colibri_core  # noqa: E402

TRAIN = Path(__file__).resolve().parents[1] / "benchmarks" / "train" / "train.py"


def train(recipe: str, out: Path, work: Path, steps: int = 2) -> dict:
    done = subprocess.run([sys.executable, str(TRAIN), recipe, "--out", str(out), "--work", str(work),
                           "--steps", str(steps)], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "training.json").read_text())


@pytest.mark.slow  # builds the corpus and trains a tokenizer (about a minute), then trains and evaluates 3 times
def test_a_few_steps_train_reproducibly_into_checkpoints_colibri_runs(tmp_path):
    work = tmp_path / "work"
    a = train("olmoe", tmp_path / "a", work)
    b = train("olmoe", tmp_path / "b", work)
    assert a["weights_sha256"] == b["weights_sha256"]
    assert a["steps"] == 2 and a["training_tokens"] == 2 * 16 * 256
    manifest = json.loads((work / "corpus" / "manifest.json").read_text())
    assert {f["domain"] for f in manifest["files"]} == {"python", "c", "prose", "data"}
    assert all(f["license"] and len(f["sha256"]) == 64 for f in manifest["files"])
    assert set(a["perplexity"]) == set(a["unigram_perplexity"]) == {"python", "c", "prose", "data"}
    assert len(a["expert_load"]["max_over_mean"]) == 16
    for domain in ("python", "c", "prose", "data"):
        assert (tmp_path / "a" / "heldout" / f"{domain}.txt").stat().st_size > 10_000
    assert (tmp_path / "a" / "colibri-read-only").exists()

    ds = train("deepseek_v3", tmp_path / "ds", work)
    assert set(ds["mtp_top1_accuracy"]) == {"python", "c", "prose", "data"}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ds" / "model.safetensors"), "np") as f:
        names = set(f.keys())
    n = 6  # the recipe's num_hidden_layers: the MTP layer is model.layers.6.*
    for part in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens",
                 "self_attn.kv_a_proj_with_mqa", "mlp.gate", "mlp.experts.63.down_proj", "mlp.shared_experts.up_proj"):
        assert f"model.layers.{n}.{part}.weight" in names, part
    for path in (tmp_path / "a", tmp_path / "ds"):
        with colibri_core.load(path, history=False, cap=2) as model:
            result = model.generate("def main(", max_tokens=4, ignore_eos=True)
        assert len(result.token_ids) == 4
