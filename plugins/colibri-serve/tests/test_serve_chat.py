"""``colibri chat`` driven through its standard input: streaming replies on the chat
template, multi-turn with prefix reuse, /stats, /save, /reset."""

import json
import os
import subprocess
import sys
import time

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


def test_chat_replies_fit_a_regex_or_a_schema_and_bad_ones_are_refused_before_loading(random_model, tmp_path):
    stdout = chat(random_model, "Once upon a time\n/save " + str(tmp_path / "r.json") + "\n/exit\n", "--regex", "[0-9]{3}",
                  "--temperature", "1", "--seed", "4")
    reply = json.loads((tmp_path / "r.json").read_text())["messages"][1]["content"]
    assert len(reply) == 3 and reply.isdigit() and reply in stdout
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    chat(random_model, "Hi\n/save " + str(tmp_path / "j.json") + "\n/exit\n", "--json-schema", schema)
    assert json.loads(json.loads((tmp_path / "j.json").read_text())["messages"][1]["content"]) in ({"ok": True}, {"ok": False})
    for args, message in ((("--regex", "[0-9"), "error: --regex: "), (("--grammar", str(schema)), "name a .lark or .gbnf file"),
                          (("--regex", "a", "--json-schema", str(schema)), "give at most one of --json-schema, --regex")):
        out = subprocess.run([sys.executable, "-m", "colibri_core", "chat", "--model", str(random_model), *args],
                             input="", capture_output=True, text=True, env=colibri_env(), timeout=120)
        assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


class Terminal:
    """``colibri chat`` on a pseudo-terminal, typed at as a person types."""

    def __init__(self, args, env):
        import fcntl
        import pty
        import struct
        import termios

        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        self.proc = subprocess.Popen([sys.executable, "-m", "colibri_core", "chat", *map(str, args)], stdin=slave,
                                     stdout=slave, stderr=slave, env=colibri_env(**env), close_fds=True)
        os.close(slave)
        self.seen = b""

    def expect(self, text: str, timeout=120.0) -> None:
        """Read the screen's bytes until ``text`` appears after what was matched before."""
        import select

        deadline = time.monotonic() + timeout
        while text.encode() not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {text!r} on the terminal; it shows: {self.seen[-2000:]!r}"
            if select.select([self.master], [], [], min(left, 0.5))[0]:
                try:
                    self.seen += os.read(self.master, 65536)
                except OSError:  # the child closed the terminal
                    assert text.encode() in self.seen, f"no {text!r}; the terminal showed: {self.seen[-2000:]!r}"
        self.seen = self.seen[self.seen.index(text.encode()) + len(text):]

    def type(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def send(self, keys: str, *then: str) -> None:
        """Type ``keys``, then read until each of ``then`` appears, in turn."""
        self.type(keys)
        for text in then:
            self.expect(text)

    def close(self, timeout=60.0) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.proc.kill()  # a no-op once it exited
            os.close(self.master)

    def __enter__(self):
        return self

    def __exit__(self, failed, *_):
        """Close the chat, kept as ``returncode``; killed first when a step failed (it
        would wait for input)."""
        if failed is not None:
            self.proc.kill()
        self.returncode = self.close()


def test_chat_on_a_terminal_edits_lines_recalls_history_and_takes_multi_line_messages(random_model, tmp_path):
    saved, multi_line = tmp_path / "chat.json", tmp_path / "multi-line.json"
    env = {"TERM": "xterm", "XDG_STATE_HOME": str(tmp_path / "state"), "PROMPT_TOOLKIT_NO_CPR": "1"}
    with Terminal(["--model", random_model, "--max-tokens", "3"], env) as term:
        term.expect("Alt+Enter")  # the editing keys are said at the start
        term.expect("you>")
        # Left, a letter, Right: edited where the cursor is
        term.send("Once upon a tim\x1b[De\x1b[C\r", "model> ", "you>")
        term.send("\x1b[A\r", "model> ", "you>")  # Up recalls the last message
        term.send(f"/save {saved}\r", "saved", "you>")
        term.send("/reset\r", "(new conversation)", "you>")  # a third turn would overflow the tiny model's context
        term.send("first line\x1b\rsecond line\r", "model> ", "you>")  # Esc, Enter: a new line within the message
        term.send(f"/save {multi_line}\r", "saved", "you>")
        term.type("/exit\r")
    assert term.returncode == 0
    user = [m["content"] for m in json.loads(saved.read_text())["messages"] if m["role"] == "user"]
    assert user == ["Once upon a tiem", "Once upon a tiem"]
    assert json.loads(multi_line.read_text())["messages"][0] == {"role": "user", "content": "first line\nsecond line"}
    history = (tmp_path / "state" / "colibri" / "chat-history").read_text()
    assert "+Once upon a tiem\n" in history and "+first line\n+second line\n" in history

    # the next chat recalls the last one's lines from the history file: /exit, /save, the two-line message
    with Terminal(["--model", random_model, "--max-tokens", "2"], env) as term:
        term.expect("you>")
        term.send("\x1b[A\x1b[A\x1b[A\r", "model> ", "you>")
        term.send(f"/save {saved}\r", "saved", "you>")
        # Ctrl-D, typed at the prompt (between prompts the terminal is not in raw mode), ends
        # the chat as end of input does
        term.type("\x04")
    assert term.returncode == 0
    assert [m["content"] for m in json.loads(saved.read_text())["messages"] if m["role"] == "user"] == [
        "first line\nsecond line"]
