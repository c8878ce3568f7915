"""The gateway: one OpenAI-compatible front door for a whole fleet, routing every request by policy version.

Each ``POST`` (``/v1/completions``, ``/v1/chat/completions``, streaming or not, any other model call) goes to
one live replica of the pool:

- a request with a version constraint (``weight_version: {"min_version": N}`` / ``{"exact_version": N}`` in
  the body, or the ``X-Flipsync-Min-Version`` / ``-Exact-Version`` headers, read exactly as a sidecar reads
  them) goes to a replica whose version satisfies it; one without goes to a *ready* replica (a verified
  version within ``max_lag`` of the board's HEAD), and the gateway adds ``X-Flipsync-Min-Version: HEAD -
  max_lag`` so that the replica itself, which knows what it holds, refuses if its record was out of date;
- only replicas of the model, served format and run asked for: the OpenAI ``model`` field (``NAME``, or
  ``NAME@FORMAT`` for one served format), the ``X-Flipsync-Format`` and ``X-Flipsync-Run`` headers;
- least requests in flight first (this gateway's own count, then the record's);
- a 409 or 503 from the replica, a 502 (its engine unreachable), a refused or broken connection before
  the response: the next replica (a replica that refused a connection is skipped until it writes a newer
  heartbeat). When no replica can serve it, the request is held, for at most ``hold_s``, until one can; then
  a constrained request is answered 409 and an unconstrained one 503, both with ``Retry-After``.

Responses are relayed as the replica sent them (its version stamps untouched), with ``X-Flipsync-Replica``
(who served it), ``X-Flipsync-Fleet-Head`` (the HEAD the route was chosen against) and
``X-Flipsync-Attempts``. A stream cut by a replica that dies after its first byte ends with an ``error``
event: tokens already sent cannot be taken back (a drained replica never cuts one).

Control: ``GET /flipsync/fleet`` (members, versions, readiness), ``GET /flipsync/health``,
``GET /flipsync/wait?min_version=N``, ``GET /v1/models`` (the fleet's models), ``GET /metrics``.

The gateway keeps no state beyond the pool's last snapshot and its own in-flight counts, so several can
run behind one load balancer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import httpcore
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from flipsync.board.membership import REASONS
from flipsync.domain.fleet import MemberRecord, Want, admits, floor_version, rank, satisfies, serves
from flipsync.errors import FlipsyncError
from flipsync.fleet.metrics import GatewayMetrics
from flipsync.fleet.pool import FleetSnapshot, Pool
from flipsync.fleet.transport import AsyncioBackend
from flipsync.sidecar.proxy import BODY_FIELD, H_MIN, BadRequest, parse_constraint

log = logging.getLogger(__name__)

H_FORMAT = "x-flipsync-format"
H_RUN = "x-flipsync-run"
H_REPLICA = "x-flipsync-replica"
H_FLEET_HEAD = "x-flipsync-fleet-head"
H_ATTEMPTS = "x-flipsync-attempts"
# Hop-by-hop headers (RFC 9110 7.6.1), those recomputed here, and the gateway's own.
_DROP_REQUEST = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"content-length",
        b"accept-encoding",
        H_FORMAT.encode(),
        H_RUN.encode(),
    }
)
_DROP_RESPONSE = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"date",
        b"server",
    }
)


@dataclass(frozen=True)
class GatewayConfig:
    """How the gateway routes. ``max_lag``: versions behind HEAD a replica may be and still take
    unconstrained traffic. ``hold_s``: how long a request waits for a replica that can serve it.
    ``refresh_s``: seconds between scans of the pool (``held_refresh_s`` while requests are held)."""

    max_lag: int = 2
    hold_s: float = 10.0
    refresh_s: float = 1.0
    held_refresh_s: float = 0.2
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 600.0  # one read of the replica (a token gap), not the whole response
    max_body_bytes: int = 64 << 20
    retry_after_s: int = 1
    suspect_s: float = 30.0  # a replica that refused a connection: skipped until it writes again (at most this)
    max_connections: int = 1024


class FleetView:
    """The gateway's view of the fleet: the pool's last snapshot, refreshed on a thread, and per replica the
    requests this gateway has in flight there and when it last refused a connection."""

    def __init__(self, pool: Pool, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.pool = pool
        self.config = config
        self.metrics = metrics
        self.snapshot = FleetSnapshot((), {})
        self.refreshed = 0.0  # monotonic time of the last good scan (0: never)
        self.error: str | None = None
        self.in_flight: dict[str, int] = {}
        self.suspects: dict[str, tuple[datetime, float]] = {}  # replica -> (failed at, skip until monotonic)
        self.holders = 0
        self.scans = 0
        self.rng = random.Random()  # ties between equally loaded replicas
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> bool:
        """Scan the pool now; on failure the last snapshot stays (routing goes on from it)."""
        try:
            snapshot = self.pool.discover_replicas()
        except FlipsyncError as e:
            self.metrics.refresh_failures.inc()
            if self.error is None:
                log.warning("cannot read the fleet (routing from the last snapshot): %s", e)
            self.error = str(e)
            return False
        self.snapshot, self.refreshed, self.error = snapshot, time.monotonic(), None
        self.scans += 1
        self._set_gauges(snapshot)
        return True

    def _set_gauges(self, snap: FleetSnapshot) -> None:
        m = self.metrics
        for run, info in snap.runs().items():
            m.members.labels(run=run).set(info["members"])
            m.ready.labels(run=run).set(sum(1 for r in snap.ready(self.config.max_lag) if r.run == run))
            m.readiness.labels(run=run).set(-1 if info["readiness"] is None else info["readiness"])
            m.head.labels(run=run).set(-1 if info["head"] is None else info["head"])
        counts: dict[str, int] = {}
        for rej in snap.rejected:
            counts[rej.reason] = counts.get(rej.reason, 0) + 1
        for reason in {*REASONS, *counts}:
            m.rejected.labels(reason=reason).set(counts.get(reason, 0))

    def start(self) -> FleetView:
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="flipsync-gateway-refresh", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            interval = self.config.held_refresh_s if self.holders else self.config.refresh_s
            self._wake.wait(interval)
            self._wake.clear()
            if not self._stop.is_set():
                self.refresh()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    @contextmanager
    def holding(self) -> Iterator[None]:
        """A request is waiting for the fleet to change: scan faster meanwhile (and once at once)."""
        self.holders += 1
        if self.holders == 1:
            self._wake.set()
        try:
            yield
        finally:
            self.holders -= 1

    def age_s(self) -> float | None:
        return None if not self.refreshed else time.monotonic() - self.refreshed

    def suspect(self, r: MemberRecord) -> bool:
        s = self.suspects.get(r.replica)
        if s is None:
            return False
        failed_at, until = s
        if r.heartbeat_at > failed_at or time.monotonic() > until:  # it wrote since (back), or long enough
            self.suspects.pop(r.replica, None)
            return False
        return True

    def unreachable(self, r: MemberRecord) -> None:
        self.suspects[r.replica] = (datetime.now(UTC), time.monotonic() + self.config.suspect_s)

    def candidates(self, want: Want) -> tuple[list[MemberRecord], FleetSnapshot]:
        snap = self.snapshot
        ok = [r for r in snap.members if admits(r, want, snap.head(r), self.config.max_lag) and not self.suspect(r)]
        return rank(ok, self.in_flight, self.rng), snap

    def models(self) -> list[dict[str, Any]]:
        seen: dict[str, set[str]] = {}
        for r in self.snapshot.members:
            seen.setdefault(r.model, set()).add(r.served_format)
        out = []
        for model in sorted(seen):
            out.append({"id": model, "object": "model", "owned_by": "flipsync", "formats": sorted(seen[model])})
        for model in sorted(seen):
            out += [{"id": f"{model}@{f}", "object": "model", "owned_by": "flipsync"} for f in sorted(seen[model])]
        return out


class _Retry(Exception):
    """One attempt that another replica may do better: ``reason`` (a metric label) and the refusal, if any."""

    def __init__(self, reason: str, status: int | None = None, body: bytes = b"") -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.body = body


@dataclass
class _Request:
    path: str  # with the query string
    headers: list[tuple[bytes, bytes]]
    body: bytes
    want: Want
    receive: Receive | None = None  # the client's channel, to see it go away mid-stream


class Gateway:
    """The gateway over ``pool``, an ASGI application (serve it with uvicorn)."""

    def __init__(self, pool: Pool, config: GatewayConfig | None = None) -> None:
        self.pool = pool
        self.config = config or GatewayConfig()
        self.metrics = GatewayMetrics()
        self.view = FleetView(pool, self.config, self.metrics)
        self.http: httpcore.AsyncConnectionPool | None = None
        self.control = self._control_app()
        self.retry_after = str(max(1, self.config.retry_after_s))
        self._timeouts = {
            "connect": self.config.connect_timeout_s,
            "read": self.config.request_timeout_s,
            "write": self.config.request_timeout_s,
            "pool": self.config.request_timeout_s,
        }

    # -- ASGI ---------------------------------------------------------------------------------------------

    @property
    def app(self) -> Gateway:
        """The ASGI application: the gateway itself."""
        return self

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope["path"].startswith("/flipsync/"):
            await self._route(scope, receive, send)
            return
        await self.control(scope, receive, send)

    @asynccontextmanager
    async def _lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        self.http = httpcore.AsyncConnectionPool(
            max_connections=self.config.max_connections,
            max_keepalive_connections=256,
            keepalive_expiry=30.0,
            network_backend=AsyncioBackend(),
        )
        await asyncio.to_thread(self.view.start)
        try:
            yield
        finally:
            self.view.stop()
            await self.http.aclose()
            self.http = None

    # -- routing ------------------------------------------------------------------------------------------

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.monotonic()
        self.metrics.in_flight.inc()
        try:
            request = await self._read(scope, receive)
            if isinstance(request, Response):
                self.metrics.outcome("bad_request")
                await request(scope, receive, send)
                return
            request.receive = receive
            await self._serve(request, scope, receive, send, t0)
        finally:
            self.metrics.in_flight.dec()

    async def _read(self, scope: Scope, receive: Receive) -> _Request | Response:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _error(499, "the client went away", "client_closed")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.config.max_body_bytes:
                return _error(413, f"the body exceeds {self.config.max_body_bytes} bytes", "invalid_request_error")
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        headers = [(k.lower(), v) for k, v in scope["headers"]]
        named = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
        doc: Any = None
        if body and "json" in named.get("content-type", "application/json"):
            try:
                doc = json.loads(body)
            except ValueError:
                doc = None  # not ours to judge: the replica answers malformed bodies
            except RecursionError:
                return _error(
                    400, "the JSON body nests too deeply to parse; send a flatter body", "invalid_request_error"
                )
        try:
            field = doc.get(BODY_FIELD) if isinstance(doc, dict) else None
            constraint = parse_constraint(field, named)
        except BadRequest as e:
            return _error(400, str(e), "invalid_request_error")
        model = doc.get("model") if isinstance(doc, dict) else None
        fmt = named.get(H_FORMAT) or None
        if isinstance(model, str) and "@" in model:  # NAME@FORMAT: one served format of the model
            model, _, fmt = model.rpartition("@")
            assert isinstance(doc, dict)
            doc["model"] = model
            body = json.dumps(doc).encode()
        want = Want(
            constraint.min_version,
            constraint.exact_version,
            model if isinstance(model, str) and model else None,
            fmt,
            named.get(H_RUN) or None,
        )
        forwarded = [(k, v) for k, v in headers if k not in _DROP_REQUEST]
        query = scope.get("query_string", b"")
        path = scope["path"] + (f"?{query.decode('latin-1')}" if query else "")
        return _Request(path, forwarded, body, want)

    async def _serve(self, req: _Request, scope: Scope, receive: Receive, send: Send, t0: float) -> None:
        attempts = [0]
        try:
            last = await self._pass(req, attempts, send, t0)
            if last is True:
                return
            held_since = time.monotonic()
            deadline = t0 + self.config.hold_s
            with self.view.holding():  # wait for the fleet to change: a replica catching up, or joining
                while (left := deadline - time.monotonic()) > 0:
                    await asyncio.sleep(min(0.1, left))
                    outcome = await self._pass(req, attempts, send, t0)
                    if outcome is True:
                        self.metrics.held_seconds.observe(time.monotonic() - held_since)
                        return
                    last = outcome or last
            self.metrics.held_seconds.observe(time.monotonic() - held_since)
        except httpcore.TimeoutException as e:  # the replica took longer than request_timeout_s to answer
            self.metrics.outcome("timeout")
            await _error(504, f"the replica did not answer in time: {e}", "upstream_timeout")(scope, receive, send)
            return
        await self._refuse(req, last, scope, receive, send)

    async def _pass(self, req: _Request, attempts: list[int], send: Send, t0: float) -> _Retry | bool | None:
        """Try every replica that may serve ``req`` once, best first: True once one answered, else the last
        refusal (None: no replica to try)."""
        candidates, snap = self.view.candidates(req.want)
        last: _Retry | None = None
        for r in candidates:
            attempts[0] += 1
            try:
                await self._attempt(r, snap, req, attempts[0], send, t0)
            except _Retry as e:
                last = e
                self.metrics.retry(e.reason)
                continue
            return True
        return last

    async def _attempt(
        self,
        r: MemberRecord,
        snap: FleetSnapshot,
        req: _Request,
        attempt: int,
        send: Send,
        t0: float,
    ) -> None:
        """Send ``req`` to ``r`` and relay its answer; raise _Retry where another replica may serve it."""
        assert self.http is not None
        head = snap.head(r)
        headers = [(b"host", _netloc(r.url)), (b"content-length", str(len(req.body)).encode()), *req.headers]
        floor = floor_version(req.want, head, self.config.max_lag)
        if floor is not None:
            headers.append((H_MIN.encode(), str(floor).encode()))
        upstream = httpcore.Request(
            b"POST",
            r.url.rstrip("/") + req.path,
            headers=headers,
            content=req.body,
            extensions={"timeout": self._timeouts},
        )
        view = self.view
        view.in_flight[r.replica] = view.in_flight.get(r.replica, 0) + 1
        try:
            try:
                resp = await self.http.handle_async_request(upstream)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                view.unreachable(r)
                raise _Retry("unreachable") from e
            except (httpcore.ReadTimeout, httpcore.WriteTimeout, httpcore.PoolTimeout):
                raise
            except (httpcore.NetworkError, httpcore.RemoteProtocolError) as e:  # dropped before it answered
                raise _Retry("broken") from e
            status = resp.status
            is_stream = _header(resp.headers, b"content-type").startswith(b"text/event-stream")
            if status in (409, 503, 502) and not is_stream:
                try:
                    body = await _read_all(resp)
                except (httpcore.NetworkError, httpcore.RemoteProtocolError) as e:
                    raise _Retry("broken") from e
                if status == 409 or status == 503 or _is_unreachable(body):
                    raise _Retry({409: "refused_409", 503: "refused_503"}.get(status, "upstream_502"), status, body)
                await self._answer(resp.status, resp.headers, body, r, head, attempt, send)
                self.metrics.outcome("upstream_status")
                return
            if is_stream:
                await self._relay_stream(resp, r, head, attempt, send, t0, req.receive)
                return
            try:
                body = await _read_all(resp)
            except (httpcore.NetworkError, httpcore.RemoteProtocolError) as e:  # died mid-answer: nothing sent yet
                view.unreachable(r)
                raise _Retry("broken") from e
            self.metrics.request_seconds.observe(time.monotonic() - t0)
            await self._answer(status, resp.headers, body, r, head, attempt, send)
            self.metrics.outcome("ok" if status < 400 else "upstream_status")
        finally:
            n = view.in_flight.get(r.replica, 1) - 1
            if n > 0:
                view.in_flight[r.replica] = n
            else:
                view.in_flight.pop(r.replica, None)

    def _headers(
        self, upstream: list[tuple[bytes, bytes]], r: MemberRecord, head: int | None, attempt: int
    ) -> list[tuple[bytes, bytes]]:
        out = [(k, v) for k, v in upstream if k.lower() not in _DROP_RESPONSE]
        out.append((H_REPLICA.encode(), r.replica.encode()))
        if head is not None:
            out.append((H_FLEET_HEAD.encode(), str(head).encode()))
        out.append((H_ATTEMPTS.encode(), str(attempt).encode()))
        return out

    async def _answer(
        self,
        status: int,
        upstream: list[tuple[bytes, bytes]],
        body: bytes,
        r: MemberRecord,
        head: int | None,
        attempt: int,
        send: Send,
    ) -> None:
        headers = self._headers(upstream, r, head, attempt)
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _relay_stream(
        self,
        resp: httpcore.Response,
        r: MemberRecord,
        head: int | None,
        attempt: int,
        send: Send,
        t0: float,
        receive: Receive | None,
    ) -> None:
        stream = resp.aiter_stream()
        try:
            try:
                first = await anext(stream, b"")
            except (httpcore.NetworkError, httpcore.RemoteProtocolError) as e:  # nothing relayed yet: try elsewhere
                self.view.unreachable(r)
                raise _Retry("broken") from e
            self.metrics.request_seconds.observe(time.monotonic() - t0)
            headers = self._headers(resp.headers, r, head, attempt)
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            outcome = "ok" if resp.status < 400 else "upstream_status"
            gone = asyncio.Event()
            watcher = asyncio.create_task(_watch_disconnect(receive, gone)) if receive is not None else None
            try:
                async for chunk in stream:
                    if gone.is_set():  # the client left: stop (closing the replica's stream stops its generation)
                        break
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except (httpcore.NetworkError, httpcore.RemoteProtocolError, httpcore.TimeoutException) as e:
                # The status line has gone out: say so in the stream, as an engine that breaks off does.
                self.view.unreachable(r)
                outcome = "stream_cut"
                err = {
                    "error": {
                        "message": f"replica {r.replica} broke off the stream: {e}",
                        "type": "upstream_unavailable",
                    }
                }
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + json.dumps(err).encode() + b"\n\n",
                        "more_body": True,
                    }
                )
            finally:
                if watcher is not None:
                    watcher.cancel()
            await send({"type": "http.response.body", "body": b""})
            self.metrics.outcome(outcome)
        finally:
            await resp.aclose()

    async def _refuse(self, req: _Request, last: _Retry | None, scope: Scope, receive: Receive, send: Send) -> None:
        want = req.want
        snap = self.view.snapshot
        mine = [r for r in snap.members if serves(r, want)]
        versions = sorted({r.version for r in mine if r.serving and not r.draining and r.version is not None})
        heads = sorted({h for r in mine if (h := snap.head(r)) is not None})
        headers = {"Retry-After": self.retry_after}
        if want.constrained:
            self.metrics.outcome("rejected_version")
            served = ", ".join(f"v{v}" for v in versions) or "none"
            response = _error(
                409,
                f"no replica serves {want.describe()} within {self.config.hold_s:g} s (versions served now: {served})",
                "weight_version_unavailable",
                headers,
                weight_version={
                    "current": versions[-1] if versions else None,
                    "head": heads[-1] if heads else None,
                    "min_version": want.min_version,
                    "exact_version": want.exact_version,
                    "served": versions,
                },
            )
        else:
            self.metrics.outcome("unavailable")
            why = (
                f"; last answer: {last.status} {last.body[:200].decode('utf-8', 'replace')}"
                if last and last.status
                else ""
            )
            response = _error(
                503,
                f"no ready replica for {want.describe()} within {self.config.hold_s:g} s ({len(mine)} live, "
                f"{len(snap.ready(self.config.max_lag))} ready in the fleet){why}",
                "service_unavailable",
                headers,
            )
        await response(scope, receive, send)

    # -- control ------------------------------------------------------------------------------------------

    def fleet(self) -> dict[str, Any]:
        snap = self.view.snapshot
        runs = snap.runs()
        ready = snap.ready(self.config.max_lag)
        for run, info in runs.items():
            info["ready"] = sum(1 for r in ready if r.run == run)
        members = snap.describe(self.config.max_lag)
        for m in members:
            m["in_flight_here"] = self.view.in_flight.get(m["replica"], 0)
            m["suspect"] = m["replica"] in self.view.suspects
        at_head = sum(info["at_head"] for info in runs.values())
        age = self.view.age_s()
        return {
            "at": snap.at.isoformat(),
            "snapshot_age_s": None if age is None else round(age, 3),
            "error": self.view.error,
            "config": {
                "max_lag": self.config.max_lag,
                "hold_s": self.config.hold_s,
                "refresh_s": self.config.refresh_s,
            },
            "members": members,
            "runs": runs,
            "readiness": at_head / len(snap.members) if snap.members else None,
            "ready": len(ready),
            "rejected": [{"path": r.path, "reason": r.reason, "message": r.message} for r in snap.rejected],
        }

    def _control_app(self) -> FastAPI:
        app = FastAPI(title="flipsync gateway", lifespan=self._lifespan)

        @app.get("/flipsync/fleet")
        async def fleet() -> dict[str, Any]:
            return self.fleet()

        @app.get("/flipsync/health")
        async def health() -> Response:
            n = len(self.view.snapshot.ready(self.config.max_lag))
            return JSONResponse(
                {"ready": n, "members": len(self.view.snapshot.members), "error": self.view.error},
                status_code=200 if n else 503,
                headers=None if n else {"Retry-After": self.retry_after},
            )

        @app.get("/flipsync/wait")
        async def wait(
            min_version: int,
            timeout_s: float = 30.0,
            model: str | None = None,
            format: str | None = None,
            run: str | None = None,
        ) -> Response:
            if min_version < 0 or not timeout_s >= 0:
                return _error(
                    400, "min_version must be >= 0 and timeout_s a non-negative number", "invalid_request_error"
                )
            want = Want(min_version=min_version, model=model, served_format=format, run=run)
            deadline = time.monotonic() + min(timeout_s, 300.0)
            with self.view.holding():
                while True:
                    found = [r.version for r in self.view.candidates(want)[0] if satisfies(r.version, want)]
                    if found or time.monotonic() >= deadline:
                        break
                    await asyncio.sleep(0.05)
            best = max((v for v in found if v is not None), default=None)
            body = {"satisfied": bool(found), "version": best, "replicas": len(found), "min_version": min_version}
            return JSONResponse(
                body, status_code=200 if found else 408, headers=None if found else {"Retry-After": self.retry_after}
            )

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": self.view.models()}

        @app.get("/metrics")
        async def prometheus() -> Response:
            age = self.view.age_s()
            self.metrics.snapshot_age.set(-1 if age is None else age)
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

        return app


def create_gateway_app(
    pool: Pool, config: GatewayConfig | None = None
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The gateway's ASGI application (uvicorn serves it; its lifespan starts the fleet refresher)."""
    return Gateway(pool, config).app


async def _watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    """Set ``gone`` once the client disconnects (the request body was read already: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


def _netloc(url: str) -> bytes:
    return urlsplit(url).netloc.encode("ascii")


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes:
    for k, v in headers:
        if k.lower() == name:
            return v
    return b""


async def _read_all(resp: httpcore.Response) -> bytes:
    try:
        return b"".join([chunk async for chunk in resp.aiter_stream()])
    finally:
        await resp.aclose()


def _is_unreachable(body: bytes) -> bool:
    """A sidecar's 502 that says its engine is unreachable (another replica may be up)."""
    return b"upstream_unavailable" in body[:4096]


def _error(status: int, message: str, kind: str, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": status}, **extra}, status_code=status, headers=headers
    )
