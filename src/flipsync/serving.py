"""Run an ASGI app with uvicorn: on a thread of its own (the torch engine's server beside the proxy, tests),
or on the main thread until a signal (the ``sidecar`` and ``relay`` commands); parse their ``--listen`` and
``key=value`` options; the OpenAI-style error body the proxy and the gateway answer with."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp

from flipsync.errors import ConfigError

log = logging.getLogger(__name__)

# How long flipsync's servers keep an idle connection: longer than the gateway keeps its pooled connections to
# sidecars (30 s), so that a server never closes a connection just as its client reuses it (uvicorn's default of
# 5 s did, and each such request failed or was retried).
KEEP_ALIVE_S = 75


# The header the openai client (and others built with Stainless) obeys over its own retry rules: an answer a retry
# cannot change carries "false", so the client does not repeat it (it retries 408, 409, 429 and 5xx by default).
NO_RETRY = {"x-should-retry": "false"}


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}, **extra}, status_code=status, headers=headers
    )


def sse_event(doc: Any) -> bytes:
    """One server-sent event carrying ``doc`` as JSON, as OpenAI-style streams frame them."""
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


_BELOW_EPHEMERAL = 16384  # how many ports below the ephemeral range free_port draws from


def free_port(host: str = "") -> int:
    """A TCP port free on this node now, for a server that binds it later (a ``vllm serve`` imports for 10-20 s
    first; a lost race is a restart). Drawn below the kernel's ephemeral range, the ports this node gives its own
    outgoing connections: one of a test's 5,000 streams took the port a vLLM server was about to bind. Any free
    port where that range is unknown or leaves no room below it."""
    floor = _ephemeral_ports_start() - _BELOW_EPHEMERAL
    if floor >= 1024:
        draw = random.SystemRandom()
        for _ in range(64):
            port = draw.randrange(floor, floor + _BELOW_EPHEMERAL)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:  # in use
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_ports_start() -> int:
    """The first port of the kernel's ephemeral range (Linux); 0 where unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def parse_listen(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8000`` for IPv6); port 0 picks a free one."""
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen address {text!r} is not HOST:PORT")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def parse_pairs(items: list[str] | None, what: str) -> dict[str, str]:
    """``key=value`` command-line settings (``--store-option``, ``--engine-option``) as a dict."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{what} {item!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """SIGINT / SIGTERM end the command with a clean SystemExit(0), so the caller's cleanup runs."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _PromptServer(uvicorn.Server):
    """uvicorn's server, stopped as soon as it is asked. Its main loop reads ``should_exit`` every 0.1 s, and its
    shutdown sleeps 0.1 s before it waits for the connections it closed, then polls them every 0.1 s: a server
    thread's stop took 0.15-0.3 s, most of the time of a test that starts a sidecar and an engine. Here ``wake``
    ends the wait at once, and the connections are polled every 5 ms (within the same graceful timeout)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._woken: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._loop, self._woken = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), 0.1)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:  # a signal: on this loop's thread
        super().handle_exit(sig, frame)
        self.wake()

    def wake(self) -> None:
        """From any thread (or a signal handler): look at ``should_exit`` now."""
        if self._loop is not None and self._woken is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                self._loop.call_soon_threadsafe(self._woken.set)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:  # no new connections
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):  # idle ones close now, busy ones after their answer
            connection.shutdown()
        state = self.server_state
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                while (state.connections or state.tasks) and not self.force_exit:
                    await asyncio.sleep(0.005)
                for server in self.servers:
                    await server.wait_closed()
        except TimeoutError:
            log.error("cancelling %d request(s) still running after the graceful shutdown's timeout", len(state.tasks))
            for task in state.tasks:
                task.cancel(msg="graceful shutdown timed out")
        if not self.force_exit:
            await self.lifespan.shutdown()


def serve_until_signal(app: ASGIApp, host: str, port: int, *, before_exit: Callable[[], None] | None = None) -> None:
    """Serve ``app`` on this (main) thread until SIGINT / SIGTERM (uvicorn's re-raised signal becomes our clean
    SystemExit(0)). With ``before_exit`` (a sidecar's drain), the first signal runs it on a thread while the
    server keeps serving the requests in flight, and the server stops once it returns; a second stops it at once.
    """
    if not gc.isenabled():  # a server command's start (cli.terminal.server_command): what it built stays, frozen
        gc.freeze()
        gc.enable()
    with exit_on_signals():
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, timeout_keep_alive=KEEP_ALIVE_S
        )
        (_PromptServer(config) if before_exit is None else _LeavingServer(config, before_exit)).run()


class _LeavingServer(_PromptServer):
    """A uvicorn server whose first SIGINT / SIGTERM runs ``before_exit`` before it shuts down."""

    def __init__(self, config: uvicorn.Config, before_exit: Callable[[], None]) -> None:
        super().__init__(config)
        self._before_exit = before_exit
        self._leaving: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._leaving is not None:  # a second signal: stop now
            super().handle_exit(sig, frame)
            return
        self._leaving = threading.Thread(target=self._leave, name="flipsync-leave", daemon=True)
        self._leaving.start()

    def _leave(self) -> None:
        try:
            self._before_exit()
        except Exception:  # the server must still stop
            log.exception("leaving failed")
        finally:
            self.should_exit = True
            self.wake()


class ServerThread:
    """A uvicorn server bound to ``host:port`` (0: any free port), served from a daemon thread."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=3,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        self.server = _PromptServer(config)
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
        self.server.wake()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
