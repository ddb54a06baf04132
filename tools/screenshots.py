"""The serving docs' screenshots: colibri serve on colibri-trained's OLMoE-geometry model,
the chat page after one turn (temperature 0.7), the dashboard, the expert atlas (made
first with ``colibri atlas`` on the model's held-out text, then a turn lit up and a
specialist clicked) and the profiling page (after 30 turns of several sizes, two pairs of
them side by side), taken in headless Chromium through the DevTools protocol
(plugins/colibri-serve/tests/cdp.py).

    .venv/bin/python tools/screenshots.py docs/images [PAGE ...]   # chat dashboard atlas profile: all by default
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "colibri-serve" / "tests"))

from cdp import Browser  # noqa: E402


PAGES = ("chat", "dashboard", "atlas", "profile")


def main(out: Path, pages: tuple[str, ...] = PAGES, port: int = 8765) -> None:
    from colibri_trained import path

    out.mkdir(parents=True, exist_ok=True)
    if "atlas" in pages:  # the atlas goes beside the model's routing history, where the server looks for it
        subprocess.run([sys.executable, "-m", "colibri_core", "atlas", "--model", str(path("olmoe")), "--quiet"],
                       check=True)
    server = subprocess.Popen([sys.executable, "-m", "colibri_core", "serve", "--model", str(path("olmoe")), "--port",
                               str(port), "--history", "read"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        with tempfile.TemporaryDirectory() as user_data:
            browser = Browser(Path(user_data))
            try:
                if "chat" in pages or "dashboard" in pages:
                    chat_and_dashboard(browser, url, out, pages)
                if "atlas" in pages:
                    atlas(browser, url, out, path("olmoe").name)
                if "profile" in pages:
                    profile(browser, url, out, path("olmoe").name)
            finally:
                browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


def chat_and_dashboard(browser: Browser, url: str, out: Path, pages) -> None:
    browser.open(url + "/chat")
    browser.wait_for("document.getElementById('status').textContent === 'ready'")
    text = "def read_config(path):"
    browser.eval(f"document.getElementById('max-tokens').value = '48';"
                 "document.getElementById('temperature').value = '0.7';"
                 f"document.getElementById('message').value = {json.dumps(text)};"
                 "document.getElementById('send-form').requestSubmit(); true")
    browser.wait_for("document.querySelector('.turn.assistant')?.dataset.done === '1'")
    if "chat" in pages:
        shot(browser, out / "chat-page.png")
    if "dashboard" in pages:
        browser.open(url + "/")
        browser.wait_for("document.body.dataset.updated")
        time.sleep(1.5)
        shot(browser, out / "dashboard.png")


def atlas(browser: Browser, url: str, out: Path, model: str) -> None:
    browser.open(url + "/atlas")
    browser.wait_for("document.body.dataset.drawn")
    httpx.post(url + "/v1/completions", timeout=120, json={"prompt": "#include <stdio.h>\n", "max_tokens": 8,
                                                           "temperature": 0, "model": model})
    browser.wait_for("Number(document.body.dataset.lit) > 0")
    browser.eval("showPanel(atlas.experts.filter((e) => e.specialist)"
                 ".sort((a, b) => b.specialisation - a.specialisation)[0]); true")
    shot(browser, out / "atlas.png")


def profile(browser: Browser, url: str, out: Path, model: str) -> None:
    heldout = Path(__import__("colibri_trained").path("olmoe")) / "heldout"
    text = (heldout / "python.txt").read_text()

    def complete(chars: int, tokens: int) -> None:
        r = httpx.post(url + "/v1/completions", timeout=300,
                       json={"prompt": text[:chars], "max_tokens": tokens, "temperature": 0, "model": model})
        r.raise_for_status()

    complete(40, 8)  # the server's first turn pays its cold start (first reads): left out of the 30 drawn
    sizes = [(40, 64), (1500, 32), (200, 128), (3000, 16), (600, 48), (120, 96), (2000, 24), (80, 160)]
    for i in range(26):
        complete(*sizes[i % len(sizes)])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two at once: each bar is its share of the steps
        for pair in (((300, 96), (80, 96)), ((900, 64), (60, 64))):
            list(pool.map(lambda args: complete(*args), pair))
    browser.open(url + "/profile")
    browser.wait_for("(document.body.dataset.turns || '').split(',').length >= 30")
    browser.eval("document.getElementById('profile-chart').dispatchEvent(new MouseEvent('mousemove', {clientX: "
                 "document.getElementById('profile-chart').getBoundingClientRect().left + 46, clientY: 100})); true")
    shot(browser, out / "profile.png")


def shot(browser: Browser, path: Path) -> None:
    data = browser._send("Page.captureScreenshot", {"format": "png"}, browser.session)["data"]
    path.write_bytes(base64.b64decode(data))
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images"), tuple(sys.argv[2:]) or PAGES)
