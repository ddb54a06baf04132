"""Headless Chromium driven through the DevTools protocol over a pipe
(``--remote-debugging-pipe``: commands on fd 3, replies on fd 4, each JSON message ended
by a NUL byte), so a test can type into a page and read it back without a WebSocket
client."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import time
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")


class Browser:
    def __init__(self, profile: Path):
        to_browser, from_browser = os.pipe(), os.pipe()
        # high descriptors: the child moves them to 3 and 4 without clobbering either
        self._child_in = fcntl.fcntl(to_browser[0], fcntl.F_DUPFD, 10)
        self._child_out = fcntl.fcntl(from_browser[1], fcntl.F_DUPFD, 10)
        for fd in (to_browser[0], from_browser[1]):
            os.close(fd)
        self._write, self._read = to_browser[1], from_browser[0]
        child_in, child_out = self._child_in, self._child_out

        def wire():
            os.dup2(child_in, 3)
            os.dup2(child_out, 4)

        self.proc = subprocess.Popen(
            [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
             "--disable-dev-shm-usage", "--remote-debugging-pipe", f"--user-data-dir={profile}", "--window-size=1280,900",
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=wire, pass_fds=(3, 4))
        os.close(self._child_in)
        os.close(self._child_out)
        self._buffer = b""
        self._next = 0
        self.session = None

    def _send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30) -> dict:
        self._next += 1
        message = {"id": self._next, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while b"\0" not in self._buffer:
                chunk = os.read(self._read, 1 << 16)
                if not chunk:
                    raise AssertionError("Chromium closed the pipe: " + self.proc.stderr.read().decode()[-2000:])
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return reply.get("result", {})
        raise AssertionError(f"{method}: no reply in {timeout} s")

    def open(self, url: str) -> None:
        target = self._send("Target.createTarget", {"url": url})["targetId"]
        self.session = self._send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def eval(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self._send("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True},
                            self.session)
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60):
        """Poll ``expression`` until it is truthy; returns its value."""
        deadline, failure = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            try:
                value = self.eval(expression)
            except AssertionError as exc:  # the page may still be loading
                value, failure = None, exc
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"still false after {timeout} s: {expression}" + (f" ({failure})" if failure else ""))

    def close(self) -> None:
        try:
            os.write(self._write, json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._write, self._read):
            os.close(fd)
