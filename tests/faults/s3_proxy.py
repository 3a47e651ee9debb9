"""A small HTTP proxy in front of the moto S3 server that misbehaves on purpose.

It forwards every request to moto, except that it can answer the first N requests with a 5xx
(``SlowDown`` throttling or ``InternalError``), and from a chosen request on it can go away:
``"refuse"`` closes its listening socket and every open connection (a server that died), or
``"freeze"`` accepts and reads requests but never answers (a server or network that hangs).
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import urlsplit

_ERRORS = {
    503: b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>",
    500: b"<Error><Code>InternalError</Code><Message>We encountered an internal error.</Message></Error>",
}
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


class FaultyProxy:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.fail_statuses: list[int] = []  # answered to the next requests, in order
        self.failed = 0
        self.forwarded = 0
        self.requests: list[str] = []
        self.gone: Literal["refuse", "freeze"] | None = None
        self.delay_s = 0.0  # added before answering every request (a slow link)
        self._go_away_when: Callable[[str, str], bool] | None = None
        self._go_away_how: Literal["refuse", "freeze"] = "refuse"
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._connections: set[socket.socket] = set()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def fail_next(self, *statuses: int) -> None:
        with self._lock:
            self.fail_statuses.extend(statuses)

    def go_away_at(self, when: Callable[[str, str], bool], how: Literal["refuse", "freeze"]) -> None:
        """From the first request for which ``when(method, path)`` holds, go away ``how``."""
        self._go_away_when, self._go_away_how = when, how

    def _decide(self, method: str, path: str) -> int | str | None:
        with self._lock:
            self.requests.append(f"{method} {path}")
            if self.gone is None and self._go_away_when is not None and self._go_away_when(method, path):
                self.gone = self._go_away_how
                if self.gone == "refuse":
                    threading.Thread(target=self._refuse, daemon=True).start()
            if self.gone is not None:
                return self.gone
            if self.fail_statuses:
                self.failed += 1
                return self.fail_statuses.pop(0)
            self.forwarded += 1
            return None

    def _refuse(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with proxy._lock:
                    proxy._connections.add(self.connection)

            def finish(self) -> None:
                with proxy._lock:
                    proxy._connections.discard(self.connection)
                try:
                    super().finish()
                except OSError:
                    pass

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(chunks)
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _any(self) -> None:
                body = self._body()
                if proxy.delay_s:
                    time.sleep(proxy.delay_s)
                decision = proxy._decide(self.command, self.path)
                if decision == "freeze":
                    proxy._release.wait()
                    self.close_connection = True
                    return
                if decision == "refuse":
                    self.close_connection = True
                    return
                if isinstance(decision, int):
                    payload = _ERRORS[decision]
                    self.send_response(decision)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload) if self.command != "HEAD" else 0))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                headers["Content-Length"] = str(len(body))
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                upstream.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        return Handler

    def close(self) -> None:
        self._release.set()
        if self.gone != "refuse":
            self._refuse()


@contextmanager
def faulty_proxy(upstream: str) -> Iterator[FaultyProxy]:
    proxy = FaultyProxy(upstream)
    proxy._thread.start()
    try:
        yield proxy
    finally:
        proxy.close()
