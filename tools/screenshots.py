"""The serving docs' screenshots: colibri serve on colibri-trained's OLMoE-geometry model,
the chat page after one turn (temperature 0.7), the dashboard, and the expert atlas (made
first with ``colibri atlas`` on the model's held-out text, then a turn lit up and a
specialist clicked), taken in headless Chromium through the DevTools protocol
(plugins/colibri-serve/tests/cdp.py).

    .venv/bin/python tools/screenshots.py docs/images
"""

from __future__ import annotations

import base64
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


def main(out: Path, port: int = 8765) -> None:
    from colibri_trained import path

    out.mkdir(parents=True, exist_ok=True)
    # the atlas goes beside the model's routing history, where the server looks for it
    subprocess.run([sys.executable, "-m", "colibri_core", "atlas", "--model", str(path("olmoe")), "--quiet"], check=True)
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
        with tempfile.TemporaryDirectory() as profile:
            browser = Browser(Path(profile))
            try:
                browser.open(url + "/chat")
                browser.wait_for("document.getElementById('status').textContent === 'ready'")
                text = "def read_config(path):"
                browser.eval(f"document.getElementById('max-tokens').value = '48';"
                             "document.getElementById('temperature').value = '0.7';"
                             f"document.getElementById('message').value = {json.dumps(text)};"
                             "document.getElementById('send-form').requestSubmit(); true")
                browser.wait_for("document.querySelector('.turn.assistant')?.dataset.done === '1'")
                shot(browser, out / "chat-page.png")
                browser.open(url + "/")
                browser.wait_for("document.body.dataset.updated")
                time.sleep(1.5)
                shot(browser, out / "dashboard.png")
                browser.open(url + "/atlas")
                browser.wait_for("document.body.dataset.drawn")
                httpx.post(url + "/v1/completions", timeout=120, json={"prompt": "#include <stdio.h>\n", "max_tokens": 8,
                                                                       "temperature": 0, "model": path("olmoe").name})
                browser.wait_for("Number(document.body.dataset.lit) > 0")
                browser.eval("showPanel(atlas.experts.filter((e) => e.specialist)"
                             ".sort((a, b) => b.specialisation - a.specialisation)[0]); true")
                shot(browser, out / "atlas.png")
            finally:
                browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


def shot(browser: Browser, path: Path) -> None:
    data = browser._send("Page.captureScreenshot", {"format": "png"}, browser.session)["data"]
    path.write_bytes(base64.b64decode(data))
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/images"))
