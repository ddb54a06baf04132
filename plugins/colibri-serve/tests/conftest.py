"""Models and live servers for the colibri-serve tests: ``colibri serve`` runs as a real
process bound to 127.0.0.1 on a free port; the tests talk to it over HTTP."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colibri_core.cli.demo import build_demo_model
from colibri_core.testing.cli import colibri_env
from colibri_core.testing.demo_specs import SMALL_RANDOM
from serve_scripted_model import build_scripted_model

@pytest.fixture(scope="session")
def random_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve-random") / "random-olmoe"
    build_demo_model(path, SMALL_RANDOM)
    return path


@pytest.fixture(scope="session")
def scripted_model(tmp_path_factory):
    return build_scripted_model(tmp_path_factory.mktemp("serve-scripted") / "scripted")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, *args, env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "colibri_core", "serve", "--model", str(model), "--port",
                                      str(self.port), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=colibri_env(**(env or {})))

    def wait_ready(self, timeout=120.0):
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"colibri serve exited {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("colibri serve did not become ready")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.stderr.read() if self.proc.stderr else ""


@pytest.fixture
def start_server():
    started = []

    def start(model, *args, env=None, ready=True):
        server = Server(model, *args, env=env)
        started.append(server)
        return server.wait_ready() if ready else server

    yield start
    for server in started:
        server.stop()


def module_server(model: str, *args):
    """A fixture: ``colibri serve ARGS`` of the model fixture ``model``, started once for
    a test module's tests and stopped after them."""

    @pytest.fixture(scope="module")
    def server(request):
        started = Server(request.getfixturevalue(model), *args).wait_ready()
        yield started
        started.stop()

    return server


scripted_server = module_server("scripted_model", "--api-key", "sekret", "--slots", "2")
random_server = module_server("random_model", "--slots", "8")
schema_server = module_server("random_model", "--slots", "4", "--max-queue", "64")


@pytest.fixture(scope="module")
def served_schema_raw(schema_server):
    import httpx

    return httpx.get(schema_server.url + "/openapi.json").json()


@pytest.fixture(scope="module")
def served_schema(schema_server, served_schema_raw):
    """The schema as served, with ``model`` pinned to the served model's name so that
    generated requests reach the engine (any other name is a documented 404)."""
    import copy

    import schemathesis

    pinned = copy.deepcopy(served_schema_raw)
    for component in pinned["components"]["schemas"].values():
        if "model" in component.get("properties", {}):
            component["properties"]["model"] = {"const": "random-olmoe"}
    return schemathesis.openapi.from_dict(pinned)
