"""Serving one registry over HTTP: prometheus_client's WSGI app and threading server (TLS where
configured), on a thread of our own so that closing it is prompt, with a policy for a taken port.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from ..errors import FadiagError

log = logging.getLogger("fadiag")

POLL_SECONDS = 0.05
"""How often the serving thread looks for a shutdown request. prometheus_client's own
start_http_server polls every 0.5 s, and shutdown() waits for the next look: every detach()
(the end of every training script) paid up to that. A select() that times out costs µs."""


class Server:
    """prometheus_client's HTTP server for one registry, with a port policy."""

    def __init__(self, registry: CollectorRegistry, addr: str, port: int, policy: str,
                 certfile: str | None = None, keyfile: str | None = None, tries: int = 16):
        self.port: int | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        kwargs: dict[str, Any] = {}
        if certfile:
            kwargs.update(certfile=certfile, keyfile=keyfile)
        candidates = [port] if port == 0 or policy != "next" else list(range(port, port + tries))
        last_error: OSError | None = None
        for p in candidates:
            try:
                self._server, self._thread = _serve(registry, addr, p, **kwargs)
            except OSError as e:
                last_error = e
                continue
            self.port = int(self._server.server_port)
            if p != port and port != 0:
                log.warning("fadiag: port %d was taken; serving metrics on %s:%d", port, addr,
                            self.port)
            return
        msg = f"fadiag: cannot serve metrics on {addr}:{port} ({last_error})"
        if policy == "fail":
            raise FadiagError(msg + "; set exporter.port or exporter.on_port_in_use")
        log.warning("%s; continuing without the exporter (exporter.on_port_in_use=%s)", msg, policy)

    def forget_in_child(self) -> None:
        """In a forked child: let go of the inherited socket. No serving thread was copied, so
        shutdown() would wait for ever; the parent's server is untouched."""
        if self._server is not None:
            self._server.socket.close()
            self._server = self._thread = None

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = None


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr: scrapes are not the training script's output."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _serve(registry: CollectorRegistry, addr: str, port: int, certfile: str | None = None,
           keyfile: str | None = None) -> tuple[Any, threading.Thread]:
    """prometheus_client's WSGI app on its threading server, as start_http_server builds them,
    served by a daemon thread that notices a shutdown within POLL_SECONDS."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]

    class Server(ThreadingWSGIServer):
        address_family = family  # an IPv6 address needs an IPv6 socket

    httpd = make_server(str(sockaddr[0]), port, make_wsgi_app(registry), Server,
                        handler_class=_QuietHandler)
    if certfile and keyfile:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(certfile, keyfile)
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": POLL_SECONDS},
                              name="fadiag-metrics", daemon=True)
    thread.start()
    return httpd, thread
