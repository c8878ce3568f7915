"""``flipsync relay``: a read-only, read-through cache of a board for the sidecars of one rollout island, so the
WAN carries each object once per island; it trusts nothing it serves. See docs/sidecar.md ("The island relay").
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import math
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from email.utils import format_datetime
from typing import Any, TypeVar

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from flipsync.board.layout import LATEST, MANIFEST, parse_version_name
from flipsync.errors import ConfigError, FlipsyncError, NotFoundError, PermanentStoreError
from flipsync.stores import ObjectInfo, Store
from flipsync.stores.http import STORE_ERROR_DETAIL_HEADER, STORE_ERROR_HEADER

T = TypeVar("T")
log = logging.getLogger(__name__)
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


@dataclass(frozen=True)
class RelayConfig:
    max_cache_bytes: int = 4 << 30
    max_object_bytes: int = 1 << 30
    hint_ttl_s: float = 0.5
    listing_ttl_s: float = 1.0
    negative_ttl_s: float = 0.25
    upstream_concurrency: int = 16
    watch_interval_s: float = 0.05  # one upstream existence check per waited-for object this often
    max_wait_s: float = 60.0  # the longest a sidecar's wait request is held
    fetch_ahead: bool = True  # while waiting for a version's manifest, cache the objects already in its folder

    def __post_init__(self) -> None:
        if not self.watch_interval_s > 0:  # also refuses NaN
            raise ConfigError(f"the relay's watch interval must be above 0 s, not {self.watch_interval_s!r}")
        if not self.max_wait_s > 0:
            raise ConfigError(f"the relay's longest wait must be above 0 s, not {self.max_wait_s!r}")


class RelayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("flipsync_relay_requests", "Requests from sidecars, by operation", ["op"], registry=r)
        self.hits = Counter("flipsync_relay_cache_hits", "Requests answered from the cache", ["op"], registry=r)
        self.coalesced = Counter(
            "flipsync_relay_coalesced", "Requests that joined a fetch already under way", ["op"], registry=r
        )
        self.upstream = Counter("flipsync_relay_upstream_requests", "Fetches from the board", ["op"], registry=r)
        self.upstream_bytes = Counter("flipsync_relay_upstream_bytes", "Bytes fetched from the board", registry=r)
        self.upstream_errors = Counter(
            "flipsync_relay_upstream_errors", "Failed fetches from the board (not 404)", registry=r
        )
        self.served_bytes = Counter("flipsync_relay_served_bytes", "Object bytes sent to sidecars", registry=r)
        self.cache_bytes = Gauge("flipsync_relay_cache_bytes", "Bytes held in the cache", registry=r)
        self.ahead = Counter(
            "flipsync_relay_fetched_ahead", "Objects fetched before their version's manifest existed", registry=r
        )


@dataclass
class _Entry:
    value: Any
    error: NotFoundError | None
    size: int
    expires: float


class RelayCache:
    """The cache and the coalescing of upstream fetches; lives on the relay's event loop (no locks)."""

    def __init__(self, store: Store, config: RelayConfig | None = None, metrics: RelayMetrics | None = None) -> None:
        self.store = store
        self.config = config or RelayConfig()
        self.metrics = metrics or RelayMetrics()
        self._entries: OrderedDict[tuple[str, ...], _Entry] = OrderedDict()
        self._inflight: dict[tuple[str, ...], asyncio.Task[Any]] = {}
        self._watches: dict[str, tuple[asyncio.Task[bool], list[int]]] = {}  # path -> (poller, [waiters])
        self._ahead: set[asyncio.Task[Any]] = set()  # fetches started ahead (referenced until done)
        self.cached_bytes = 0  # bytes held in the cache
        self._pool = ThreadPoolExecutor(self.config.upstream_concurrency, thread_name_prefix="flipsync-relay")
        self.stats = {"upstream": 0, "hits": 0, "coalesced": 0, "requests": 0}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def ttl(self, path: str) -> float:
        """How long an object may be served from the cache: the HEAD hint briefly, everything else forever."""
        return self.config.hint_ttl_s if path.rsplit("/", 1)[-1] == LATEST else math.inf

    async def _lookup(
        self, key: tuple[str, ...], fetch: Callable[[], T], *, ttl: float, size_of: Callable[[T], int]
    ) -> T:
        op = key[0]
        self.metrics.requests.labels(op=op).inc()
        self.stats["requests"] += 1
        e = self._entries.get(key)
        if e is not None:
            if e.expires > time.monotonic():
                self._entries.move_to_end(key)
                self.metrics.hits.labels(op=op).inc()
                self.stats["hits"] += 1
                if e.error is not None:
                    raise NotFoundError(str(e.error))
                return e.value
            self._drop(key)
        task = self._inflight.get(key)
        if task is None:
            task = asyncio.create_task(self._fill(key, fetch, ttl=ttl, size_of=size_of))
            self._inflight[key] = task
            task.add_done_callback(lambda t, k=key: self._done(k, t))  # type: ignore[misc]
        else:
            self.metrics.coalesced.labels(op=op).inc()
            self.stats["coalesced"] += 1
        # shield: a client that goes away does not cancel the fetch the others are waiting for.
        return await asyncio.shield(task)

    def _done(self, key: tuple[str, ...], task: asyncio.Task[Any]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved: nobody may be left to await it

    async def _fill(
        self, key: tuple[str, ...], fetch: Callable[[], T], *, ttl: float, size_of: Callable[[T], int]
    ) -> T:
        loop = asyncio.get_running_loop()
        self.metrics.upstream.labels(op=key[0]).inc()
        self.stats["upstream"] += 1
        try:
            value = await loop.run_in_executor(self._pool, fetch)
        except NotFoundError as e:
            if self.config.negative_ttl_s > 0:
                self._put(key, _Entry(None, e, 0, time.monotonic() + self.config.negative_ttl_s))
            raise
        except FlipsyncError:
            self.metrics.upstream_errors.inc()
            raise
        size = size_of(value)
        if key[0] == "get":
            self.metrics.upstream_bytes.inc(size)
        if ttl > 0 and size <= self.config.max_object_bytes:  # larger objects are streamed through
            self._put(key, _Entry(value, None, size, time.monotonic() + ttl))
        return value

    def _put(self, key: tuple[str, ...], entry: _Entry) -> None:
        self._drop(key)
        self._entries[key] = entry
        self.cached_bytes += entry.size
        while self.cached_bytes > self.config.max_cache_bytes and len(self._entries) > 1:
            self._drop(next(iter(self._entries)))
        self.metrics.cache_bytes.set(self.cached_bytes)

    def _drop(self, key: tuple[str, ...]) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.cached_bytes -= old.size

    # -- operations -----------------------------------------------------------------------------------

    async def head(self, path: str) -> ObjectInfo:
        return await self._lookup(
            ("head", path), lambda: self.store.head(path), ttl=self.ttl(path), size_of=lambda _: 64
        )

    async def get(self, path: str) -> tuple[bytes, ObjectInfo]:
        info = await self.head(path)
        data = await self._lookup(
            ("get", path), lambda: self.store.get(path, size=info.size), ttl=self.ttl(path), size_of=len
        )
        return data, info

    async def get_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``start:end``: from the cached object, or (large objects) a coalesced range read."""
        info = await self.head(path)
        if info.size <= self.config.max_object_bytes:
            data, _ = await self.get(path)
            return data[start:end]
        return await self._lookup(
            ("range", path, str(start), str(end)), lambda: self.store.get_range(path, start, end), ttl=0, size_of=len
        )

    async def wait_exists(self, path: str, timeout_s: float) -> bool:
        """True once ``path`` exists upstream, False after ``timeout_s``. Every waiter for one path shares a
        single poller, which stops when the last of them leaves."""
        self.metrics.requests.labels(op="wait").inc()
        e = self._entries.get(("head", path))
        if e is not None and e.error is None:
            return True  # known to exist (objects are immutable)
        watch = self._watches.get(path)
        if watch is None or watch[0].done():
            watch = self._watches[path] = (asyncio.create_task(self._poll_until_exists(path)), [0])
        task, waiters = watch
        waiters[0] += 1
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except TimeoutError:
            return False
        finally:
            waiters[0] -= 1
            if not waiters[0] and self._watches.get(path) is watch:
                del self._watches[path]
                task.cancel()

    async def _poll_until_exists(self, path: str) -> bool:
        loop = asyncio.get_running_loop()
        folder = _version_folder(path) if self.config.fetch_ahead else None
        started: set[str] = set()
        while True:
            self.metrics.upstream.labels(op="wait").inc()
            try:
                found = await loop.run_in_executor(self._pool, self.store.exists, path)
            except (PermanentStoreError, ConfigError):
                raise  # refused for good: every waiter hears it now
            except FlipsyncError as e:  # the board is unreachable for now: keep trying while anyone waits
                self.metrics.upstream_errors.inc()
                log.debug("waiting for %s: %s", path, e)
                found = False
            if found:
                self._drop(("head", path))  # a cached "missing" must not outlive the object's arrival
                return True
            if folder is not None:
                await self._fetch_ahead(folder, path, started)
            await asyncio.sleep(self.config.watch_interval_s)

    async def _fetch_ahead(self, folder: str, manifest: str, started: set[str]) -> None:
        """Start caching every object in a version's folder that this watch has not started yet."""
        loop = asyncio.get_running_loop()
        self.metrics.upstream.labels(op="list").inc()
        try:
            listed = await loop.run_in_executor(self._pool, self.store.list, folder)
        except FlipsyncError as e:
            log.debug("fetching %s ahead: %s", folder, e)
            return
        for o in listed:
            if o.path == manifest or o.path in started or o.size > self.config.max_object_bytes:
                continue
            started.add(o.path)
            self.metrics.ahead.inc()
            if ("head", o.path) not in self._entries:  # the listing already says what a HEAD would (immutable)
                self._put(("head", o.path), _Entry(o, None, 64, self.ttl(o.path)))
            task = asyncio.create_task(self.get(o.path))
            self._ahead.add(task)
            task.add_done_callback(self._ahead_done)

    def _ahead_done(self, task: asyncio.Task[Any]) -> None:
        self._ahead.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a sidecar's own read retries it
            log.debug("a fetch ahead failed: %s", task.exception())

    async def list(self, prefix: str) -> list[ObjectInfo]:
        return await self._lookup(
            ("list", prefix),
            lambda: self.store.list(prefix),
            ttl=self.config.listing_ttl_s,
            size_of=lambda v: 64 * len(v),
        )

    async def list_dirs(self, prefix: str) -> builtins.list[str]:
        return await self._lookup(
            ("dirs", prefix),
            lambda: self.store.list_dirs(prefix),
            ttl=self.config.listing_ttl_s,
            size_of=lambda v: 32 * len(v),
        )


def _version_folder(path: str) -> str | None:
    """The version folder whose manifest ``path`` is (``.../versions/<v>/manifest.json``), else None."""
    folder, _, name = path.rpartition("/")
    parent, _, version = folder.rpartition("/")
    if name != MANIFEST or parse_version_name(version) is None or not parent.endswith("/versions"):
        return None
    return folder


def _check_path(path: str, *, allow_empty: bool = False) -> str:
    """``path``, or a 400 saying why it is refused. Paths are relative, '/'-separated, no dot segments."""
    why = None
    if not path:
        why = None if allow_empty else "empty path"
    elif path.startswith("/") or "\\" in path or "\x00" in path:
        why = "paths are relative and '/'-separated"
    elif any(seg in ("", ".", "..") for seg in path.split("/")):
        why = "empty, '.' and '..' segments are not allowed"
    if why is not None:
        raise HTTPException(400, why)
    return path


def _info_headers(info: ObjectInfo, ttl: float) -> dict[str, str]:
    h = {
        "Last-Modified": format_datetime(info.modified, usegmt=True) if info.modified.tzinfo else "",
        "Accept-Ranges": "bytes",
        "Cache-Control": "public, max-age=31536000, immutable" if math.isinf(ttl) else "no-cache",
    }
    if info.etag:
        h["ETag"] = info.etag if info.etag.startswith(('"', "W/")) else f'"{info.etag}"'
    return {k: v for k, v in h.items() if v}


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` / ``a-`` / ``-n`` -> [start, end); None: not satisfiable."""
    m = _RANGE.fullmatch(header.strip())
    if m is None or (not m.group(1) and not m.group(2)):
        return None
    if not m.group(1):
        n = int(m.group(2))
        return (max(0, size - n), size) if n > 0 else None
    start = int(m.group(1))
    end = min(size, int(m.group(2)) + 1) if m.group(2) else size
    return (start, end) if start < end else None


def create_relay_app(cache: RelayCache) -> FastAPI:
    """The relay's HTTP API (see ``flipsync.stores.http`` for the client side)."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        cache.close()

    app = FastAPI(title="flipsync relay", lifespan=lifespan)

    @app.exception_handler(FlipsyncError)
    async def failure(_request: Request, e: FlipsyncError) -> JSONResponse:
        if isinstance(e, NotFoundError):
            return JSONResponse({"detail": str(e)}, status_code=404)
        # The board's store retried a transient failure already: the header tells the client not to again.
        kind = "permanent" if isinstance(e, PermanentStoreError | ConfigError) else "transient"
        # A HEAD answer has no body: the cause travels in a header too (one ASCII line).
        detail = str(e).replace("\n", " ")[:1000].encode("ascii", "replace").decode()
        headers = {STORE_ERROR_HEADER: kind, STORE_ERROR_DETAIL_HEADER: detail}
        return JSONResponse({"detail": str(e)}, status_code=502, headers=headers)

    @app.api_route("/board/o/{path:path}", methods=["GET", "HEAD"])
    async def obj(request: Request, path: str) -> Response:
        info = await cache.head(_check_path(path))
        headers = _info_headers(info, cache.ttl(path))
        if request.method == "HEAD":
            headers["Content-Length"] = str(info.size)
            return Response(status_code=200, headers=headers)
        if rng := request.headers.get("range"):
            span = _parse_range(rng, info.size)
            if span is None:
                return Response(status_code=416, headers={"Content-Range": f"bytes */{info.size}"})
            data = await cache.get_range(path, *span)
            headers["Content-Range"] = f"bytes {span[0]}-{span[0] + len(data) - 1}/{info.size}"
            cache.metrics.served_bytes.inc(len(data))
            return Response(data, status_code=206, headers=headers, media_type="application/octet-stream")
        data, _ = await cache.get(path)
        cache.metrics.served_bytes.inc(len(data))
        return Response(data, status_code=200, headers=headers, media_type="application/octet-stream")

    @app.get("/board/wait/{path:path}")
    async def wait(path: str, timeout: float = 10.0) -> Response:
        """Answers ``{"exists": true}`` once the object exists, ``false`` when ``timeout`` seconds passed first."""
        _check_path(path)
        if not 0 <= timeout <= cache.config.max_wait_s:
            return JSONResponse({"detail": f"timeout must be within 0..{cache.config.max_wait_s:g} s"}, status_code=400)
        return JSONResponse({"exists": await cache.wait_exists(path, timeout)})

    @app.get("/board/list")
    async def listing(prefix: str = "") -> Response:
        objs = await cache.list(_check_path(prefix, allow_empty=True))
        rows = [{"path": o.path, "size": o.size, "modified": o.modified.isoformat(), "etag": o.etag} for o in objs]
        return JSONResponse({"objects": rows})

    @app.get("/board/dirs")
    async def dirs(prefix: str = "") -> Response:
        return JSONResponse({"dirs": await cache.list_dirs(_check_path(prefix, allow_empty=True))})

    @app.get("/relay/stats")
    async def stats() -> dict[str, Any]:
        return {"board": cache.store.url, **cache.stats, "cached_bytes": cache.cached_bytes}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(cache.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
