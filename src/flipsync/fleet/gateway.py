"""The gateway: one OpenAI-compatible front door for a whole fleet, routing every request by policy version.

It keeps no state beyond the pool's last snapshot and its own in-flight counts, so several can run behind one
load balancer. Routing, retries, holds and headers: see docs/fleet.md#the-gateway.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpcore
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from flipsync.domain.fleet import MemberRecord, Want, floor_version, satisfies, serves
from flipsync.fleet.forwarding import (
    DROP_REQUEST_HEADERS,
    DROP_RESPONSE_HEADERS,
    H_ATTEMPTS,
    H_FLEET_HEAD,
    H_FORMAT,
    H_REPLICA,
    H_RUN,
    ForwardRequest,
    Retry,
    header_value,
    is_engine_unreachable,
    netloc,
    read_all,
    watch_disconnect,
)
from flipsync.fleet.metrics import GatewayMetrics
from flipsync.fleet.pool import FleetSnapshot, Pool
from flipsync.fleet.routing import FleetView, GatewayConfig
from flipsync.fleet.transport import AsyncioBackend
from flipsync.serving import error_response
from flipsync.sidecar.proxy import BODY_FIELD, H_MIN, BadRequest, parse_constraint


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

    async def _read(self, scope: Scope, receive: Receive) -> ForwardRequest | Response:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return error_response(499, "the client went away", "client_closed")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.config.max_body_bytes:
                return error_response(
                    413, f"the body exceeds {self.config.max_body_bytes} bytes", "invalid_request_error"
                )
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
                return error_response(
                    400, "the JSON body nests too deeply to parse; send a flatter body", "invalid_request_error"
                )
        try:
            field = doc.get(BODY_FIELD) if isinstance(doc, dict) else None
            constraint = parse_constraint(field, named)
        except BadRequest as e:
            return error_response(400, str(e), "invalid_request_error")
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
        forwarded = [(k, v) for k, v in headers if k not in DROP_REQUEST_HEADERS]
        query = scope.get("query_string", b"")
        path = scope["path"] + (f"?{query.decode('latin-1')}" if query else "")
        return ForwardRequest(path, forwarded, body, want)

    async def _serve(self, req: ForwardRequest, scope: Scope, receive: Receive, send: Send, t0: float) -> None:
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
            await error_response(504, f"the replica did not answer in time: {e}", "upstream_timeout")(
                scope, receive, send
            )
            return
        await self._refuse(req, last, scope, receive, send)

    async def _pass(self, req: ForwardRequest, attempts: list[int], send: Send, t0: float) -> Retry | bool | None:
        """Try every replica that may serve ``req`` once, best first: True once one answered, else the last
        refusal (None: no replica to try)."""
        candidates, snap = self.view.candidates(req.want)
        last: Retry | None = None
        for r in candidates:
            attempts[0] += 1
            try:
                await self._attempt(r, snap, req, attempts[0], send, t0)
            except Retry as e:
                last = e
                self.metrics.retry(e.reason)
                continue
            return True
        return last

    async def _attempt(
        self,
        r: MemberRecord,
        snap: FleetSnapshot,
        req: ForwardRequest,
        attempt: int,
        send: Send,
        t0: float,
    ) -> None:
        """Send ``req`` to ``r`` and relay its answer; raise Retry where another replica may serve it."""
        assert self.http is not None
        head = snap.head(r)
        headers = [(b"host", netloc(r.url)), (b"content-length", str(len(req.body)).encode()), *req.headers]
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
                raise Retry("unreachable") from e
            except (httpcore.ReadTimeout, httpcore.WriteTimeout, httpcore.PoolTimeout):
                raise
            except (httpcore.NetworkError, httpcore.RemoteProtocolError) as e:  # dropped before it answered
                raise Retry("broken") from e
            status = resp.status
            is_stream = header_value(resp.headers, b"content-type").startswith(b"text/event-stream")
            if status in (409, 503, 502) and not is_stream:
                try:
                    body = await read_all(resp)
                except (httpcore.NetworkError, httpcore.RemoteProtocolError) as e:
                    raise Retry("broken") from e
                if status == 409 or status == 503 or is_engine_unreachable(body):
                    raise Retry({409: "refused_409", 503: "refused_503"}.get(status, "upstream_502"), status, body)
                await self._answer(resp.status, resp.headers, body, r, head, attempt, send)
                self.metrics.outcome("upstream_status")
                return
            if is_stream:
                await self._relay_stream(resp, r, head, attempt, send, t0, req.receive)
                return
            try:
                body = await read_all(resp)
            except (httpcore.NetworkError, httpcore.RemoteProtocolError) as e:  # died mid-answer: nothing sent yet
                view.unreachable(r)
                raise Retry("broken") from e
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
        out = [(k, v) for k, v in upstream if k.lower() not in DROP_RESPONSE_HEADERS]
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
                raise Retry("broken") from e
            self.metrics.request_seconds.observe(time.monotonic() - t0)
            headers = self._headers(resp.headers, r, head, attempt)
            await send({"type": "http.response.start", "status": resp.status, "headers": headers})
            await send({"type": "http.response.body", "body": first, "more_body": True})
            outcome = "ok" if resp.status < 400 else "upstream_status"
            gone = asyncio.Event()
            watcher = asyncio.create_task(watch_disconnect(receive, gone)) if receive is not None else None
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

    async def _refuse(
        self, req: ForwardRequest, last: Retry | None, scope: Scope, receive: Receive, send: Send
    ) -> None:
        want = req.want
        snap = self.view.snapshot
        mine = [r for r in snap.members if serves(r, want)]
        versions = sorted({r.version for r in mine if r.serving and not r.draining and r.version is not None})
        heads = sorted({h for r in mine if (h := snap.head(r)) is not None})
        headers = {"Retry-After": self.retry_after}
        if want.constrained:
            self.metrics.outcome("rejected_version")
            served = ", ".join(f"v{v}" for v in versions) or "none"
            response = error_response(
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
            response = error_response(
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
                return error_response(
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
