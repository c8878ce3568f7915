"""A stub replica and a raw HTTP/1.1 client, both on plain asyncio, for the gateway's benchmarks and tests.

`StubReplica` answers what a gateway asks of a sidecar (``/flipsync/status``, ``/v1/models``, and any POST as a
completion, whole or streamed) at a cost of microseconds, so that thousands of requests or streams measure the
gateway and not the replica. Its behaviour can be changed while it runs (answer 503, drain, hold answers, hold
streams until N are open) and it records who asked what. `RawClient` is a keep-alive HTTP/1.1 connection with
just enough parsing (Content-Length and chunked bodies) for the same purpose; `gateway_process` starts a
``flipsync gateway`` over given replicas and `concurrent_streams` opens N streams through it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from flipsync.serving import free_port

_REASONS = {200: "OK", 401: "Unauthorized", 404: "Not Found", 409: "Conflict", 502: "Bad Gateway", 503: "Unavailable"}


@dataclass
class Hit:
    """One POST the stub answered: when (monotonic), the session header and the Authorization header it carried."""

    at: float
    path: str
    session: str | None
    authorization: str | None


class StreamCount:
    """Streams started across several stubs (each on its own thread), for a barrier over all of them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = 0
        self.waiters: list[StubReplica] = []  # woken (on their own loops) at each start

    def add(self) -> None:
        with self._lock:
            self.started += 1
            waiters = list(self.waiters)
        for stub in waiters:
            stub.wake()


@dataclass
class StubReplica:
    """A sidecar-shaped server on a thread of its own (its own event loop). Change the public fields at any time:
    ``status`` (what POSTs answer), ``draining`` (503 with ``X-Flipsync-Draining``), ``hold`` (POSTs wait until
    it is set), ``barrier`` (a stream waits after its first event until that many streams have started),
    ``events`` (SSE events per stream), ``delay_s`` (before each answer), ``load`` (reported in its status);
    ``shared``: a barrier counts the streams of every stub holding the same `StreamCount`."""

    model: str = "stub"
    run: str = "run"
    version: int = 0
    status: int = 200
    draining: bool = False
    events: int = 3
    barrier: int = 0
    barrier_timeout_s: float = 120.0
    hold: threading.Event | None = None
    load: dict[str, Any] | None = None
    delay_s: float = 0.0
    shared: StreamCount | None = None
    host: str = "127.0.0.1"
    hits: list[Hit] = field(default_factory=list)
    streams_started: int = 0
    streams_open: int = 0
    peak_streams: int = 0
    barrier_timeouts: int = 0  # streams that gave up waiting for the barrier
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _server: asyncio.Server | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _event: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> StubReplica:
        if self.shared is not None:
            with self.shared._lock:
                self.shared.waiters.append(self)
        self._thread = threading.Thread(target=self._run, name=f"stub-replica-{id(self)}", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the stub replica did not start within 30 s")
        return self

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def serve() -> None:
            self._server = await asyncio.start_server(self._connection, self.host, self.port, backlog=8192)
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()

        loop.run_until_complete(serve())
        loop.run_forever()
        pending = asyncio.all_tasks(loop)  # connections still open: end them before the loop closes
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return

        def close() -> None:
            if self._server is not None:
                self._server.close()
            loop.stop()

        loop.call_soon_threadsafe(close)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None

    def __enter__(self) -> StubReplica:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- serving --------------------------------------------------------------------------------------------

    def status_doc(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "version": self.version,
            "view_fp": "ab" * 16,
            "head": self.version,
            "served_format": "bf16",
            "state": "idle",
            "serving": True,
            "engine": {"name": "stub"},
            "requests_in_flight": self.streams_open,
            "proxy": {"draining": self.draining},
            "load": self.load,
            "stub": {
                "streams_started": self.streams_started,
                "all_started": self._started(),
                "barrier_timeouts": self.barrier_timeouts,
            },
        }

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, _, v = line.partition(":")
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                await self._answer(method, path, headers, body, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:
            # the stub is stopping: end quietly (a cancelled connection task makes asyncio log an error)
            return
        finally:
            writer.close()

    async def _answer(
        self, method: str, path: str, headers: dict[str, str], body: bytes, writer: asyncio.StreamWriter
    ) -> None:
        if method == "GET":
            if path.startswith("/flipsync/status"):
                return await _send_json(writer, 200, self.status_doc())
            if path.startswith("/v1/models"):
                return await _send_json(writer, 200, {"object": "list", "data": [{"id": self.model}]})
            return await _send_json(writer, 200 if path.startswith("/flipsync/health") else 404, {})
        self.hits.append(Hit(time.monotonic(), path, headers.get("x-flipsync-session"), headers.get("authorization")))
        if self.draining:
            err = {"error": {"message": "draining", "type": "service_unavailable"}}
            return await _send_json(writer, 503, err, b"x-flipsync-draining: 1\r\nretry-after: 1\r\n")
        if self.status != 200:
            kind = "upstream_unavailable" if self.status == 502 else "service_unavailable"
            return await _send_json(writer, self.status, {"error": {"message": "stub says no", "type": kind}})
        if self.hold is not None:
            while not self.hold.is_set():
                await asyncio.sleep(0.01)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        stream = b'"stream": true' in body or b'"stream":true' in body
        stamp = {"start": self.version, "end": self.version}
        if not stream:
            doc = {"object": "text_completion", "choices": [{"index": 0, "text": "ok"}], "weight_version": stamp}
            return await _send_json(writer, 200, doc)
        await self._stream(writer, stamp)

    async def _stream(self, writer: asyncio.StreamWriter, stamp: dict[str, int]) -> None:
        self.streams_started += 1
        if self.shared is not None:
            self.shared.add()
        else:
            self.wake()
        self.streams_open += 1
        self.peak_streams = max(self.peak_streams, self.streams_open)
        try:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                b"x-flipsync-weight-version-start: " + str(self.version).encode() + b"\r\n\r\n"
            )
            for i in range(self.events):
                event = {"choices": [{"index": 0, "text": f"t{i}"}], "weight_version": stamp}
                writer.write(_chunk(b"data: " + json.dumps(event).encode() + b"\n\n"))
                await writer.drain()
                if i == 0 and self.barrier:  # every stream open at once: the proof of concurrency
                    await self._wait_barrier()
            writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()
        finally:
            self.streams_open -= 1

    def wake(self) -> None:
        """Another stream started (maybe on another stub's loop): let this stub's waiters look again."""
        loop, event = self._loop, self._event
        if loop is not None and event is not None and self._started() >= self.barrier:
            loop.call_soon_threadsafe(event.set)

    async def _wait_barrier(self) -> None:
        # One event per stub, set once the barrier is reached: thousands of waiting streams cost nothing.
        if self._event is None:
            self._event = asyncio.Event()
        if self._started() >= self.barrier:
            self._event.set()
        try:
            await asyncio.wait_for(self._event.wait(), self.barrier_timeout_s)
        except TimeoutError:
            self.barrier_timeouts += 1

    def _started(self) -> int:
        return self.streams_started if self.shared is None else self.shared.started


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _send_json(writer: asyncio.StreamWriter, status: int, doc: Any, extra: bytes = b"") -> None:
    data = json.dumps(doc).encode()
    writer.write(
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
        % (status, _REASONS.get(status, "Status").encode(), len(data), extra)
        + data
    )
    await writer.drain()


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    first_byte_s: float  # from the request's send to the response head
    total_s: float


class RawClient:
    """One keep-alive HTTP/1.1 connection: ``post`` sends a request and reads its whole answer."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def connect(self) -> RawClient:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        return self

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await self._writer.wait_closed()
            self._writer = None

    async def post(self, path: str, doc: dict[str, Any], headers: dict[str, str] | None = None) -> RawResponse:
        if self._writer is None:
            await self.connect()
        assert self._reader is not None and self._writer is not None
        data = json.dumps(doc).encode()
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        t = time.perf_counter()
        self._writer.write(
            (
                f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(data)}\r\n{extra}\r\n"
            ).encode()
            + data
        )
        await self._writer.drain()
        head = await self._reader.readuntil(b"\r\n\r\n")
        first = time.perf_counter() - t
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        out: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                k, _, v = line.partition(":")
                out[k.strip().lower()] = v.strip()
        if out.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int((await self._reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self._reader.readuntil(b"\r\n")
                    break
                parts.append(await self._reader.readexactly(size))
                await self._reader.readexactly(2)
            body = b"".join(parts)
        else:
            body = await self._reader.readexactly(int(out.get("content-length", "0") or 0))
        if out.get("connection", "").lower() == "close":
            await self.close()
        return RawResponse(status, out, body, first, time.perf_counter() - t)


def raise_open_files(wanted: int) -> None:
    """Raise this process's open-file limit towards ``wanted`` (processes it starts inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


@contextmanager
def gateway_process(replicas: list[str], *extra: str) -> Iterator[int]:
    """A ``flipsync gateway`` process over static replicas; yields its port once /readyz counts them all."""
    port = free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "flipsync.cli.gateway", "gateway", "--listen", f"127.0.0.1:{port}", *extra]
    for url in replicas:
        cmd += ["--replica", url]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
                if r.status_code == 200 and r.json()["ready_replicas"] == len(replicas):
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the bench's gateway did not become ready within 120 s")
            time.sleep(0.1)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


async def concurrent_streams(port: int, n: int) -> list[RawResponse | BaseException]:
    """``n`` streams through the gateway at ``port``, all at once (connecting 256 at a time)."""
    connecting = asyncio.Semaphore(256)

    async def one(i: int) -> RawResponse:
        client = RawClient("127.0.0.1", port)
        async with connecting:
            await client.connect()
        try:
            return await client.post("/v1/completions", {"prompt": f"p{i}", "stream": True, "max_tokens": 3})
        finally:
            await client.close()

    return await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)


def main() -> None:
    """``python -m flipsync.fleet.stub_replica [PORT] [--replicas N] [--barrier B]``: stub replicas until
    killed, apart from the process that measures (their URLs printed, one a line; with ``--barrier``, their
    streams wait for B streams across all of them)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m flipsync.fleet.stub_replica")
    parser.add_argument("port", nargs="?", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--barrier", type=int, default=0)
    args = parser.parse_args()
    shared = StreamCount()
    for i in range(args.replicas):
        port = args.port + i if args.port else 0
        stub = StubReplica(port=port, barrier=args.barrier, shared=shared, barrier_timeout_s=600).start()
        print(stub.url, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
