"""Run an ASGI app with uvicorn on a thread of its own (the torch engine's server beside the proxy, tests)."""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI

from flipsync.errors import ConfigError


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8000`` for IPv6); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen address {text!r} is not HOST:PORT")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


class ServerThread:
    """A uvicorn server bound to ``host:port`` (0: any free port), served from a daemon thread."""

    def __init__(
        self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning", grace_s: float = 3.0
    ) -> None:
        self.host = host
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=max(1, round(grace_s)),
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, name=f"uvicorn-{host}:{port}", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive():
                raise ConfigError(f"the server on {self.host} failed to start (is the port in use?)")
            if time.monotonic() > deadline:
                self.stop()
                raise ConfigError(f"the server on {self.host} did not start within {timeout:g} s")
            time.sleep(0.01)
        return self

    @property
    def port(self) -> int:
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
