"""Network exposure: a --host other than loopback needs an API key (or, said out loud,
--insecure-no-key), and the Host header must name this server (the address bound,
localhost, this machine's name, an IP address, or an --allowed-host), so that a web page
whose name was rebound to 127.0.0.1 cannot drive a server on loopback from a browser."""

import socket

import httpx
import pytest

from colibri_core.testing.cli import run_colibri
from colibri_serve.listen import HostNames


def test_a_non_loopback_host_without_a_key_is_refused_before_anything_is_bound(scripted_model):
    r = run_colibri("serve", "--model", scripted_model, "--host", "0.0.0.0", "--port", "0", timeout=60)
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["error: --host 0.0.0.0 is not a loopback address: anyone who can reach it could use "
                                     "the model; set --api-key (or COLIBRI_API_KEY), or pass --insecure-no-key to serve "
                                     "it without one"]
    assert "listening" not in r.stdout + r.stderr


def test_insecure_no_key_serves_elsewhere_with_a_warning(start_server, scripted_model):
    server = start_server(scripted_model, "--host", "0.0.0.0", "--insecure-no-key", ready=False)
    try:
        server.url = f"http://127.0.0.1:{server.port}"
        server.wait_ready()
        # any address of this machine is fine in the Host header, its name too; a foreign name is not
        assert httpx.get(server.url + "/health", headers={"host": f"192.0.2.7:{server.port}"}).status_code == 200
        assert httpx.get(server.url + "/health", headers={"host": socket.gethostname()}).status_code == 200
        assert httpx.get(server.url + "/health", headers={"host": "rebound.example"}).status_code == 421
    finally:
        err = server.stop()
    assert "without an API key (--insecure-no-key)" in err


def test_a_key_serves_elsewhere_without_a_warning(start_server, scripted_model):
    server = start_server(scripted_model, "--host", "0.0.0.0", "--api-key", "sekret", ready=False)
    try:
        server.url = f"http://127.0.0.1:{server.port}"
        server.wait_ready()
    finally:
        err = server.stop()
    assert "without an API key" not in err


def test_a_host_header_naming_another_server_is_refused(start_server, scripted_model):
    server = start_server(scripted_model)
    port = server.port
    for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.attacker.example", "localhost.attacker.example"):
        r = httpx.get(server.url + "/v1/models", headers={"host": host})
        assert r.status_code == 421, host
        assert r.json()["error"]["code"] == "misdirected_request" and "--allowed-host" in r.json()["error"]["message"]
        assert httpx.get(server.url + "/", headers={"host": host}).status_code == 421  # the dashboard too
        assert httpx.get(server.url + "/dashboard.json", headers={"host": host}).status_code == 421
    r = httpx.post(server.url + "/v1/messages", headers={"host": "attacker.example"},
                   json={"model": "scripted", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 421 and r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", "localhost.", f"[::1]:{port}", "127.0.0.1"):
        assert httpx.get(server.url + "/v1/models", headers={"host": host}).status_code == 200, host


def test_allowed_hosts_add_names(start_server, scripted_model):
    server = start_server(scripted_model, "--allowed-host", "colibri.internal", "--allowed-host", "Proxy.Example")
    for host in ("colibri.internal", f"proxy.example:{server.port}"):
        assert httpx.get(server.url + "/v1/models", headers={"host": host}).status_code == 200, host
    assert httpx.get(server.url + "/v1/models", headers={"host": "other.example"}).status_code == 421


@pytest.mark.parametrize("header, allowed", [
    (None, True), (b"127.0.0.1:8000", True), (b"localhost", True), (b"[::1]:8000", True), (b"10.1.2.3", True),
    (b"[fe80::1]", True), (b"evil.example", False), (b"evil.example:8000", False), (b"", False), (b"[", False)])
def test_host_names_on_loopback(header, allowed):
    assert HostNames("127.0.0.1").allows(header) is allowed


def test_host_names_any():
    assert HostNames("127.0.0.1", ("*",)).allows(b"anything.example")
    assert HostNames("myhost.lan").allows(b"MYHOST.LAN:8000")
