"""The gateway's connections to replicas: httpcore pools, several a replica (`ReplicaConnections`), over a
network backend on plain asyncio streams (`AsyncioBackend`).

Why not httpcore's default (anyio) backend: see docs/fleet.md#measured. Timeouts map to httpcore's exceptions,
so the gateway sees the same errors as with the default backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import httpcore

Origin = tuple[bytes, bytes, int | None]  # scheme, host, port


@dataclass(eq=False)
class _Pool:
    http: httpcore.AsyncConnectionPool
    busy: int = 0  # requests in flight through it


class ReplicaConnections:
    """The gateway's connections to its replicas: httpcore pools of at most ``per_pool`` requests in flight each,
    as many a replica as its requests in flight need (each request to the first with room), the extras closed as
    the burst that needed them ends.
    ``max_connections`` bounds the requests in flight to all replicas together: one more waits for a slot up to
    its pool timeout, then fails with ``httpcore.PoolTimeout``, as it did with one pool of that size.

    Why not one pool: an httpcore pool scans every connection it holds at each request and at each answer's end,
    so one pool for the whole fleet cost O(n) a request with n in flight: with 5,000 streams in flight, half of
    the gateway's CPU went to those scans.
    """

    def __init__(
        self,
        max_connections: int,
        *,
        per_pool: int = 32,
        keepalive_expiry: float = 30.0,
        socket_options: Iterable[tuple[int, int, int]] | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.per_pool = per_pool
        self._keepalive_expiry = keepalive_expiry
        self._socket_options = list(socket_options or ())
        self._backend = AsyncioBackend()
        self._slots = asyncio.Semaphore(max_connections)
        self._pools: dict[Origin, list[_Pool]] = {}  # a replica's first pool stays (its idle connections)
        self._closing: set[asyncio.Task[None]] = set()  # pools of departed replicas, closing apart from requests

    def pools(self, origin: Origin) -> int:
        """How many pools ``origin`` has now."""
        return len(self._pools.get(origin, ()))

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        """httpcore's call: send ``request`` on a pooled connection to its origin; the answer's stream, once
        closed, gives its connection back."""
        if self._slots.locked():
            wait = request.extensions.get("timeout", {}).get("pool")
            try:
                async with asyncio.timeout(wait):
                    await self._slots.acquire()
            except TimeoutError:
                raise httpcore.PoolTimeout(
                    f"all {self.max_connections} connections to replicas stayed in use for {wait} s"
                ) from None
        else:
            await self._slots.acquire()
        u = request.url.origin
        origin = (u.scheme, u.host, u.port)
        pool = self._pick(origin)
        pool.busy += 1
        try:
            resp = await pool.http.handle_async_request(request)
        except BaseException:
            await self._release(origin, pool)
            raise
        resp.stream = _Releasing(resp.stream, self, origin, pool)
        return resp

    def _pick(self, origin: Origin) -> _Pool:
        pools = self._pools.setdefault(origin, [])
        for pool in pools:  # the first with room: the replica's first pool, then extras while a burst lasts
            if pool.busy < self.per_pool:
                return pool
        best = _Pool(
            httpcore.AsyncConnectionPool(
                max_connections=self.per_pool,
                max_keepalive_connections=self.per_pool,
                keepalive_expiry=self._keepalive_expiry,
                network_backend=self._backend,
                socket_options=self._socket_options,
            )
        )
        pools.append(best)
        return best

    async def _release(self, origin: Origin, pool: _Pool) -> None:
        pool.busy -= 1
        self._slots.release()
        if pool.busy:
            return
        pools = self._pools.get(origin, [])
        if pools and pools[0] is pool:
            return  # a replica's first pool keeps its idle connections for the next requests
        # an extra pool that emptied (the burst that needed it is over), or one of a replica that left
        if pool in pools:
            pools.remove(pool)
        await pool.http.aclose()

    def forget(self, keep: Sequence[str]) -> None:
        """Close the pools of every replica whose URL is not in ``keep`` (it left the fleet), on a task of their
        own so that no request waits for it; one with requests in flight closes as its last one ends."""
        kept = set()
        for url in keep:
            u = httpcore.URL(url).origin
            kept.add((u.scheme, u.host, u.port))
        for origin in [o for o in self._pools if o not in kept]:
            for pool in self._pools.pop(origin):
                if not pool.busy:
                    task = asyncio.get_running_loop().create_task(pool.http.aclose())
                    self._closing.add(task)
                    task.add_done_callback(self._closing.discard)

    async def aclose(self) -> None:
        pools = [p for ps in self._pools.values() for p in ps]
        self._pools.clear()
        for pool in pools:
            await pool.http.aclose()
        await asyncio.gather(*self._closing, return_exceptions=True)


class _Releasing:
    """An answer's stream that gives its pool slot back once closed (after httpcore gives back the connection)."""

    def __init__(self, inner: Any, owner: ReplicaConnections, origin: Origin, pool: _Pool) -> None:
        self._inner = inner
        self._owner = owner
        self._origin = origin
        self._pool: _Pool | None = pool

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._inner.__aiter__()  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            pool, self._pool = self._pool, None
            if pool is not None:
                await self._owner._release(self._origin, pool)


_CONNECT_ERRORS = (OSError, ssl.SSLError, asyncio.IncompleteReadError)


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One TCP (or TLS) connection as an asyncio reader/writer pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            async with asyncio.timeout(timeout):
                return await self._reader.read(max_bytes)
        except TimeoutError:
            raise httpcore.ReadTimeout(f"no data within {timeout} s") from None
        except OSError as e:
            raise httpcore.ReadError(str(e)) from e

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            async with asyncio.timeout(timeout):
                self._writer.write(buffer)
                await self._writer.drain()
        except TimeoutError:
            raise httpcore.WriteTimeout(f"could not write within {timeout} s") from None
        except OSError as e:
            raise httpcore.WriteError(str(e)) from e

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):  # the peer went first: nothing left to close
            await self._writer.wait_closed()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                await self._writer.start_tls(ssl_context, server_hostname=server_hostname)
        except TimeoutError:
            await self.aclose()
            raise httpcore.ConnectTimeout(f"no TLS handshake within {timeout} s") from None
        except _CONNECT_ERRORS as e:
            await self.aclose()
            raise httpcore.ConnectError(str(e)) from e
        return self

    def get_extra_info(self, info: str) -> Any:
        if info == "ssl_object":
            return self._writer.get_extra_info("ssl_object")
        if info == "client_addr":
            return self._writer.get_extra_info("sockname")
        if info == "server_addr":
            return self._writer.get_extra_info("peername")
        if info == "socket":
            return self._writer.get_extra_info("socket")
        if info == "is_readable":
            # An idle connection is readable when the server closed it (or sent something unasked).
            return self._reader.at_eof() or _socket_readable(self._writer.get_extra_info("socket"))
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """Connects with ``asyncio.open_connection`` (TCP_NODELAY on)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[tuple[int, int, int] | tuple[int, int, bytes]] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(
                    host, port, local_addr=(local_address, 0) if local_address else None
                )
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"could not connect to {host}:{port} within {timeout} s") from None
        except _CONNECT_ERRORS as e:
            raise httpcore.ConnectError(f"could not connect to {host}:{port}: {e}") from e
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for option in socket_options or ():
                sock.setsockopt(*option)
        return AsyncioStream(reader, writer)

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[tuple[int, int, int] | tuple[int, int, bytes]] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(path)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"could not connect to {path} within {timeout} s") from None
        except _CONNECT_ERRORS as e:
            raise httpcore.ConnectError(f"could not connect to {path}: {e}") from e
        return AsyncioStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _socket_readable(sock: socket.socket | None) -> bool:
    if sock is None or sock.fileno() < 0:
        return True  # gone: the next read returns the end
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))
