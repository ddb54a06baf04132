"""End to end: malformed model directories through the real ``colibri run``.

Each case starts from a valid small demo model, damages one thing, and runs the CLI in a
subprocess with a 3 GiB address-space limit (an absurd allocation fails loudly instead of
swapping). Every case must exit non-zero with exactly one stderr line, "error: ...",
naming what is wrong (file, tensor or field), and no traceback. The undamaged copy runs.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri_core.io.checkpoint import INDEX_NAME
from colibri_core.cli.demo import DemoSpec, build_demo_model
from colibri_core.io.safetensors import write_safetensors
from colibri_core.testing import DELETE, edit_config

SPEC = DemoSpec(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_experts=4, num_experts_per_tok=2,
                intermediate_size=16, tokenizer_vocab=300, shard_bytes=20000)
ADDRESS_SPACE = 3 << 30
TIMEOUT_S = 60

Q0 = "model.layers.0.self_attn.q_proj.weight"
K0 = "model.layers.0.self_attn.k_proj.weight"
NORM0 = "model.layers.0.input_layernorm.weight"
EXPERT0 = "model.layers.0.mlp.experts.0.gate_proj.weight"
EXPERT_L1 = "model.layers.1.mlp.experts.2.down_proj.weight"
EMBED = "model.embed_tokens.weight"


# -- running the CLI -------------------------------------------------------------------
def _limit_memory():
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = ADDRESS_SPACE if hard == resource.RLIM_INFINITY else min(ADDRESS_SPACE, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def run_cli(model_dir) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("COLIBRI_DEBUG", None)
    # fewer native threads: each reserves address space, and the limit is on address space
    env.update(OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2", RAYON_NUM_THREADS="2")
    return subprocess.run(
        [sys.executable, "-m", "colibri_core", "run", "--model", str(model_dir), "--token-ids", "1,2,3", "--max-tokens", "2"],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env, preexec_fn=_limit_memory,
    )


# -- editing a model directory ---------------------------------------------------------
def read_shard(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_shard(path: Path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def weight_map(d: Path) -> dict[str, str]:
    return json.loads((d / INDEX_NAME).read_text())["weight_map"]


def set_weight_map(d: Path, mapping: dict[str, str]) -> None:
    index = json.loads((d / INDEX_NAME).read_text())
    index["weight_map"] = mapping
    (d / INDEX_NAME).write_text(json.dumps(index))


def shard_of(d: Path, tensor: str) -> Path:
    return d / weight_map(d)[tensor]


def edit_header(d: Path, tensor: str, edit) -> str:
    """Apply ``edit(entry, header, data_size)`` to one tensor's header entry; returns the shard name."""
    path = shard_of(d, tensor)
    header, data = read_shard(path)
    edit(header[tensor], header, len(data))
    write_shard(path, header, data)
    return path.name


def shard_tensors(path: Path) -> list[tuple[str, tuple[str, np.ndarray]]]:
    """A shard's tensors as write_safetensors values, in file order (all BF16 here)."""
    header, data = read_shard(path)
    header.pop("__metadata__", None)
    out = []
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        assert e["dtype"] == "BF16"
        begin, end = e["data_offsets"]
        out.append((name, ("BF16", np.frombuffer(data[begin:end], dtype="<u2").reshape(e["shape"]))))
    return out




# -- the cases: each damages a copy of the model and returns what the error must name ---
# A fragment that is a tuple is satisfied by any one of its members.
def truncated_shard(d):
    path = shard_of(d, Q0)
    header, data = read_shard(path)
    cut = len(data) // 2
    path.write_bytes(path.read_bytes()[: -(len(data) - cut)])
    header.pop("__metadata__")
    offending = tuple(repr(n) for n, e in header.items() if e["data_offsets"][1] > cut)
    assert offending
    return [path.name, "truncated", offending]


def truncated_to_nothing(d):
    path = shard_of(d, EMBED)
    path.write_bytes(path.read_bytes()[:5])
    return [path.name, "too short"]


def truncated_inside_header(d):
    path = shard_of(d, Q0)
    path.write_bytes(path.read_bytes()[:200])
    return [path.name, "header length", "past the end"]


def header_not_json(d):
    path = shard_of(d, Q0)
    raw = bytearray(path.read_bytes())
    raw[8] = ord("[")  # '{' -> '[' : the header no longer parses
    path.write_bytes(bytes(raw))
    return [path.name, "not valid JSON"]


def offsets_out_of_range(d):
    def edit(e, header, size):
        n = e["data_offsets"][1] - e["data_offsets"][0]
        e["data_offsets"] = [size, size + n]

    return [edit_header(d, EXPERT0, edit), repr(EXPERT0), "data section"]


def offsets_decreasing(d):
    def edit(e, header, size):
        e["data_offsets"] = e["data_offsets"][::-1]

    return [edit_header(d, NORM0, edit), repr(NORM0), "increasing"]


def overlapping_tensors(d):
    def edit(e, header, size):
        e["data_offsets"] = list(header[Q0]["data_offsets"])  # k_proj now lies on q_proj's bytes

    return [edit_header(d, K0, edit), repr(K0), repr(Q0), "overlap"]


def dtype_length_mismatch(d):
    def edit(e, header, size):
        e["dtype"] = "F32"  # twice the bytes the offsets span

    return [edit_header(d, EXPERT_L1, edit), repr(EXPERT_L1), "F32", "data_offsets span"]


def unknown_dtype(d):
    def edit(e, header, size):
        e["dtype"] = "F128"

    return [edit_header(d, NORM0, edit), repr(NORM0), "unknown dtype"]


def unreadable_dtype(d):
    def edit(e, header, size):
        e["dtype"] = "I16"  # a valid safetensors dtype of the right size, but no weight format

    return [edit_header(d, Q0, edit), repr(Q0), "I16"]


def negative_dimension(d):
    def edit(e, header, size):
        e["shape"] = [-32, -32]

    return [edit_header(d, Q0, edit), repr(Q0), "bad shape"]


def metadata_not_strings(d):
    path = shard_of(d, EMBED)
    header, data = read_shard(path)
    header["__metadata__"] = {"format": 1}
    write_shard(path, header, data)
    return [path.name, "__metadata__"]


def duplicate_across_shards(d):
    home = shard_of(d, NORM0)
    value = dict(shard_tensors(home))[NORM0]
    other = shard_of(d, "model.norm.weight")
    write_safetensors(other, shard_tensors(other) + [(NORM0, value)])
    return [repr(NORM0), home.name, other.name, "two shards"]


def duplicate_across_shards_without_index(d):
    found = duplicate_across_shards(d)
    (d / INDEX_NAME).unlink()
    return found


def missing_tensor_still_indexed(d):
    path = shard_of(d, EXPERT_L1)
    write_safetensors(path, [(n, v) for n, v in shard_tensors(path) if n != EXPERT_L1])
    return [INDEX_NAME, repr(EXPERT_L1), "in no shard"]


def missing_tensor(d):
    path = shard_of(d, EXPERT_L1)
    write_safetensors(path, [(n, v) for n, v in shard_tensors(path) if n != EXPERT_L1])
    set_weight_map(d, {k: v for k, v in weight_map(d).items() if k != EXPERT_L1})
    return ["missing tensor", repr(EXPERT_L1)]


def missing_shard(d):
    path = shard_of(d, "lm_head.weight")
    path.unlink()
    return [INDEX_NAME, repr(path.name), "missing"]


def index_not_json(d):
    (d / INDEX_NAME).write_text('{"weight_map": {')
    return [INDEX_NAME, "not valid JSON"]


def index_escapes_directory(d):
    mapping = weight_map(d)
    outside = d.parent / "x.safetensors"
    shutil.copy(shard_of(d, "lm_head.weight"), outside)  # a real, valid file: only its place is wrong
    mapping["lm_head.weight"] = "../x.safetensors"
    set_weight_map(d, mapping)
    return [INDEX_NAME, "'../x.safetensors'", "outside the model directory"]


def no_weights(d):
    for path in d.glob("*.safetensors"):
        path.unlink()
    (d / INDEX_NAME).unlink()
    return [str(d), "no *.safetensors"]


def directory_named_like_a_shard(d):
    (d / INDEX_NAME).unlink()
    (d / "model-00006-of-00005.safetensors").mkdir()
    return [str(d), "'model-00006-of-00005.safetensors'", "not a regular file"]


def absurd_hidden_size(d):
    edit_config(d, hidden_size=10**12)
    return ["config.json", "'hidden_size'", str(10**12)]


def absurd_layer_count(d):
    edit_config(d, num_hidden_layers=10**9)
    return ["config.json", "'num_hidden_layers'", str(10**9)]


def absurd_expert_count(d):
    edit_config(d, num_experts=10**8)
    return ["config.json", "'num_experts'"]


def vocab_disagrees_with_tensor(d):
    edit_config(d, vocab_size=SPEC.vocab_size * 2)  # within range, wrong for the checkpoint
    return [weight_map(d)[EMBED], repr(EMBED), f"[{SPEC.vocab_size}, {SPEC.hidden_size}]",
            f"[{SPEC.vocab_size * 2}, {SPEC.hidden_size}]"]


def intermediate_size_disagrees(d):
    edit_config(d, intermediate_size=24)
    return [weight_map(d)[EXPERT0], repr(EXPERT0), f"[24, {SPEC.hidden_size}]"]


def tensor_shape_disagrees_with_config(d):
    def edit(e, header, size):
        e["shape"] = [16, 64]  # same byte count, so only the config check can notice

    return [edit_header(d, Q0, edit), repr(Q0), "[16, 64]", "[32, 32]"]


def heads_do_not_divide_hidden(d):
    edit_config(d, num_attention_heads=5, num_key_value_heads=5)
    return ["config.json", "num_attention_heads", "divisible"]


def hidden_size_wrong_type(d):
    edit_config(d, hidden_size="32")
    return ["config.json", "'hidden_size'", "'32'"]


def missing_config_field(d):
    edit_config(d, num_experts=DELETE)
    return ["config.json", "missing field", "'num_experts'"]


def rope(d, **params):
    edit_config(d, rope_parameters={"rope_theta": 10000.0, **params})


def rope_linear_factor_zero(d):
    rope(d, rope_type="linear", factor=0)  # would divide by zero: NaN logits, not an error
    return ["config.json", "'factor'"]


def rope_llama3_zero_low_freq_factor(d):
    rope(d, rope_type="llama3", factor=8.0, low_freq_factor=0, high_freq_factor=4.0, original_max_position_embeddings=32)
    return ["config.json", "'low_freq_factor'"]


def rope_yarn_zero_original_length(d):
    rope(d, rope_type="yarn", factor=2.0, original_max_position_embeddings=0)
    return ["config.json", "'original_max_position_embeddings'"]


def rope_yarn_beta_not_a_number(d):
    rope(d, rope_type="yarn", factor=2.0, original_max_position_embeddings=32, beta_fast="fast")
    return ["config.json", "'beta_fast'", "'fast'"]


def rope_yarn_mscale_not_a_number(d):
    rope(d, rope_type="yarn", factor=2.0, original_max_position_embeddings=32, mscale="1", mscale_all_dim=1.0)
    return ["config.json", "'mscale'"]


def rope_yarn_without_factor_or_context(d):
    rope(d, rope_type="yarn", original_max_position_embeddings=32)
    edit_config(d, max_position_embeddings=None)
    return ["config.json", "'max_position_embeddings'"]


def rope_partial_factor_not_a_number(d):
    rope(d, rope_type="default", partial_rotary_factor="half")
    return ["config.json", "'partial_rotary_factor'"]


def unknown_model_type(d):
    edit_config(d, model_type="no_such_moe", architectures=["NoSuchMoeForCausalLM"])
    return ["'no_such_moe'", "NoSuchMoeForCausalLM", "no installed family"]


def unknown_model_type_with_known_architecture(d):
    # a model_type we do not know is never second-guessed from architectures
    edit_config(d, model_type="olmoe_v9")
    return ["'olmoe_v9'", "no installed family"]


def config_errors_name_the_full_path(d):
    edit_config(d, num_attention_heads=0)
    return [str(d / "config.json"), "'num_attention_heads'"]


def negative_rms_norm_eps(d):
    edit_config(d, rms_norm_eps=-1e-5)
    return [str(d / "config.json"), "'rms_norm_eps'"]


def tensor_named_twice_in_one_header(d):
    path = shard_of(d, NORM0)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n].decode()
    entry = header[header.index(f'"{NORM0}"') :].split("}", 1)[0] + "}"
    doubled = header.replace(entry, entry + "," + entry, 1).encode()
    path.write_bytes(struct.pack("<Q", len(doubled)) + doubled + raw[8 + n :])
    return [path.name, NORM0, "twice"]


def model_is_a_file(d):
    shutil.rmtree(d)
    d.write_text("not a model")
    return [str(d), "not a directory"]


def model_type_not_a_string(d):
    edit_config(d, model_type=["olmoe"])
    return ["config.json", "'model_type'"]


def config_not_json(d):
    (d / "config.json").write_text('{"model_type": "olmoe",')
    return [str(d / "config.json"), "not valid JSON"]


def config_not_an_object(d):
    (d / "config.json").write_text("[1, 2, 3]")
    return [str(d / "config.json"), "JSON object"]


def config_missing(d):
    (d / "config.json").unlink()
    return [str(d / "config.json"), "not found"]


def model_dir_missing(d):
    shutil.rmtree(d)
    return [str(d), "does not exist"]


def tokenizer_not_json(d):
    (d / "tokenizer.json").write_text("{")
    return ["tokenizer.json"]


def bad_eos_token(d):
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "<eos>"}))
    return ["generation_config.json", "eos_token_id"]


# -- special files: refused before they are opened (a FIFO blocks the open, /dev/zero is
# endless); a directory or a symlink loop where a file belongs is a clean error too
def make_special(path: Path, kind: str) -> list:
    """Replace ``path`` with a special file of ``kind``; returns what the error must say."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        return [str(path), "named pipe (FIFO)"]
    if kind == "dev_zero":
        path.symlink_to("/dev/zero")
        return [str(path), "character device", "/dev/zero"]
    if kind == "directory":
        path.mkdir()
        return [str(path), "is a directory"]
    assert kind == "loop"
    path.symlink_to(path.name)
    return [str(path), "symlink loop"]


def special(name: str, kind: str):
    def case(d):
        target = d / name if name != "shard" else shard_of(d, Q0)
        found = make_special(target, kind)
        return [INDEX_NAME, repr(target.name), found[1]] if name == "shard" else found

    case.__name__ = f"{name.replace('.', '_')}_is_{kind}"
    return case


SPECIAL_CASES = [special(name, kind) for name, kinds in [
    ("config.json", ("fifo", "dev_zero", "directory", "loop")),
    (INDEX_NAME, ("fifo", "dev_zero", "directory", "loop")),
    ("tokenizer.json", ("fifo", "dev_zero", "directory", "loop")),
    ("generation_config.json", ("fifo", "dev_zero")),
    ("tokenizer_config.json", ("fifo", "dev_zero")),
    ("chat_template.jinja", ("fifo", "dev_zero")),
    ("shard", ("fifo", "dev_zero", "loop")),
] for kind in kinds]


CASES = {f.__name__: f for f in SPECIAL_CASES + [
    truncated_shard, truncated_to_nothing, truncated_inside_header, header_not_json, offsets_out_of_range,
    offsets_decreasing, overlapping_tensors, dtype_length_mismatch, unknown_dtype, unreadable_dtype,
    negative_dimension, metadata_not_strings, duplicate_across_shards, duplicate_across_shards_without_index,
    missing_tensor_still_indexed, missing_tensor, missing_shard, index_not_json, index_escapes_directory, no_weights,
    directory_named_like_a_shard, absurd_hidden_size, absurd_layer_count, absurd_expert_count,
    vocab_disagrees_with_tensor, intermediate_size_disagrees, tensor_shape_disagrees_with_config,
    heads_do_not_divide_hidden, hidden_size_wrong_type, missing_config_field, rope_linear_factor_zero,
    rope_llama3_zero_low_freq_factor, rope_yarn_zero_original_length, rope_yarn_beta_not_a_number,
    rope_yarn_mscale_not_a_number, rope_yarn_without_factor_or_context, rope_partial_factor_not_a_number,
    unknown_model_type, unknown_model_type_with_known_architecture, config_errors_name_the_full_path,
    negative_rms_norm_eps, tensor_named_twice_in_one_header, model_is_a_file,
    model_type_not_a_string, config_not_json, config_not_an_object, config_missing, model_dir_missing,
    tokenizer_not_json, bad_eos_token,
]}


# -- fixtures and tests ----------------------------------------------------------------
@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("base") / "model"
    build_demo_model(d, SPEC)
    assert len(list(d.glob("*.safetensors"))) >= 4, "the cases need a multi-shard model"
    return d


@pytest.fixture
def model_copy(base_model, tmp_path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(base_model, d)
    return d


def assert_one_line_error(proc: subprocess.CompletedProcess, fragments) -> str:
    everything = proc.stdout + proc.stderr
    assert "Traceback" not in everything, everything
    assert proc.returncode != 0, everything
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("error: "), line
    for fragment in fragments:
        options = fragment if isinstance(fragment, tuple) else (fragment,)
        assert any(o in line for o in options), f"{options} not in: {line}"
    return line


@pytest.mark.parametrize("damaged", [False, True, "no_model_type"], ids=["intact", "intact_without_index", "architectures_only"])
def test_positive_control_runs(model_copy, damaged):
    if damaged is True:  # without the index every *.safetensors file is read: still a valid model
        (model_copy / INDEX_NAME).unlink()
    elif damaged == "no_model_type":  # without model_type, architectures select the family
        edit_config(model_copy, model_type=DELETE)
    proc = run_cli(model_copy)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "error" not in proc.stderr
    assert proc.stdout.strip(), "no generated text"


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_model_is_refused_in_one_line(model_copy, case):
    fragments = CASES[case](model_copy)
    proc = run_cli(model_copy)
    assert_one_line_error(proc, fragments)
    assert proc.returncode == 2  # every ColibriError's exit code; 70 would be an internal error


# -- special files through every command that reads a model ------------------------------
COMMAND_TIMEOUT_S = 60  # a regression that blocks on a FIFO fails here instead of hanging the suite


def run_command(command: str, model_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    args = {"run": ["run", "--model", model_dir, "--token-ids", "1,2,3", "--max-tokens", "2"],
            "doctor": ["doctor", "--model", model_dir, "--json"],
            "plan": ["plan", "--model", model_dir],
            "convert": ["convert", "--model", model_dir, "--out", tmp_path / "converted"],
            "chat": ["chat", "--model", model_dir]}[command]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2", RAYON_NUM_THREADS="2")
    env.pop("COLIBRI_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "colibri_core", *map(str, args)], input="", capture_output=True,
                          text=True, timeout=COMMAND_TIMEOUT_S, env=env, preexec_fn=_limit_memory)


# plan reads the config, the index and the shards, not the tokenizer or the generation config
READERS = {"config.json": ("run", "doctor", "plan", "convert", "chat"),
           INDEX_NAME: ("run", "doctor", "plan", "convert", "chat"),
           "tokenizer.json": ("run", "doctor", "convert", "chat"),
           "generation_config.json": ("run", "doctor", "convert", "chat")}


@pytest.mark.parametrize("command", ["run", "doctor", "plan", "convert", "chat"])
@pytest.mark.parametrize("name, kind", [("config.json", "fifo"), ("config.json", "dev_zero"), ("config.json", "directory"),
                                        ("config.json", "loop"), (INDEX_NAME, "fifo"), (INDEX_NAME, "dev_zero"),
                                        ("tokenizer.json", "fifo"), ("tokenizer.json", "dev_zero"),
                                        ("generation_config.json", "fifo")])
def test_special_files_are_refused_by_every_command(model_copy, tmp_path, command, name, kind):
    fragments = make_special(model_copy / name, kind)
    proc = run_command(command, model_copy, tmp_path)
    if command not in READERS[name]:
        assert proc.returncode == 0, proc.stdout + proc.stderr  # never opened, so never in the way
    elif command == "doctor":  # every check in a table; a failed one exits 1
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
        failed = [c["detail"] for c in json.loads(proc.stdout)["checks"] if c["status"] == "fail"]
        assert any(all(f in detail for f in fragments) for detail in failed), failed
    else:
        assert_one_line_error(proc, fragments)
        assert proc.returncode == 2


@pytest.mark.parametrize("kind", ["fifo", "dev_zero"])
def test_colibris_own_files_as_special_files_are_never_read(model_copy, tmp_path, kind):
    """The routing history and the integrity manifest are colibri's, not the model's: a
    special file in their place is reported, never read. The history is ignored with a
    warning and the run goes on; ``--verify``, which needs the manifest, fails on it."""
    from colibri_core.experts.history import FILENAME
    from colibri_core.io.integrity import MANIFEST_NAME

    what = make_special(model_copy / FILENAME, kind)[1]
    make_special(model_copy / MANIFEST_NAME, kind)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), OPENBLAS_NUM_THREADS="2", OMP_NUM_THREADS="2")
    env.pop("COLIBRI_DEBUG", None)

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "colibri_core", "run", "--model", str(model_copy), "--token-ids",
                               "1,2,3", "--max-tokens", "2", "-q", *extra], capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, env=env, preexec_fn=_limit_memory)

    proc = run()
    assert proc.returncode == 0, proc.stderr
    assert any(FILENAME in line and what in line and "ignored" in line for line in proc.stderr.splitlines()), proc.stderr
    make_special(model_copy / FILENAME, kind)  # the run saved a real history in its place
    proc = run("--verify")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert any(MANIFEST_NAME in line and what in line for line in proc.stderr.splitlines()), proc.stderr
