"""The benchmark tooling of issue #20 at a tiny scale: the frontier-shaped fp8 checkpoint
generator, the residual-mix predictability knob, prefetch calibration, what ``colibri
bench`` reports about the generated sequence, and the streaming table script."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_core.io.safetensors import SafetensorsFile
from colibri_core.testing.cli import run_colibri

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
OLMOE_TINY = ["--layers", "4", "--hidden", "64", "--intermediate", "32", "--experts", "16", "--top-k", "4",
              "--vocab", "256", "--heads", "4"]


def script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def generate(kind: str, out: Path, *args: str) -> Path:
    cmd = [sys.executable, str(BENCH / f"synthetic_{kind}.py"), "--out", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out


def frontier(out: Path, *args: str) -> Path:
    """A tiny frontier checkpoint, written in this process (the script's own write)."""
    gen = script("synthetic_frontier")
    return gen.write(gen.parse(["--out", str(out), "--tiny", "--moe-layers", "3", *args]))


@pytest.fixture(scope="module")
def low(tmp_path_factory) -> Path:
    """A tiny frontier checkpoint whose routing is predictable (the default mix)."""
    return frontier(tmp_path_factory.mktemp("low") / "fr", "--residual-mix", "0.02")


@pytest.fixture(scope="module")
def high(tmp_path_factory) -> Path:
    """The same geometry with large writes into the residual stream."""
    return frontier(tmp_path_factory.mktemp("high") / "fr", "--residual-mix", "4")


def tensors(model: Path) -> dict:
    found = {}
    for shard in sorted(model.glob("*.safetensors")):
        f = SafetensorsFile(shard)
        found.update(f.tensors)
        f.close()
    return found


def digest(model: Path) -> str:
    h = hashlib.sha256()
    for shard in sorted(model.glob("*.safetensors")):
        h.update(shard.read_bytes())
    return h.hexdigest()


def colibri_run(model: Path, *args: str) -> dict:
    done = run_colibri("run", "--model", model, "--token-ids", "3,1,4,1,5", "--max-tokens", "6", "--ignore-eos",
                       "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_frontier_checkpoint_has_deepseek_fp8_layout(low):
    model = low
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["quantization_config"]["weight_block_size"] == [128, 128]
    found = tensors(model)
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == set(found)
    experts = [n for n in found if ".mlp.experts." in n and n.endswith(".weight")]
    assert len(experts) == 3 * 16 * 3
    for name in experts + ["model.layers.0.self_attn.kv_b_proj.weight", "model.layers.2.mlp.shared_experts.down_proj.weight"]:
        t, s = found[name], found[name + "_scale_inv"]
        assert t.dtype == "F8_E4M3" and s.dtype == "F32"
        assert s.shape == tuple(-(-d // 128) for d in t.shape)
    assert found["model.layers.1.mlp.gate.weight"].dtype == "BF16"
    assert found["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == "F32"
    # one expert's matrices and scales lie together: colibri reads it in one request
    e = sorted((t for n, t in found.items() if ".layers.1.mlp.experts.5." in n), key=lambda t: t.offset)
    assert all(a.offset + a.nbytes == b.offset for a, b in zip(e, e[1:]))
    assert not list(model.parent.glob(".fr.partial-*"))  # the partial directory was renamed into place


def test_frontier_dequantised_weights_have_the_drawn_scale(high):
    """value * block scale is N(0, std^2): down_proj residual_mix / sqrt(fan-in), others 1 / sqrt(fan-in)."""
    from colibri_core.formats.fp8 import dequantize, e4m3_to_f32

    model = high
    found = tensors(model)

    def read(info):
        f = SafetensorsFile(info.path)
        with open(info.path, "rb") as raw:
            raw.seek(info.offset)
            data = np.frombuffer(raw.read(info.nbytes), dtype=np.uint8)
        f.close()
        return data

    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    w, s = found[name], found[name + "_scale_inv"]
    values = dequantize(e4m3_to_f32(read(w).reshape(w.shape)), read(s).view(np.float32).reshape(s.shape), (128, 128))
    assert values.std() == pytest.approx(4 / np.sqrt(w.shape[1]), rel=0.1)
    up = found["model.layers.1.mlp.experts.3.up_proj.weight"]
    up_s = found[up.name + "_scale_inv"]
    up_values = dequantize(e4m3_to_f32(read(up).reshape(up.shape)), read(up_s).view(np.float32).reshape(up_s.shape),
                           (128, 128))
    assert up_values.std() == pytest.approx(1 / np.sqrt(up.shape[1]), rel=0.1)


def test_frontier_bytes_depend_on_the_seed_not_on_threads(tmp_path):
    one = digest(frontier(tmp_path / "one", "--threads", "1", "--vocab", "2500"))
    # the embedding in 3 pieces, drawn by 3 threads: the same bytes
    assert digest(frontier(tmp_path / "three", "--threads", "3", "--vocab", "2500")) == one
    assert digest(frontier(tmp_path / "seed1", "--threads", "1", "--vocab", "2500", "--seed", "1")) != one


def test_frontier_runs_natively_in_fp8_and_deterministically(low, high):
    import colibri_core
    from colibri_core.formats.base import QuantTensor

    model = low
    first, second = colibri_run(model), colibri_run(model)
    assert len(first["token_ids"]) == 6 and first["token_ids"] == second["token_ids"]
    assert first["stats"]["misses"] > 0  # experts were streamed from the checkpoint
    with colibri_core.load(model) as m:
        assert m.lm.vocab_size == 256
        weights = m.store.disk.load(1, 2, m.store.layouts[1][2])  # as the store reads an expert
        kinds = {type(a).__name__ if not isinstance(a, QuantTensor) else a.kind for a in weights.arrays.values()}
        assert kinds == {"fp8"}, kinds  # kept as e4m3 + block scales, computed by the fp8 kernel
    assert colibri_run(high)["token_ids"] != first["token_ids"]  # the tokens come from the weights


def test_existing_output_is_refused_and_bad_options_named(tmp_path):
    (tmp_path / "fr").mkdir()
    cmd = [sys.executable, str(BENCH / "synthetic_frontier.py"), "--tiny", "--out", str(tmp_path / "fr")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "already exists" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run([*cmd[:-1], str(tmp_path / "x"), "--residual-mix", "0"], capture_output=True, text=True)
    assert done.returncode != 0 and "--residual-mix" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("kind", ["frontier", "olmoe"])
def test_residual_mix_lowers_prefetch_precision(tmp_path, kind, request):
    calibrate = script("prefetch_calibrate")
    if kind == "frontier":
        models = request.getfixturevalue("low"), request.getfixturevalue("high")
    else:
        models = [generate("olmoe", tmp_path / m, *OLMOE_TINY, "--residual-mix", m) for m in ("0.02", "4")]
    low, high = (calibrate.measure(m, tokens=16, runs=2) for m in models)
    assert low["synthetic"]["residual_mix"] == 0.02 and high["synthetic"]["residual_mix"] == 4
    assert low["precision"] > 0.9, low
    assert high["precision"] < low["precision"] - 0.15, (low["precision"], high["precision"])
    for r in (low, high):
        assert 0 < r["expert_coverage_mean"] <= 1 and 1 <= r["distinct_tokens"] <= 16


def test_write_gain_lowers_precision_and_keeps_routing_spread(tmp_path):
    """The residual mix buys unpredictability with concentrated routing; the write gain must not."""
    calibrate = script("prefetch_calibrate")
    plain = generate("olmoe", tmp_path / "plain", *OLMOE_TINY)
    off = generate("olmoe", tmp_path / "off", *OLMOE_TINY, "--write-gain", "0")
    assert digest(off) == digest(plain)  # gain 0 writes the checkpoint without the knob
    models = [generate("olmoe", tmp_path / g, *OLMOE_TINY, "--write-gain", g) for g in ("1", "4")]
    base, mid, far = (calibrate.measure(m, tokens=16, runs=2) for m in (plain, *models))
    assert mid["synthetic"]["write_gain"] == 1 and far["synthetic"]["write_gain"] == 4
    assert base["precision"] > 0.9 and far["precision"] < mid["precision"] < base["precision"] - 0.15, \
        (base["precision"], mid["precision"], far["precision"])
    for r in (mid, far):
        assert r["expert_coverage_mean"] > 0.85 and r["distinct_tokens"] >= 12, r


def test_write_gain_options_are_checked_before_anything_is_written(tmp_path):
    cmd = [sys.executable, str(BENCH / "synthetic_olmoe.py"), "--out", str(tmp_path / "x")]
    for args, named in ((["--write-gain", "-1"], "--write-gain must be 0 or more"),
                        (["--write-gain", "1", "--hidden", "4", "--heads", "1", "--layers", "4"], "--hidden")):
        done = subprocess.run([*cmd, *args], capture_output=True, text=True)
        assert done.returncode == 2 and named in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert not (tmp_path / "x").exists()
    sweep = subprocess.run([sys.executable, str(BENCH / "prefetch_calibrate.py"), "sweep", "--generator", "frontier",
                            "--write-gains", "1"], capture_output=True, text=True)
    assert sweep.returncode != 0 and "only the olmoe generator" in sweep.stderr and "Traceback" not in sweep.stderr


def test_measured_generation_counts_only_the_decode(high):
    """Coverage and decode prefetch precision against the store's own per-layer calls,
    recorded independently (the prefill is each layer's first call)."""
    import colibri_core
    from colibri_core.cli.bench import measured_generation

    with colibri_core.load(high, prefetch=True, history="read") as m:
        calls: dict[int, list[set[int]]] = {}
        end_layer = m.store.end_layer

        def spy(layer, indices, experts):
            calls.setdefault(layer, []).append(set(experts.tolist()))
            end_layer(layer, indices, experts)

        m.store.end_layer = spy
        result, got = measured_generation(m, [5, 6, 7, 8, 9, 10], 10, temperature=1.0, seed=3)
    assert len(result.token_ids) == 10 and got["distinct_tokens"] == len(set(result.token_ids))
    assert sorted(calls) == [0, 1, 2] and all(len(c) == 10 for c in calls.values())  # prefill + 9 decode steps
    coverage = [len(set().union(*c[1:])) / 16 for _, c in sorted(calls.items())]
    assert got["expert_coverage"] == pytest.approx(coverage, abs=1e-4)
    assert got["expert_coverage_mean"] == pytest.approx(np.mean(coverage))
    assert 0 <= got["decode_prefetch_precision"] <= 1 and got["decode_prefetch_recall"] is not None


def test_bench_reports_distinct_tokens_coverage_and_prefetch(high):
    model = high
    cmd = ["bench", "--model", model, "--tokens", "8", "--prompt-tokens", "4", "--repeats", "1", "--temperature", "1",
           "--prefetch"]
    done = run_colibri(*cmd, "--json", timeout=180)
    assert done.returncode == 0, done.stderr
    s = json.loads(done.stdout)["summary"]["colibri"]
    assert 1 <= s["distinct_tokens"] <= 8
    assert 0 < s["expert_coverage_mean"] <= 1 and s["expert_coverage_min"] <= s["expert_coverage_mean"]
    for key in ("decode_prefetch_precision", "decode_prefetch_recall", "prefetch_precision", "prefetch_recall"):
        assert 0 <= s[key] <= 1, key
    human = run_colibri(*cmd, env={"COLUMNS": "300"}, timeout=180)  # a row on one line
    assert human.returncode == 0, human.stderr
    assert "distinct tokens" in human.stdout and "expert coverage" in human.stdout and " / 8" in human.stdout


def test_streaming_table_runs_colibri_without_llama_cpp(tmp_path, low, high):
    a, b = low, high
    out = tmp_path / "table"
    cmd = [sys.executable, str(BENCH / "streaming_table.py"), "--model", f"p95={a}", "--model", f"p50={b}",
           "--gguf", f"p95={tmp_path / 'missing.gguf'}", "--tokens", "6", "--prompt-tokens", "4", "--rounds", "2",
           "--bound-gb", "0.001", "--also-without-prefetch", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "p95: llama.cpp is not available" in done.stderr and "p50: llama.cpp is not available" in done.stderr
    data = json.loads((tmp_path / "table.json").read_text())
    assert [(r["round"], r["label"]) for r in data["runs"]] == [(1, "p95"), (1, "p50"), (2, "p95"), (2, "p50")]
    for r in data["runs"]:
        assert "error" not in r["colibri"], r["colibri"]
        assert r["colibri"]["decode_tok_s"] > 0 and r["colibri"]["generated"] == 6 and "llama" not in r
        bound = r["bound"]
        assert bound["bytes_per_s"] > 0 and bound["request_bytes_median"] > 0
        assert isinstance(r["load_before_colibri"], float)
        assert 0 <= r["colibri"]["decode_read_wait_share"] <= 1
        without = r["no_prefetch"]  # --also-without-prefetch: the same run with prefetch off
        assert without["decode_tok_s"] > 0 and without["generated"] == 6
        assert without["decode_prefetch_precision"] is None and r["colibri"]["decode_prefetch_precision"] is not None
    # the pair swaps places every other round, so neither always runs right after the bound's reads
    assert [r["first"] for r in data["runs"]] == ["colibri", "colibri", "no_prefetch", "no_prefetch"]
    med = data["medians"]
    assert med["p95"]["prefetch_gain"] > 0
    assert med["p95"]["precision"] > med["p50"]["precision"]
    table = (tmp_path / "table.md").read_text()
    assert "| 2 | p50 | mix 4.0 |" in table and "llama.cpp not available" in table and "Medians" in table


def test_streaming_table_children_import_the_tree_it_is_run_from(tmp_path, monkeypatch):
    """A copy of the benchmarks beside a stand-in colibri_core: the engines' children must
    import that one (an A/B of two checkouts compares two trees, not one with itself),
    also when run from inside another checkout (the working directory comes first on the
    path of ``python -m`` and ``-c``)."""
    tree = tmp_path / "tree"
    shutil.copytree(BENCH, tree / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "colibri_core").mkdir()
    (tree / "colibri_core" / "__init__.py").write_text("WHICH = 'the copy'\n")
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)  # restored after the test: the function sets it
    spec = importlib.util.spec_from_file_location("bench_tree_table", tree / "benchmarks" / "streaming_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.children_import_this_tree()
    for cwd in (tmp_path, BENCH.parent):  # BENCH.parent: this checkout, with its own colibri_core
        child = subprocess.run([sys.executable, "-c", "import colibri_core; print(getattr(colibri_core, 'WHICH', 'other'))"],
                               capture_output=True, text=True, cwd=cwd, check=True)
        assert child.stdout.strip() == "the copy", cwd


def test_expert_requests_are_one_span_per_expert(low):
    table = script("streaming_table")
    model = low
    requests = table.expert_requests(model)
    assert len(requests) == 3 * 16
    found = tensors(model)
    one = sum(t.nbytes for n, t in found.items() if ".layers.0.mlp.experts.0." in n)
    assert {size for _, _, size in requests} == {one}


def test_expert_requests_split_an_expert_straddling_two_shards(tmp_path):
    """An expert whose tensors lie in two shards is read as two requests (one per file):
    one span from the first shard's offset to the second's end measured large sequential
    reads instead of the ones colibri makes."""
    from colibri_core.io.safetensors import write_safetensors

    table = script("streaming_table")
    w = np.ones((64, 32), dtype=np.float32)
    expert = "model.layers.{}.mlp.experts.{}.{}_proj.weight"
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors",
                      {expert.format(0, 0, "gate"): w, expert.format(0, 0, "up"): w, expert.format(0, 1, "gate"): w,
                       "model.embed_tokens.weight": np.ones((4096, 64), dtype=np.float32)})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors",
                      {expert.format(0, 0, "down"): w, expert.format(0, 1, "up"): w, expert.format(0, 1, "down"): w})
    requests = sorted(table.expert_requests(tmp_path))
    assert [(Path(path).name, size) for path, _, size in requests] == [
        ("model-00001-of-00002.safetensors", 2 * w.nbytes), ("model-00001-of-00002.safetensors", w.nbytes),
        ("model-00002-of-00002.safetensors", w.nbytes), ("model-00002-of-00002.safetensors", 2 * w.nbytes)]


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
@pytest.mark.parametrize("fmt", ["q8", "q4", "q4g32", "fp8", "mxfp4pair"])
def test_kernel_bandwidth_reports_the_kernel_against_the_load_loop(fmt):
    from colibri_core.compute.cpu.backend import CpuBackend

    if CpuBackend().kernels is None:
        pytest.skip("the compiled CPU kernels are not built")
    out = subprocess.run([sys.executable, str(BENCH / "kernel_bandwidth.py"), "--format", fmt, "--layers", "2",
                          "--sweeps", "2", "--read-mib", "8"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"kernel ([\d.]+) GB/s, load loop ([\d.]+) GB/s, ratio median ([\d.]+)", out)
    assert found and out.startswith(f"{fmt}: 2 layers x 8 experts"), out
    kernel, loop, ratio = map(float, found.groups())
    assert kernel > 0 and loop > 0 and ratio > 0


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_kernel_bandwidth_can_keep_one_expert_in_cache():
    from colibri_core.compute.cpu.backend import CpuBackend

    if CpuBackend().kernels is None:
        pytest.skip("the compiled CPU kernels are not built")
    run = [sys.executable, str(BENCH / "kernel_bandwidth.py"), "--format", "q4", "--layers", "1", "--experts", "1",
           "--sweeps", "2", "--read-mib", "8"]
    out = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert out.startswith("q4: 1 layers x 1 experts, 0.003 GiB"), out
    assert float(re.search(r"kernel ([\d.]+) GB/s", out).group(1)) > 0
    bad = subprocess.run(run[:-6] + ["--experts", "0"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--experts" in bad.stderr


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_kernel_bandwidth_traces_the_memory_rate():
    run = [sys.executable, str(BENCH / "kernel_bandwidth.py"), "--trace", "0.5", "--read-mib", "8"]
    out = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    rates = [float(r) for line in out.splitlines() for r in line.split(": ")[1].split()[:-1]]
    assert rates and all(r > 0 for r in rates), out
    bad = subprocess.run(run[:2] + ["--trace", "0"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--trace" in bad.stderr


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_kernel_rows_times_both_kernels_at_every_size(tmp_path):
    import sysconfig

    lib = Path(sysconfig.get_config_var("LIBDIR")) / f"libpython{sysconfig.get_config_var('LDVERSION')}.so"
    if not lib.exists():
        pytest.skip(f"kernel_rows.py links libpython, and {lib} is not here")
    run = [sys.executable, str(BENCH / "kernel_rows.py"), "--gb", "0.02", "--hint", "t0"]
    out = subprocess.run(run, capture_output=True, text=True, check=True).stdout
    assert out.startswith("prefetch hint t0 (PREFETCH_HINT=3)"), out
    if "no AVX2 here" in out:
        return
    found = re.findall(r"^(int8|int4) +(\d+) rows, +[\d.]+ MiB: ([\d.]+) GB/s$", out, re.M)
    assert [(k, int(n)) for k, n, _ in found] == [(k, n) for k in ("int8", "int4") for n in (64, 256, 1024, 4096, 32768)]
    assert all(float(r) > 0 for _, _, r in found)
    bad = subprocess.run(run[:2] + ["--kernels", str(tmp_path / "none.c")], capture_output=True, text=True)
    assert bad.returncode != 0 and "--kernels" in bad.stderr


def test_decode_stages_times_every_stage_without_changing_the_tokens(low, tmp_path):
    import colibri_core
    from colibri_core.nn.stages import STAGES
    from colibri_core.cli.bench import prompt_ids

    stages = script("decode_stages")
    out = tmp_path / "stages.json"
    assert stages.main(["--model", str(low), "--prefetch", "--ram", "6M", "--tokens", "6", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["decode_steps"] == 5  # the first token comes from the prefill, which is not counted
    ms = data["stages_ms_per_token"]
    assert list(ms) == list(STAGES)  # the engine's own stages, as serve's profiling page shows them
    for name in ("embed", "attention", "routers", "routed_experts", "shared_experts", "prefetch", "lm_head"):
        assert ms[name] > 0, (name, ms)
    assert all(v >= 0 for v in ms.values()), ms
    assert abs(sum(data["stages_share"].values()) - 1) < 1e-9
    with colibri_core.load(low, ram="6M", prefetch=True, history="read") as model:  # the clock changed nothing
        plain = model.generate(token_ids=prompt_ids(model.lm.vocab_size, 8, 0), max_tokens=6, ignore_eos=True,
                               temperature=1.0, seed=0)
    assert plain.token_ids == data["token_ids"]
    assert stages.main(["--model", str(low), "--ram", "6M", "--tokens", "6", "--overhead", "2", "--json", str(out)]) == 0
    cost = json.loads(out.read_text())
    assert cost["steps_on"] == cost["steps_off"] == 5 and cost["ratio_tok_s_on_to_off"] > 0  # 2 x 5 steps, alternating
    assert cost["aa_ratio"] > 0


def test_decode_stages_refuses_a_missing_model_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(BENCH / "decode_stages.py"), "--model", str(tmp_path / "absent"),
                           "--tokens", "4"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [f"error: {tmp_path / 'absent'}: does not exist"]


def test_paired_bursts_alternate_two_warm_processes(tmp_path, low, high):
    out = tmp_path / "pairs"
    cmd = [sys.executable, str(BENCH / "paired_bursts.py"), "--model", str(low), "--vs-model", str(high), "--rounds", "2",
           "--bursts", "3", "--tokens", "5", "--prompt-tokens", "3", "--gap", "0", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rounds = json.loads((tmp_path / "pairs.json").read_text())["rounds"]
    a, b = "colibri", "colibri (--vs-model)"
    assert [r["round"] for r in rounds] == [1, 2] and all(r["engines"] == [a, b] for r in rounds)
    for r in rounds:
        assert r["ready"][a]["load_s"] > 0 and r["ready"][b]["load_s"] > 0
        assert [p["burst"] for p in r["bursts"]] == [0, 1, 2, 3]  # burst 0 is the warm-up
        assert [p["first"] for p in r["bursts"]] == [a, b, a, b]
        for p in r["bursts"]:
            assert p[a]["decode_tok_s"] > 0 and p[b]["decode_tok_s"] > 0 and 1 <= p[a]["distinct_tokens"] <= 5
            assert p["ratio"] == pytest.approx(p[a]["decode_tok_s"] / p[b]["decode_tok_s"])
        counted = r["bursts"][1:]
        for name in (a, b):
            rates = sorted(p[name]["decode_tok_s"] for p in counted)
            assert r["median_tok_s"][name] == pytest.approx(rates[1])  # the warm-up is not counted
        assert r["ratio_of_medians"] == pytest.approx(r["median_tok_s"][a] / r["median_tok_s"][b])
        assert r["pair_ratio_min"] <= r["pair_ratio_median"] <= r["pair_ratio_max"]
        for name in (a, b):  # the prompt's prefill, timed in every burst
            times = sorted(p[name]["prefill_s"] for p in counted)
            assert times[0] > 0 and r["median_prefill_s"][name] == pytest.approx(times[1])
        assert r["prefill_time_ratio"] == pytest.approx(r["median_prefill_s"][a] / r["median_prefill_s"][b])
    table = (tmp_path / "pairs.md").read_text()
    assert table == done.stdout and "| 2 |" in table and "ratio of medians by round" in table
    assert f"prefill time, {a} / {b}, by round" in table and "3-token prompt" in table
    assert f"{b}: round medians" in table and "spread" in table


@pytest.mark.parametrize("args, message", [
    ([], "give the peer: --gguf (llama.cpp) or --vs-model (colibri)"),
    (["--vs-model", "{m}", "--gguf", "x.gguf"], "one of them"),
    (["--vs-model", "{m}", "--tokens", "1"], "--tokens must be at least 2"),
    (["--vs-model", "{m}", "--gap", "-1"], "--gap must not be negative"),
    (["--vs-model", "{m}/missing"], "missing: no such file or directory"),
])
def test_paired_bursts_refuses_bad_options_in_one_line(tmp_path, args, message):
    model = tmp_path / "m"
    model.mkdir()
    cmd = [sys.executable, str(BENCH / "paired_bursts.py"), "--model", str(model), *[a.format(m=model) for a in args]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr.strip().splitlines()[-1], done.stderr


def test_paired_bursts_names_the_worker_that_failed(tmp_path, low):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    cmd = [sys.executable, str(BENCH / "paired_bursts.py"), "--model", str(low), "--vs-model", str(empty), "--rounds", "1",
           "--bursts", "1", "--tokens", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1 and last.startswith("the colibri (--vs-model) worker stopped (exit 1)"), done.stderr
    assert "not-a-model" in last
