"""Progress on long work: loading, a long prompt's prefill, convert --report. Bars go
to stderr on a terminal (or anywhere with --progress), never into --json output; they
count experts as experts and bytes in binary units, as the statistics do."""

import json
import re

import pytest

import colibri_core
from colibri_core.cli.demo import DemoSpec, build_demo_model

from colibri_core.testing.cli import run_colibri

SPEC = DemoSpec(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_experts=8, num_experts_per_tok=2,
                intermediate_size=16, tokenizer_vocab=300, shard_bytes=30_000)
LONG_PROMPT = ",".join(str(5 + i % 250) for i in range(300))  # more than one prefill chunk (256)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("progress") / "model"
    build_demo_model(path, SPEC)
    return path


def shown(stderr: str) -> str:
    """Progress off a terminal: plain lines, no escape codes, no carriage returns (a bar
    redrawn into a log is tens of kB of erase codes on one line)."""
    assert not ANSI.search(stderr) and "\r" not in stderr, stderr[:500]
    assert all(len(line) < 200 for line in stderr.splitlines()), stderr[:500]
    return stderr


def test_prefill_progress_counts_prompt_tokens_layer_by_layer_and_changes_nothing(model_dir):
    ids = [5 + i % 250 for i in range(300)]
    reports = []
    with colibri_core.load(model_dir, history=False, cap=2) as model:
        plain = model.generate(token_ids=ids, max_tokens=4, ignore_eos=True)
        watched = model.generate(token_ids=ids, max_tokens=4, ignore_eos=True,
                                 prefill_progress=lambda done, total: reports.append((done, total)))
    assert watched.token_ids == plain.token_ids
    assert all(total == 300 for _, total in reports) and reports[-1] == (300, 300)
    done = [d for d, _ in reports]
    assert done == sorted(done) and len(set(done)) >= 2 * SPEC.num_hidden_layers - 1  # finer than the 256-token chunks
    assert len(reports) == 2 * SPEC.num_hidden_layers  # two chunks x three layers


def test_run_shows_load_and_prefill_progress_when_asked_and_never_in_json(model_dir):
    out = run_colibri("run", "--model", model_dir, "--token-ids", LONG_PROMPT, "--max-tokens", "2", "--history", "off",
                      "--cap", "2", "--preload", "--progress", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["stats"]["prompt_tokens"] == 300  # stdout holds the JSON object only
    screen = shown(out.stderr)
    assert re.search(r"^prefill \d+/300 tokens", screen, re.M) and "\nprefill 300/300 tokens (100%)\n" in screen
    assert "\nloading experts 6/6 experts (100%)\n" in screen, screen  # experts counted as experts
    assert not re.search(r"\d+/\d+ bytes", screen)
    dense = re.search(r"^loading dense weights ([\d.]+/[\d.]+ (\S+))", screen, re.M)
    assert dense and dense.group(2) in ("KiB", "MiB", "GiB"), screen  # binary units, as the statistics use


def test_no_progress_off_a_terminal_unless_asked(model_dir):
    out = run_colibri("run", "--model", model_dir, "--token-ids", LONG_PROMPT, "--max-tokens", "2", "--history", "off")
    assert out.returncode == 0, out.stderr
    assert "prefill" not in out.stderr.split("statistics")[0] and "\x1b[" not in out.stderr


def test_convert_report_shows_its_progress(model_dir, tmp_path):
    out = run_colibri("convert", "--model", model_dir, "--out", tmp_path / "out", "--experts", "int8", "--report",
                      "--progress", "--json", timeout=300)
    assert out.returncode == 0, out.stderr
    assert "report" in json.loads(out.stdout)
    screen = shown(out.stderr)
    assert re.search(r"^converting [\d.]+/[\d.]+ (KiB|MiB)", screen, re.M), screen
    # the last line of the conversion is all of it: the total counts whole files
    last = [line for line in screen.splitlines() if line.startswith("converting ")][-1]
    assert "(100%" in last, screen
    assert "\ncomparing with the source 4/4 prompts (100%)\n" in screen, screen


def test_progress_off_a_terminal_is_a_line_at_most_every_interval():
    import io

    from rich.console import Console

    from colibri_core.cli import progress

    now = [0.0]
    out = io.StringIO()
    console = Console(file=out, highlight=False)
    assert not console.is_terminal and isinstance(progress.bar(console, enabled=True), progress.PlainProgress)
    plain = progress.PlainProgress(console, label="loading {task.description}", interval=5, get_time=lambda: now[0])
    with plain:
        task = plain.add_task("experts", total=100, unit="experts")
        for step in range(1, 101):  # one per second
            now[0] = float(step)
            plain.advance(task)
            if step == 60:
                other = plain.add_task("dense weights", total=1 << 20)
                plain.update(other, completed=1 << 19)
                plain.update(other, completed=3 << 18)  # within the interval: no line
                plain.remove_task(other)  # ends short of done: where it stopped is said
    lines = out.getvalue().splitlines()
    experts = [line for line in lines if line.startswith("loading experts")]
    assert [int(line.split()[2].split("/")[0]) for line in experts] == [*range(1, 100, 5), 100]
    assert experts[1] == "loading experts 6/100 experts (6%, 0:01:34 left)"
    assert experts[-1] == "loading experts 100/100 experts (100%)"  # done: said once, however it ended
    dense = [line for line in lines if line.startswith("loading dense weights")]
    assert [line.split(" (")[0] for line in dense] == ["loading dense weights 0.5/1.0 MiB",
                                                       "loading dense weights 0.8/1.0 MiB"]
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()


def test_progress_on_a_terminal_is_a_bar():
    import io

    from rich.console import Console
    from rich.progress import Progress

    from colibri_core.cli import progress

    console = Console(file=io.StringIO(), force_terminal=True)
    drawn = progress.bar(console, enabled=True)
    assert isinstance(drawn, Progress) and not isinstance(drawn, progress.PlainProgress)
