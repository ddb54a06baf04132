"""``colibri chat`` driven through its standard input: streaming replies on the chat
template, multi-turn with prefix reuse, /stats, /save, /reset."""

import json
import subprocess
import sys

from colibri_core.testing.cli import colibri_env
from serve_scripted_model import PLAIN_REPLY
from test_serve_parity import run_chat_tokens


def chat(model, script: str, *args):
    out = subprocess.run([sys.executable, "-m", "colibri_core", "chat", "--model", str(model), *map(str, args)],
                         input=script, capture_output=True, text=True, env=colibri_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_chat_replies_are_colibri_run_chat_replies_and_reset_starts_again(random_model, tmp_path):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    stdout = chat(random_model, f"Once upon a time\nThe small bird\n/save {first}\n/reset\nOnce upon a time\n/save {second}\n/exit\n",
                  "--max-tokens", 8)
    _, expected = run_chat_tokens(random_model, "Once upon a time", max_tokens=8)
    saved = json.loads(first.read_text())["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant", "user", "assistant"]
    assert saved[1]["content"] == expected and expected in stdout
    after_reset = json.loads(second.read_text())["messages"]
    assert after_reset == saved[:2]
    assert "(new conversation)" in stdout


def test_second_turn_reuses_the_first_turns_prefix(scripted_model, tmp_path):
    long = " ".join(["bird"] * 400)
    stdout = chat(scripted_model, f"{long}\n/stats\nagain\n/stats\n/exit\n", "--system", "be brief")
    assert stdout.count(PLAIN_REPLY) == 2
    stats = [block for block in stdout.split("turns") if "last prompt" in block]
    assert "0 reused from the previous turn" in stats[0]
    reused = int(stats[1].split(" reused from the previous turn")[0].split()[-1])
    assert reused >= 256  # whole prefill chunks of the first turn's prompt
    assert "expert hit rate" in stdout


def test_chat_commands_and_bad_input(random_model, tmp_path):
    stdout = chat(random_model, f"/help\n/save\n/save {tmp_path}/no/such/dir/x.json\n/nonsense\n", "--max-tokens", 4)
    assert "/reset" in stdout and "usage: /save FILE" in stdout and "cannot save" in stdout
    long = " ".join(["bird"] * 200)
    stdout = chat(random_model, f"{long}\n/exit\n", "--max-tokens", 4)
    assert "error:" in stdout and "/reset" in stdout
