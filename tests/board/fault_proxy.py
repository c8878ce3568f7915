"""A tiny HTTP proxy on loopback that injects store faults in front of a real server (moto, Azurite).

Every request is forwarded unchanged (headers included, so signatures still verify) unless a rule matches
it: the rule then answers in the server's stead (``status`` with ``body``: 503 SlowDown, 429, 500, ...) or
holds the request for ``delay_s`` before forwarding it (a timeout when that exceeds the client's request
timeout), for its first ``times`` matching requests. ``log`` records every request as (method, path, what
happened), so a test can count the tries a client made.
"""

from __future__ import annotations

import contextlib
import http.client
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
TOO_MANY = b'{"error": {"code": 429, "message": "rate limit exceeded"}}'
SERVER_BUSY = (
    b'<?xml version="1.0" encoding="utf-8"?><Error><Code>ServerBusy</Code>'
    b"<Message>The server is currently unable to receive requests. Please retry your request.</Message></Error>"
)


@dataclass
class Rule:
    match: Callable[[str, str], bool]  # (method, path) -> whether this rule applies
    times: int  # how many matching requests it affects (then it is spent)
    status: int | None = None  # answer with this status instead of forwarding
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0  # hold the request this long first (then answer ``status``, or forward)


class FaultProxy:
    """``FaultProxy("http://127.0.0.1:PORT")``: ``url`` is the proxy's address for the same server."""

    def __init__(self, upstream: str) -> None:
        self.upstream_url = upstream
        parsed = urlparse(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.base_path = parsed.path.rstrip("/")
        self.rules: list[Rule] = []
        self.log: list[tuple[str, str, str]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                rule = proxy._take(self.command, self.path)
                if rule is not None and rule.delay_s:
                    time.sleep(rule.delay_s)
                if rule is not None and rule.status is not None:
                    proxy._note(self.command, self.path, f"injected {rule.status}")
                    self.send_response(rule.status)
                    for k, v in rule.headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", str(len(rule.body)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(rule.body)
                    return
                status, headers, data = proxy._forward(self.command, self.path, dict(self.headers.items()), body)
                proxy._note(self.command, self.path, f"forwarded {status}" + (" late" if rule else ""))
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _guarded(self) -> None:
                # the client may have given up on this request (its timeout): nothing to answer then
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self._handle()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _guarded

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}{self.base_path}"

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self.log.clear()

    def injected(self) -> int:
        with self._lock:
            return sum(1 for _, _, what in self.log if what.startswith("injected"))

    def _take(self, method: str, path: str) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if rule.times > 0 and rule.match(method, path):
                    rule.times -= 1
                    return rule
        return None

    def _note(self, method: str, path: str, what: str) -> None:
        with self._lock:
            self.log.append((method, path, what))

    def _forward(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            conn.request(method, path, body=body or None, headers=headers)
            r = conn.getresponse()
            return r.status, r.getheaders(), r.read()
        finally:
            conn.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
