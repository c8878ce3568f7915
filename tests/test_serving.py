"""``flipsync.serving.ServerThread``: a stop lets the requests in flight finish, then runs the app's shutdown, however
soon after the request it comes (the server is woken at once rather than at its next tick)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from fastapi import FastAPI

from flipsync.serving import ServerThread, free_port


def make_app(events: list[str], entered: threading.Event) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        events.append("shutdown")

    app = FastAPI(lifespan=lifespan)

    @app.get("/slow")
    async def slow() -> dict[str, str]:
        entered.set()
        await asyncio.sleep(0.5)
        events.append("answered")
        return {"ok": "yes"}

    @app.get("/fast")
    async def fast() -> dict[str, str]:
        return {"ok": "yes"}

    return app


def test_a_stop_lets_the_request_in_flight_finish_then_shuts_the_app_down() -> None:
    events: list[str] = []
    entered = threading.Event()
    server = ServerThread(make_app(events, entered)).start()
    url = server.url
    answers: list[httpx.Response] = []
    client = threading.Thread(target=lambda: answers.append(httpx.get(f"{url}/slow", timeout=30)))
    client.start()
    assert entered.wait(30)
    server.stop()
    client.join(30)
    assert [r.status_code for r in answers] == [200] and answers[0].json() == {"ok": "yes"}
    assert events == ["answered", "shutdown"]  # the stop returned only once both had happened
    try:
        httpx.get(f"{url}/fast", timeout=5)
        raise AssertionError("a stopped server answered")
    except httpx.ConnectError:
        pass


def test_a_stop_closes_an_idle_kept_alive_connection_and_stops_each_time() -> None:
    for _ in range(3):  # started and stopped in a row, as the tests and the demo's islands do
        events: list[str] = []
        server = ServerThread(make_app(events, threading.Event())).start()
        with httpx.Client() as client:
            assert client.get(f"{server.url}/fast").status_code == 200  # its connection stays open, idle
            server.stop()
            assert events == ["shutdown"]
            assert not server._thread.is_alive()


def test_a_free_port_is_drawn_below_the_ports_of_outgoing_connections_and_binds() -> None:
    """A server that binds its port seconds later (``vllm serve``) must not lose it to an outgoing connection,
    which the kernel gives a port of its ephemeral range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except OSError:
        pytest.skip("no ephemeral port range to stay below (not Linux)")
    for _ in range(20):
        port = free_port("127.0.0.1")
        assert port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
