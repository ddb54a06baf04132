"""``colibri chat --session NAME``: a conversation saved on leaving, continued warm by the
next chat with the replies an uninterrupted chat gives; damaged, foreign or busy sessions
refused in one line."""

import json
import subprocess
import sys

import pytest

from colibri_core.testing.cli import colibri_env

TURNS = ["Once upon", "A bird", "It flew"]  # the random model's context is 64 tokens
CODE_TURNS = ["def add(a, b):", "Write a loop over a list", "Now in C"]


@pytest.fixture(scope="module")
def trained_model():
    from colibri_core.cli.demo import trained_demo_path

    return trained_demo_path()  # its replies are text: the template renders them as they were generated


def chat(model, script: str, *args, ok=True):
    out = subprocess.run([sys.executable, "-m", "colibri_core", "chat", "--model", str(model), *map(str, args)],
                         input=script, capture_output=True, text=True, env=colibri_env(), timeout=300)
    if ok:
        assert out.returncode == 0, out.stderr
    return out


def replies(sessions, name):
    return [m["content"] for m in json.loads((sessions / f"{name}.json").read_text())["messages"] if m["role"] == "assistant"]


@pytest.mark.parametrize("sampling", [[], ["--temperature", "1", "--seed", "3"]], ids=["greedy", "sampled"])
def test_a_resumed_session_replies_as_the_uninterrupted_chat(trained_model, tmp_path, sampling):
    sessions = tmp_path / "sessions"
    args = ["--max-tokens", 12, "--sessions-dir", sessions, *sampling]
    chat(trained_model, "\n".join(CODE_TURNS) + "\n", "--session", "whole", *args)
    chat(trained_model, "\n".join(CODE_TURNS[:2]) + "\n/exit\n", "--session", "part", *args)
    saved = json.loads((sessions / "part.json").read_text())
    assert [m["role"] for m in saved["messages"]] == ["user", "assistant"] * 2 and saved["state_sha256"]
    resumed = chat(trained_model, CODE_TURNS[2] + "\n/stats\n", "--session", "part", *args)
    assert "(session 'part' resumed: 2 turns, " in resumed.stderr and "positions warm)" in resumed.stderr
    warm = int(resumed.stderr.split("resumed: 2 turns, ")[1].split(" positions")[0])
    reused = int(resumed.stdout.split(" reused from the previous turn")[0].split()[-1])
    # all of it, but where the template writes the reply's end otherwise (it trims whitespace)
    assert warm - 3 <= reused <= warm and warm > 40, "the resumed turn computed the saved conversation again"
    assert replies(sessions, "part") == replies(sessions, "whole"), "a resumed session: other replies than uninterrupted"
    assert len(replies(sessions, "whole")) == 3


def test_reset_and_save_in_a_session(random_model, tmp_path):
    sessions = tmp_path / "s"
    out = chat(random_model, f"{TURNS[0]}\n/save\n/reset\n{TURNS[1]}\n/exit\n", "--session", "r", "--sessions-dir", sessions,
               "--max-tokens", 4, "--system", "be brief")
    assert out.stdout.count("(session 'r' saved: ") == 2
    saved = json.loads((sessions / "r.json").read_text())
    assert saved["system"] == "be brief"
    assert [m["role"] for m in saved["messages"]] == ["system", "user", "assistant"]
    assert saved["messages"][1]["content"] == TURNS[1]


def test_damaged_foreign_and_busy_sessions_are_refused_in_one_line(random_model, scripted_model, tmp_path):
    from colibri_serve.sessions import SessionStore

    sessions = tmp_path / "s"
    args = ["--sessions-dir", sessions, "--max-tokens", 4]
    chat(random_model, TURNS[0] + "\n", "--session", "a", *args)

    def refused(model, *extra, script="hi\n"):
        out = chat(model, script, *extra, ok=False)
        assert out.returncode not in (0, 70), out.stderr
        return out.stderr.strip().splitlines()[-1]

    assert "was saved with another model" in refused(scripted_model, "--session", "a", *args)
    assert "has its own system message" in refused(random_model, "--session", "a", "--system", "other", *args)
    store = SessionStore(sessions, "a")
    store.lock()
    try:
        assert "is open in another colibri chat" in refused(random_model, "--session", "a", *args)
    finally:
        store.close()
    state = sessions / "a.state"
    good = state.read_bytes()
    chat(random_model, TURNS[1] + "\n", "--session", "other", *args)
    state.write_bytes((sessions / "other.state").read_bytes())  # another session's state under a's name
    line = refused(random_model, "--session", "a", *args)
    assert str(state) in line and "does not match a.json" in line
    data = bytearray(good)
    data[-3] ^= 0xFF
    state.write_bytes(bytes(data))
    line = refused(random_model, "--session", "a", *args)
    assert str(state) in line and "is damaged" in line
    state.unlink()
    assert "saved state is missing" in refused(random_model, "--session", "a", *args)
    (sessions / "b.json").write_text('{"format": "colibri-chat-session", "version": 9}')
    assert "b.json" in refused(random_model, "--session", "b", *args)
    assert "a session name is" in refused(random_model, "--session", "../x", *args)
    assert "add --session NAME" in refused(random_model, "--sessions-dir", sessions)
    assert "cannot be combined with --draft" in refused(random_model, "--session", "c", "--draft", "ngram", *args)


def test_a_turn_continues_the_kept_cache_or_the_common_part_of_it(random_model):
    """The next turn's ids start with what the cache holds: it continues it; they part
    earlier: the cache goes back to where they agree (KV caches can)."""
    import colibri_core
    from colibri_serve.chat import ChatSession

    with colibri_core.load(random_model, history=False) as model:
        session = ChatSession(model, max_tokens=6)
        try:
            session.ask(TURNS[0])
            kept = session.kept
            fed = kept.fed
            assert kept.cache.length == len(fed) and len(fed) > 8
            assert session._start(fed + [5, 6]) is kept.cache and kept.cache.length == len(fed)
            session.kept = kept
            assert session._start(fed[:5] + [fed[5] + 1, 7]) is kept.cache and kept.cache.length == 5
            assert session.kept is None  # a turn owns it until it ends
            session.reset()
            assert session._start([1, 2, 3]) is None
        finally:
            session.close()


def test_a_full_disk_when_saving_is_one_line_exit_3(random_model, tmp_path, monkeypatch):
    """Saving a session onto a full disk: a ResourceError naming the file (exit 3), never a traceback."""
    import errno

    import colibri_core
    from colibri_core.errors import ResourceError
    from colibri_core.io import smallfile
    from colibri_serve.chat import ChatSession
    from colibri_serve.sessions import SessionStore

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(smallfile, "write_atomic", full)
    with colibri_core.load(random_model, history=False) as model:
        session = ChatSession(model, max_tokens=2, store=SessionStore(tmp_path, "full"))
        try:
            session.ask(TURNS[0])
            with pytest.raises(ResourceError, match="full.json: cannot write session 'full': No space left") as exc:
                session.save_session()
            assert exc.value.exit_code == 3
        finally:
            session.close()
