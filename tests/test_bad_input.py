"""Untrusted input through the real command line and the Python API: every bad file,
bad option or bad byte gets one clear line and a non-zero exit (never 70, "a bug"), and
options are checked before anything is loaded."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import colibri_core
import colibri_core.errors
from colibri_core.cli.run import parse_token_ids
from colibri_core.errors import BackendError, BudgetError, ModelFormatError, UsageError
from colibri_core.experts.history import FILENAME
from colibri_core.io.checkpoint import INDEX_NAME
from colibri_core.testing import edit_config
from colibri_core.testing.demo_specs import SMALL_RANDOM
from colibri_core.warn import ColibriWarning

from colibri_core.testing.cli import colibri_env, run_colibri

SPEC = SMALL_RANDOM  # the model of demo_model and model_dir (tests/conftest.py)
DEEP = 50_000  # nesting levels: far past Python's recursion limit


def one_error_line(out, *fragments, code=2):
    """The process failed with ``code`` and exactly one stderr line naming ``fragments``."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == code, out.stderr
    assert "Traceback" not in out.stderr and "internal error" not in out.stderr, out.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def doctor_checks(model_dir):
    out = run_colibri("doctor", "--model", model_dir, "--json")
    assert out.returncode in (0, 1), out.stderr
    return out.returncode, {c["name"]: c for c in json.loads(out.stdout)["checks"]}


# -- 1. doctor on values of the wrong type ----------------------------------------------
@pytest.mark.parametrize("value", [5, {"a": 1}, ["x"], None], ids=["number", "dict", "list", "null"])
def test_doctor_names_an_index_whose_weight_map_values_are_not_strings(model_dir, value):
    index = json.loads((model_dir / INDEX_NAME).read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = value
    (model_dir / INDEX_NAME).write_text(json.dumps(index))
    code, checks = doctor_checks(model_dir)
    assert code == 1
    assert checks["weight shards"]["status"] == "fail" and INDEX_NAME in checks["weight shards"]["detail"]
    assert "weight_map" in checks["weight shards"]["detail"]


@pytest.mark.parametrize("key, value", [("model_type", ["olmoe"]), ("model_type", {"a": 1}), ("architectures", "Olmoe")])
def test_doctor_names_a_config_whose_family_keys_have_the_wrong_type(model_dir, key, value):
    edit_config(model_dir, **{key: value})
    code, checks = doctor_checks(model_dir)
    assert code == 1
    assert checks["config.json"]["status"] == "fail" and repr(key) in checks["config.json"]["detail"]
    one_error_line(run_colibri("run", "--model", model_dir, "--token-ids", "1"), "config.json", key)


# -- 2. JSON nested beyond the parser's recursion ----------------------------------------
def deep_json() -> str:
    return "[" * DEEP + "]" * DEEP


def test_deep_json_in_config_index_and_shard_header_is_a_clean_error(model_dir, tmp_path):
    cases = {}
    config = tmp_path / "config"
    shutil.copytree(model_dir, config)
    (config / "config.json").write_text('{"model_type": ' + deep_json() + "}")
    cases[config] = "config.json"
    index = tmp_path / "index"
    shutil.copytree(model_dir, index)
    (index / INDEX_NAME).write_text('{"weight_map": ' + deep_json() + "}")
    cases[index] = INDEX_NAME
    header = tmp_path / "header"
    shutil.copytree(model_dir, header)
    shard = sorted(header.glob("*.safetensors"))[0]
    blob = ('{"x": ' + deep_json() + "}").encode()
    shard.write_bytes(struct.pack("<Q", len(blob)) + blob)
    cases[header] = shard.name
    for d, name in cases.items():
        one_error_line(run_colibri("run", "--model", d, "--token-ids", "1"), name, "nested too deeply")
        code, checks = doctor_checks(d)
        assert code == 1 and any(name in c["detail"] for c in checks.values() if c["status"] == "fail"), checks


def test_deep_json_routing_history_is_ignored_with_a_warning(model_dir):
    (model_dir / FILENAME).write_text('{"format": 1, "counts": ' + deep_json() + "}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ColibriWarning)
        with colibri_core.load(model_dir, history="read") as model:
            assert len(model.generate(token_ids=[1, 2], max_tokens=2, ignore_eos=True).token_ids) == 2
    assert any(FILENAME in str(w.message) and "ignored" in str(w.message) for w in caught)
    out = run_colibri("run", "--model", model_dir, "--token-ids", "1", "--max-tokens", "1", "-q")
    assert out.returncode == 0 and "routing history is unreadable and is ignored" in out.stderr


# -- 3. a prompt that is not UTF-8 ------------------------------------------------------
def test_prompt_with_invalid_utf8_bytes_is_a_clean_error(model_dir):
    bad = os.fsdecode(b"caf\xe9 \xff")  # what Python makes of non-UTF-8 argv bytes
    one_error_line(run_colibri("run", "--model", model_dir, bad, "--max-tokens", "1"), "PROMPT", "UTF-8", "0xe9")
    one_error_line(run_colibri("run", "--model", model_dir, "hi", "--chat", "--system", bad), "--system", "UTF-8")
    with colibri_core.load(model_dir, history=False) as model:
        with pytest.raises(UsageError, match="not valid UTF-8"):
            model.generate("\udcff", max_tokens=1)
        with pytest.raises(UsageError, match="not valid UTF-8"):
            model.generate(messages=[{"role": "user", "content": "\ud800"}], max_tokens=1)


# -- 4, 13, 18. options checked before anything is loaded --------------------------------
@pytest.mark.parametrize("args, fragments", [
    (["--seed", "-1"], ["--seed", "0 to 2**64 - 1"]),
    (["--seed", str(2**64)], ["--seed"]),
    (["--temperature", "-1"], ["--temperature", ">= 0"]),
    (["--temperature", "nan"], ["--temperature"]),
    (["--temperature", "inf"], ["--temperature", "finite"]),
    (["--top-p", "2"], ["--top-p", "(0, 1]"]),
    (["--top-p", "0"], ["--top-p"]),
    (["--top-k", "-1"], ["--top-k", ">= 0"]),
    (["--max-tokens", "-1"], ["--max-tokens", ">= 0"]),
    (["--prefetch", "--prefetch-slots", "-3"], ["--prefetch-slots", ">= 1"]),
    (["--prefetch-slots", "0"], ["--prefetch-slots"]),
    (["--prefetch", "--prefetch-window", "lots"], ["--prefetch-window", "'lots'"]),
    (["--prefetch", "--prefetch-window", "0"], ["--prefetch-window", "above 0"]),
    (["--prefetch", "--prefetch-slots", "2", "--prefetch-window", "64M"], ["--prefetch-slots", "--prefetch-window"]),
    (["--pin-share", "1.5"], ["--pin-share", "[0, 1)"]),
    (["--cap", "-2"], ["--cap", ">= 0"]),
    (["--history-decay", "0"], ["--history-decay", "(0, 1]"]),
    (["--ram", "lots"], ["cannot read size"]),
    (["--backend", "quantum"], ["no backend named 'quantum'"]),
])
def test_bad_options_fail_before_the_model_is_read(tmp_path, args, fragments):
    # the model directory does not exist: only an option check that comes first can answer
    one_error_line(run_colibri("run", "--model", tmp_path / "nowhere", "--token-ids", "1", *args), *fragments)


@pytest.mark.parametrize("args, fragments", [
    (["--token-ids", "1_0"], ["--token-ids", "'1_0'"]),
    (["--token-ids", "1,-2"], ["--token-ids", "'-2'"]),
    (["--token-ids", "+1"], ["--token-ids"]),
    (["--token-ids", "1,,2"], ["--token-ids"]),
    (["hello", "--system", "be brief"], ["--system", "--chat"]),
])
def test_prompt_options_fail_before_the_model_is_read(tmp_path, args, fragments):
    one_error_line(run_colibri("run", "--model", tmp_path / "nowhere", *args), *fragments)


def test_token_ids_are_digits_only():
    assert parse_token_ids("1, 2,3,") == [1, 2, 3]
    for text in ("1_0", "٣", "0x10", "1 2", "", ","):
        with pytest.raises(UsageError):
            parse_token_ids(text)


def test_api_checks_sampling_options_when_the_generation_is_created(model_dir):
    with colibri_core.load(model_dir, history=False) as model:
        for bad in (dict(seed=-1), dict(seed=1.5), dict(temperature=-1), dict(top_p=2), dict(top_k=-1),
                    dict(max_tokens=-1), dict(max_tokens=2.5)):
            with pytest.raises(UsageError) as info:
                model.stream(token_ids=[1], **bad)  # eagerly: before the first token is asked for
            assert next(iter(bad)) in str(info.value) and "--" not in str(info.value)


@pytest.mark.parametrize("options", [dict(prefetch=True, prefetch_slots=-3), dict(prefetch=True, prefetch_window="-1G"),
                                     dict(prefetch=True, prefetch_window=2.5), dict(cap=-1), dict(pin_share=2.0),
                                     dict(history_decay=0), dict(pin="always")])
def test_api_checks_placement_options_before_reading_the_model(tmp_path, options):
    with pytest.raises(UsageError) as info:
        colibri_core.load(tmp_path / "nowhere", **options)
    assert next(iter(options.keys() - {"prefetch"})) in str(info.value)


# -- 18. messages -----------------------------------------------------------------------
def test_a_missing_model_path_says_it_does_not_exist(tmp_path):
    one_error_line(run_colibri("run", "--model", tmp_path / "nowhere", "--token-ids", "1"), "does not exist")
    (tmp_path / "file").write_text("x")
    one_error_line(run_colibri("run", "--model", tmp_path / "file", "--token-ids", "1"), "not a directory")
    out = run_colibri("doctor", "--model", tmp_path / "nowhere", "--json")
    assert out.returncode == 1 and "does not exist" in out.stdout


def test_plugin_selection_names_unknown_and_disabled_plugins(model_dir):
    out = run_colibri("run", "--model", model_dir, "--token-ids", "1", env={"COLIBRI_PLUGINS": "nosuch"})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "COLIBRI_PLUGINS names 'nosuch', which no installed plugin is" in out.stderr
    assert "colibri-olmoe" in out.stderr  # the known plugins are listed
    assert "pip install" not in out.stderr
    out = run_colibri("run", "--model", model_dir, "--token-ids", "1", env={"COLIBRI_DISABLE_PLUGINS": "colibri-olmoe"})
    line = one_error_line(out, "disabled by COLIBRI_DISABLE_PLUGINS", "colibri-olmoe")
    assert "pip install" not in line


def test_api_messages_name_keywords_and_the_cli_names_flags(model_dir):
    with pytest.raises(BudgetError) as info:
        colibri_core.load(model_dir, ram="1K", history=False)
    assert "(ram=)" in str(info.value) and "--ram" not in str(info.value)
    one_error_line(run_colibri("run", "--model", model_dir, "--token-ids", "1", "--ram", "1K"), "(--ram)")


def test_threads_a_command_starts_name_its_flags(model_dir):
    """`colibri serve` loads in a thread of its own (and reads experts in others): a thread
    starts with an empty context, yet its messages are the command's."""
    import threading

    from colibri_core.errors import cli_spelling

    caught = []

    def load():
        try:
            colibri_core.load(model_dir, ram="1K", history=False)
        except BudgetError as exc:
            caught.append(str(exc))

    with cli_spelling():
        thread = threading.Thread(target=load)
        thread.start()
        thread.join()
    assert len(caught) == 1 and "(--ram)" in caught[0] and "ram=" not in caught[0]
    load()  # the command is over: keywords again
    assert "(ram=)" in caught[1]


def test_an_unknown_backend_is_a_backend_error(model_dir):
    with pytest.raises(BackendError, match="no backend named 'nosuch'"):
        colibri_core.load(model_dir, backend="nosuch")
    assert issubclass(BackendError, UsageError)  # exit status 2, as before


# -- 17. statistics ---------------------------------------------------------------------
def test_no_generated_token_means_no_decode_reads_and_no_time_to_first_token(model_dir):
    with colibri_core.load(model_dir, history=False) as model:
        s = model.generate(token_ids=[1, 2, 3], max_tokens=0).stats
    assert s.generated_tokens == 0 and s.bytes_read > 0  # the prefill read experts
    assert s.decode_bytes_read == 0 and s.decode_bytes_per_token == 0 and s.ttft_s is None
    out = run_colibri("run", "--model", model_dir, "--token-ids", "1,2,3", "--max-tokens", "0", "--json")
    stats = json.loads(out.stdout)["stats"]
    assert stats["ttft_s"] is None and stats["decode_bytes_read"] == 0 and stats["bytes_read"] > 0


def test_disk_bytes_per_token_count_only_decode_reads(model_dir):
    with colibri_core.load(model_dir, history=False, cap=1) as model:
        s = model.generate(token_ids=list(range(1, 30)), max_tokens=6, ignore_eos=True).stats
    assert 0 < s.decode_bytes_read < s.bytes_read
    assert s.decode_bytes_per_token == pytest.approx(s.decode_bytes_read / 5)  # 5 forward passes after the first token
    out = run_colibri("run", "--model", model_dir, "--token-ids", ",".join(map(str, range(1, 30))), "--max-tokens", "6",
                      "--ignore-eos", "--cap", "1")
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stderr.splitlines() if "read from disk" in line)
    assert "prefill" in line and "decode" in line


# -- 7. non-finite activations ----------------------------------------------------------
def poke_bf16(model_dir: Path, tensor: str, bits: int, count: int = 1) -> None:
    """Overwrite the first ``count`` elements of a BF16 tensor with the value ``bits``."""
    shard = model_dir / json.loads((model_dir / INDEX_NAME).read_text())["weight_map"][tensor]
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    start = 8 + n + json.loads(raw[8 : 8 + n])[tensor]["data_offsets"][0]
    raw[start : start + 2 * count] = np.full(count, bits, dtype="<u2").tobytes()
    shard.write_bytes(bytes(raw))


BF16_NAN, BF16_INF, BF16_HUGE = 0x7FC0, 0x7F80, 0x7F7F  # NaN, +infinity, 3.39e38 (finite)
O_PROJ = "model.layers.{}.self_attn.o_proj.weight"


@pytest.mark.parametrize("bits, layer, count, what", [(BF16_NAN, 1, 1, "NaN"), (BF16_INF, 0, 1, "infinity"),
                                                      (BF16_HUGE, 1, 64, "beyond +-65504")],
                         ids=["nan", "inf", "overflows"])
def test_non_finite_logits_stop_generation_naming_the_layer(model_dir, bits, layer, count, what):
    poke_bf16(model_dir, O_PROJ.format(layer), bits, count)
    with colibri_core.load(model_dir, history=False) as model:
        events = []
        with pytest.raises(colibri_core.errors.NonFiniteError) as info:
            for event in model.stream(token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True):
                events.append(event)
    assert events == []  # no token from non-finite logits
    assert f"first in layer {layer} " in str(info.value) and "colibri doctor" in str(info.value)
    out = run_colibri("run", "--model", model_dir, "--token-ids", "1,2,3", "--max-tokens", "4", "--ignore-eos")
    one_error_line(out, f"layer {layer} ", "--deep")
    assert out.stdout.strip() == ""
    code, checks = doctor_checks(model_dir)
    assert code == 0  # only --deep reads the data
    out = run_colibri("doctor", "--model", model_dir, "--deep", "--json")
    check = {c["name"]: c for c in json.loads(out.stdout)["checks"]}["tensor data (--deep)"]
    assert out.returncode == 1 and check["status"] == "fail"
    assert what in check["detail"] and O_PROJ.format(layer) in check["detail"]


BF16_1E36 = int(np.array([1e36], dtype=np.float32).view(np.uint32)[0]) >> 16


def test_degenerate_logits_stop_generation_naming_the_layer(model_dir):
    # 1e36 in a third of a norm's weight: the hidden state stays finite but its squares
    # overflow float32, so the final norm turns it into zeros and every logit is 0.0
    weight = "model.layers.0.input_layernorm.weight"
    poke_bf16(model_dir, weight, BF16_1E36, SPEC.hidden_size // 3)
    with colibri_core.load(model_dir, history=False) as model:
        events = []
        with pytest.raises(colibri_core.errors.NonFiniteError) as info:
            for event in model.stream(token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True):
                events.append(event)
    assert events == []
    assert "the same for every token" in str(info.value) and "first in layer 0 " in str(info.value)
    out = run_colibri("run", "--model", model_dir, "--token-ids", "1,2,3", "--max-tokens", "4")
    one_error_line(out, "the same for every token", "layer 0 ", "--deep")
    assert out.stdout.strip() == ""
    out = run_colibri("doctor", "--model", model_dir, "--deep", "--json")
    check = {c["name"]: c for c in json.loads(out.stdout)["checks"]}["tensor data (--deep)"]
    assert out.returncode == 1 and check["status"] == "fail" and weight in check["detail"]


def test_the_batched_engine_ends_a_request_with_degenerate_logits_naming_the_layer(model_dir):
    """The server's engine checks its logits as ``generate`` does: the request ends with
    an error naming the layer, never with tokens sampled from all-equal logits."""
    from colibri_core.engine.scheduler import Request, Scheduler

    poke_bf16(model_dir, "model.layers.0.input_layernorm.weight", BF16_1E36, SPEC.hidden_size // 3)
    with colibri_core.load(model_dir, history=False) as model:
        sched = Scheduler(model, slots=2, max_queue=4)
        sched.start()
        try:
            handle = sched.submit(Request(prompt_ids=[1, 2, 3], max_tokens=4))
            assert handle.wait(timeout=60)
        finally:
            sched.stop()
    assert handle.finish_reason == "error" and handle.token_ids == []
    assert isinstance(handle.error, colibri_core.errors.NonFiniteError)
    assert "the same for every token" in str(handle.error) and "layer 0 " in str(handle.error)


def test_the_finiteness_check_leaves_healthy_generation_alone(model_dir):
    with colibri_core.load(model_dir, history=False) as model:
        a = model.generate(token_ids=[1, 2, 3], max_tokens=6, ignore_eos=True)
        assert a.finish_reason == "length" and len(a.token_ids) == 6
        assert model.lm.first_faulty_stage([1, 2, 3] + a.token_ids, model.backend) is None


# -- bench: a failed run fails the command; a piped table is whole ----------------------
def run_colibri_piped(*args, timeout=120):
    """``run_colibri`` with stdout a pipe and no COLUMNS: what ``colibri ... | less`` sees."""
    env = colibri_env()
    env.pop("COLUMNS", None)
    return subprocess.run([sys.executable, "-m", "colibri_core", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


BENCH_QUICK = ("--tokens", "2", "--prompt-tokens", "3", "--repeats", "1")


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_bench_fails_with_the_failed_runs_error(model_dir, as_json):
    poke_bf16(model_dir, O_PROJ.format(1), BF16_NAN)
    out = run_colibri_piped("bench", "--model", model_dir, *BENCH_QUICK, *(["--json"] if as_json else []))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: bench: run 1 of colibri failed: the model computed NaN"), out.stderr
    if as_json:  # the results still come out, whole
        assert "NaN" in json.loads(out.stdout)["runs"]["colibri"][0]["error"]
    else:
        assert "NaN or infinite logits" in out.stdout


def test_a_piped_bench_table_cuts_no_cell(model_dir):
    out = run_colibri_piped("bench", "--model", model_dir, *BENCH_QUICK)
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout
    header = next(line for line in out.stdout.splitlines() if "engine" in line)
    assert "decode tok/s (median)" in header and "prefetch P / R (decode)" in header  # on one line each
    assert any(line.startswith("│ colibri ") for line in out.stdout.splitlines())


# -- run: the prompt from stdin or a file --------------------------------------------------
QUICK = ("--max-tokens", "4", "--ignore-eos", "-q")


def test_run_reads_the_prompt_from_stdin_or_a_file(model_dir, tmp_path):
    typed = run_colibri("run", "--model", model_dir, "Once upon a time", *QUICK)
    assert typed.returncode == 0 and typed.stdout.strip(), typed.stderr
    (tmp_path / "prompt.txt").write_text("Once upon a time\n")  # the newline an editor adds is not the prompt's
    for args, stdin in [((), "Once upon a time\n"), (("-",), "Once upon a time"),
                        (("--prompt-file", tmp_path / "prompt.txt"), None), (("--prompt-file", "-"), "Once upon a time\n")]:
        out = run_colibri("run", "--model", model_dir, *args, *QUICK, input=stdin)
        assert out.returncode == 0, (args, out.stderr)
        assert out.stdout == typed.stdout, args
    chat = run_colibri("run", "--model", model_dir, "--chat", "hi", *QUICK)
    assert run_colibri("run", "--model", model_dir, "--chat", *QUICK, input="hi").stdout == chat.stdout


def test_prompt_sources_fail_with_one_line_naming_the_source(model_dir, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for args, fragments in [
        (["--prompt-file", tmp_path / "missing.txt"], ["missing.txt", "No such file"]),
        (["--prompt-file", tmp_path], [str(tmp_path), "Is a directory"]),
        (["--prompt-file", tmp_path / "loop"], ["loop", "symbolic links"]),
        (["--prompt-file", "/dev/zero"], ["/dev/zero", "larger than"]),
        (["--prompt-file", tmp_path / "latin1.txt"], ["latin1.txt", "not valid UTF-8", "0xe9"]),
        (["--prompt-file", tmp_path / "empty.txt"], ["empty.txt", "empty"]),
        (["hi", "--prompt-file", tmp_path / "empty.txt"], ["exactly one"]),
        (["--prompt-file", tmp_path / "empty.txt", "--token-ids", "1"], ["exactly one"]),
        ([], ["stdin", "empty"]),  # stdin is /dev/null: not a terminal, and nothing in it
    ]:
        one_error_line(run_colibri("run", "--model", model_dir, *args, "--max-tokens", "1"), *fragments)


# -- 5. chat templates that would run away ----------------------------------------------
@pytest.mark.parametrize("source, fragment", [
    ("{% for i in range(10**8) %}x{% endfor %}", "Range too big"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    ("{{ 9 ** (9 ** 9) }}", "larger number"),
    ("{{ 'x' * 10**10 }}", "repeating a str"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "stack"),
], ids=["huge-range", "nested-loops", "power", "repeat", "recursion"])
def test_a_runaway_chat_template_is_stopped_and_named(model_dir, source, fragment):
    template = model_dir / "chat_template.jinja"
    template.write_text(source)
    with colibri_core.load(model_dir, history=False) as model:
        with pytest.raises(ModelFormatError) as info:
            model.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert str(template) in str(info.value) and fragment in str(info.value)


def test_a_runaway_chat_template_is_one_line_from_the_cli(model_dir):
    (model_dir / "chat_template.jinja").write_text("{% for i in range(10**8) %}x{% endfor %}")
    one_error_line(run_colibri("run", "--model", model_dir, "--chat", "hi", "--max-tokens", "1"), "chat_template.jinja",
                   "chat template stopped")


@pytest.mark.parametrize("command, args, fragments", [
    ("plan", ["--cap", "-1"], ["--cap"]),
    ("plan", ["--pin-share", "7"], ["--pin-share"]),
    ("plan", ["--prefetch", "--prefetch-window", "x"], ["--prefetch-window"]),
    ("bench", ["--prefetch", "--prefetch-window", "-5"], ["--prefetch-window"]),
    ("bench", ["--tokens", "0"], ["--tokens"]),
    ("bench", ["--repeats", "-1"], ["--repeats"]),
    ("bench", ["--temperature", "-1"], ["--temperature"]),
])
def test_other_commands_check_their_options_first(tmp_path, command, args, fragments):
    one_error_line(run_colibri(command, "--model", tmp_path / "nowhere", *args), *fragments)


def test_demo_checks_its_options_before_building(tmp_path):
    one_error_line(run_colibri("demo", "--size", "full", "--dir", tmp_path / "demo", "--max-tokens", "-5"), "--max-tokens")
    assert not (tmp_path / "demo").exists()
