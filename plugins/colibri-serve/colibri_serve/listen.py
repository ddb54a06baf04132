"""The HTTP server around the application: the port bound before anything says it is
listening, the names a request's Host header may give, uvicorn's h11 protocol with a
deadline for each request's headers, and a shutdown (Ctrl-C, SIGTERM) that ends open
streams rather than cancelling them."""

from __future__ import annotations

import errno
import ipaddress
import socket

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from colibri_core.errors import ResourceError, UsageError

HEADER_TIMEOUT_S = 10.0


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (as uvicorn binds it), or a one-line error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = exc.strerror or str(exc)
        # a port another process holds, or one this user may not bind: the machine refused
        kind = ResourceError if exc.errno in (errno.EADDRINUSE, errno.EACCES) else UsageError
        raise kind(f"could not listen on {address(host, port)}: {reason[:1].lower()}{reason[1:]}") from None
    return sock


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HostNames:
    """The names a request's ``Host`` header may give: the address bound, ``localhost``,
    this machine's host names, any IP address, and those allowed with ``--allowed-host``
    (``*``: any). Against DNS rebinding: a web page whose own name was made to resolve to
    this machine could otherwise drive the server from the browser of anyone on it (a
    browser sends the page's name as the Host; a literal address cannot be rebound)."""

    def __init__(self, bound: str, allowed: tuple[str, ...] = ()):
        self.any = "*" in allowed
        names = {bound, "localhost", socket.gethostname(), *allowed}  # (not getfqdn: a DNS lookup, which may hang)
        self.names = {_bare(n) for n in names if n}

    def allows(self, header: bytes | None) -> bool:
        if header is None or self.any:  # HTTP/1.0 may omit it; browsers always send one
            return True
        name = _bare(_strip_port(header.decode("latin-1").strip()))
        if name in self.names:
            return True
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False


def _strip_port(host: str) -> str:
    if host.startswith("["):  # [v6] or [v6]:port
        return host[1 : host.find("]")] if "]" in host else host
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _bare(name: str) -> str:
    return name.strip("[]").rstrip(".").lower()


def protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose next request's headers have
    not all arrived ``header_timeout`` seconds after it started waiting for them."""

    class HeaderDeadline(H11Protocol):
        # uvicorn times only a connection idle between requests, and any byte that arrives
        # stops that timer: a client that sends half a request line held its connection
        # (and a file descriptor) forever. The deadline is not moved by data that trickles in.
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _watch(self) -> None:
            waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
            if waiting and self._deadline is None:
                self._deadline = self.loop.call_later(header_timeout, self._too_slow)
            elif not waiting:
                self._disarm()

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


class Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service) -> None:
        super().__init__(config)
        self.service = service

    async def shutdown(self, sockets=None) -> None:
        # end the generations first: their streams finish with an error event, so every
        # response completes within the graceful wait (otherwise uvicorn cancels each
        # open stream's task and prints "Exception in ASGI application" for it)
        self.service.end_generations()
        await super().shutdown(sockets=sockets)
