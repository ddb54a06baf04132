"""The chat page at /chat in headless Chromium, typed into as a person types: its streamed
replies are the API's greedy replies for the same conversation (multi-turn, with a system
message and a stop string), each with a stats line; the key comes from the URL fragment
and stays out of the address bar; a wrong key shows the key form."""

import json

import httpx
import pytest

from cdp import CHROMIUM, Browser
from conftest import module_server

KEY = "page-key"
page_server = module_server("trained_model", "--api-key", KEY, "--slots", "2")

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(),
                                reason="headless Chromium (/usr/bin/chromium, Debian package chromium) is not installed")


@pytest.fixture(scope="module")
def trained_model():
    colibri_trained = pytest.importorskip("colibri_trained", reason="colibri-trained is not installed")
    return colibri_trained.path("olmoe")


@pytest.fixture
def browser(tmp_path):
    b = Browser(tmp_path / "profile")
    yield b
    b.close()


def api_reply(server, messages, **extra) -> str:
    r = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                   json={"model": "olmoe-16x64", "messages": messages, "temperature": 0, "max_tokens": 40, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def say(browser, text: str, turn: int) -> dict:
    browser.eval(f"document.getElementById('message').value = {json.dumps(text)};"
                 "document.getElementById('send-form').requestSubmit(); true")
    browser.wait_for(f"document.querySelectorAll('.turn.assistant')[{turn}]?.dataset.done === '1'")
    return browser.eval(f"(() => {{ const t = document.querySelectorAll('.turn.assistant')[{turn}];"
                        "return {text: t.querySelector('.text').textContent, error: t.classList.contains('error'),"
                        "stats: t.querySelector('.stats')?.textContent, tokens: t.querySelector('.stats')?.dataset.tokens}"
                        "})()")


def test_the_page_streams_the_apis_replies_turn_after_turn(page_server, browser):
    browser.open(f"{page_server.url}/chat#key={KEY}")
    browser.wait_for("document.getElementById('status').textContent === 'ready'")
    assert browser.eval("location.hash") == ""  # the key left the address bar
    assert browser.eval("document.getElementById('model').textContent") == "olmoe-16x64"
    browser.eval("document.getElementById('system').value = 'You write Python.';"
                 "document.getElementById('max-tokens').value = '40';"
                 "document.getElementById('stop').value = 'return|\\n\\n\\n'; true")
    history = [{"role": "system", "content": "You write Python."}]
    for turn, text in enumerate(["def read_config(path):", "Now the same for JSON files."]):
        shown = say(browser, text, turn)
        history.append({"role": "user", "content": text})
        expected = api_reply(page_server, history, stop=["return", "\n\n\n"])
        assert not shown["error"] and shown["text"] == expected, shown
        assert int(shown["tokens"]) > 0 and "tok/s" in shown["stats"] and "experts read from disk" in shown["stats"]
        history.append({"role": "assistant", "content": expected})


def test_a_wrong_key_shows_the_key_form(page_server, browser):
    browser.open(f"{page_server.url}/chat#key=wrong")
    browser.wait_for("!document.getElementById('key-form').hidden")
    assert "API key" in browser.eval("document.getElementById('status').textContent")
    browser.eval(f"document.getElementById('key').value = {json.dumps(KEY)};"
                 "document.getElementById('key-form').requestSubmit(); true")
    browser.wait_for("document.getElementById('status').textContent === 'ready'")


def test_colibri_web_serves_and_opens_the_chat_page(random_model, tmp_path):
    """``colibri web``: serve, then the browser ($BROWSER, as Python's webbrowser reads it)
    opened on /chat with the key in the fragment."""
    import subprocess
    import sys
    import time

    from colibri_core.testing.cli import colibri_env
    from conftest import free_port

    opened = tmp_path / "opened.txt"
    browser = tmp_path / "browser.sh"
    browser.write_text(f'#!/bin/sh\necho "$1" > {opened}\n')
    browser.chmod(0o755)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "colibri_core", "web", "--model", str(random_model), "--port", str(port),
                             "--api-key", "k/y"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=colibri_env(BROWSER=f"{browser} %s"))
    try:
        deadline = time.monotonic() + 60
        while not (opened.exists() and opened.read_text().strip()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        assert opened.read_text().strip() == f"http://127.0.0.1:{port}/chat#key=k%2Fy"
        page = httpx.get(f"http://127.0.0.1:{port}/chat", timeout=10)
        assert page.status_code == 200 and 'id="send-form"' in page.text
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert f"the chat page is http://127.0.0.1:{port}/chat#key=k%2Fy" in err
