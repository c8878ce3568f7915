"""The gateway: one OpenAI-compatible front door for a whole fleet, routing every request by policy version.

It keeps no state beyond the pool's last snapshot and its own in-flight counts, so several can run behind one
load balancer. Routing, retries, holds and headers: see docs/fleet.md#the-gateway.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpcore
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from flipsync.auth import is_open, unauthorized
from flipsync.domain.balance import affinity_key, prompt_opening
from flipsync.domain.fleet import MemberRecord, Want, floor_version, satisfies, serves
from flipsync.domain.requests import BODY_FIELD, H_MIN, BadRequest, encode, parse_constraint, read_json
from flipsync.fleet.affinity import Affinity
from flipsync.fleet.ejection import Admission, Ejector
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
from flipsync.fleet.transport import ReplicaConnections
from flipsync.serving import NO_RETRY, error_response, sse_event

log = logging.getLogger(__name__)

H_SESSION = "x-flipsync-session"
# TCP keepalive on the connections to replicas: a non-streaming request has no read timeout (its answer comes
# whole at the end), so a replica's host that vanished is noticed this way (in about a minute) instead.
_KEEPALIVE: list[tuple[int, int, int]] = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
for _name, _value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
    if hasattr(socket, _name):
        _KEEPALIVE.append((socket.IPPROTO_TCP, getattr(socket, _name), _value))


def _not_found(message: str) -> Response:
    """vLLM's answer to a model it does not serve (``NotFoundError``), which no retry changes."""
    return JSONResponse(
        {"error": {"message": message, "type": "NotFoundError", "param": "model", "code": 404}},
        status_code=404,
        headers=NO_RETRY,
    )


class Gateway:
    """The gateway over ``pool``, an ASGI application (serve it with uvicorn)."""

    def __init__(self, pool: Pool, config: GatewayConfig | None = None) -> None:
        self.pool = pool
        self.config = config or GatewayConfig()
        self.metrics = GatewayMetrics()
        self.view = FleetView(pool, self.config, self.metrics)
        self.http: ReplicaConnections | None = None
        self.control = self._control_app()
        self.retry_after = str(max(1, self.config.retry_after_s))
        self._timeouts: dict[str, float | None] = {
            "connect": self.config.connect_timeout_s,
            "read": self.config.request_timeout_s,
            "write": self.config.request_timeout_s,
            "pool": self.config.request_timeout_s,
        }
        # A non-streaming answer comes whole at its end: no read timeout, or a long generation would be cut.
        self._whole_timeouts = {**self._timeouts, "read": None}
        self.affinity = Affinity(self.config.affinity)
        self.ejector = Ejector(self.config.ejection, self.metrics)
        key = self.config.replica_api_key
        self._replica_auth = None if key is None else (b"authorization", f"Bearer {key}".encode())
        self.active = 0  # requests in flight through this gateway (a drain waits for 0)
        self.draining = False
        self._pruned: FleetSnapshot | None = None

    # -- ASGI ---------------------------------------------------------------------------------------------

    @property
    def app(self) -> Gateway:
        """The ASGI application: the gateway itself."""
        return self

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        keys = self.config.api_keys
        if keys is not None and scope["type"] == "http" and not is_open(scope["path"]):
            auth = next((v for k, v in scope["headers"] if k.lower() == b"authorization"), None)
            if not keys.allows(auth):
                await unauthorized(auth is not None)(scope, receive, send)
                return
        if scope["type"] == "http" and scope["method"] == "POST" and not scope["path"].startswith("/flipsync/"):
            await self._route(scope, receive, send)
            return
        await self.control(scope, receive, send)

    @asynccontextmanager
    async def _lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        self.http = ReplicaConnections(self.config.max_connections, socket_options=_KEEPALIVE)
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
        self.active += 1
        try:
            request = await self._read(scope, receive)
            if isinstance(request, Response):
                self.metrics.outcome("bad_request")
                await request(scope, receive, send)
                return
            request.receive = receive
            if self.config.total_timeout_s is not None:
                request.deadline = t0 + self.config.total_timeout_s
            await self._serve(request, scope, receive, send, t0)
        finally:
            self.active -= 1
            self.metrics.in_flight.dec()

    def _traits(self, doc: Any, named: dict[str, str]) -> dict[str, Any]:
        """What routing reads of a request beyond its constraint: its affinity key and whether it streams."""
        if not isinstance(doc, dict):
            return {"affinity": affinity_key(named.get(H_SESSION), None, None)}
        opening = prompt_opening(doc, self.config.affinity.prefix_chars) if self.config.affinity.enabled else None
        return {
            "affinity": affinity_key(named.get(H_SESSION), doc.get("user"), opening),
            "stream": doc.get("stream") is True,
        }

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
                    413, f"the body exceeds {self.config.max_body_bytes} bytes", "invalid_request_error", NO_RETRY
                )
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        headers = [(k.lower(), v) for k, v in scope["headers"]]
        named = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
        # The body is read as JSON whatever its Content-Type says, as a sidecar reads it (docs/fleet.md#the-gateway):
        # a constraint in it is never skipped, and a body that is not JSON is refused here.
        try:
            parsed = read_json(
                body, named.get("content-type"), named.get("content-encoding"), self.config.max_body_bytes
            )
            doc: Any = parsed.doc if parsed is not None else None
            if parsed is not None and not isinstance(doc, dict):
                raise BadRequest(f"the body must be a JSON object, not {type(doc).__name__}")
            field = doc.get(BODY_FIELD) if isinstance(doc, dict) else None
            constraint = parse_constraint(field, named)
            model = doc.get("model") if isinstance(doc, dict) else None
            if model is not None and not isinstance(model, str):
                raise BadRequest(
                    f"model must be a string naming a served model, not {type(model).__name__} "
                    f"(served: {', '.join(sorted({r.model for r in self.view.snapshot.members})) or 'none yet'})"
                )
        except BadRequest as e:
            return error_response(e.status, str(e), "invalid_request_error", NO_RETRY)
        reencode = parsed is not None and not parsed.as_sent
        fmt = named.get(H_FORMAT) or None
        if isinstance(model, str) and "@" in model:  # NAME@FORMAT: one served format of the model
            model, _, fmt = model.rpartition("@")
            assert isinstance(doc, dict)
            doc["model"] = model
            reencode = True
        if reencode:  # what the replica reads the same way: UTF-8 JSON with a JSON Content-Type
            body = encode(doc)
            headers = [(k, v) for k, v in headers if k not in (b"content-type", b"content-encoding")]
            headers.append((b"content-type", b"application/json"))
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
        return ForwardRequest(path, forwarded, body, want, **self._traits(doc, named))

    async def _serve(self, req: ForwardRequest, scope: Scope, receive: Receive, send: Send, t0: float) -> None:
        attempts = [0]
        try:
            last = await self._pass(req, attempts, send, t0)
            if last is True:
                return
            if last is None and (missing := self._not_served(req.want)) is not None:
                self.metrics.outcome("not_found")  # no hold can change it: a 404 at once, as vLLM answers
                await missing(scope, receive, send)
                return
            held_since = time.monotonic()
            deadline = t0 + self.config.hold_s if req.deadline is None else min(t0 + self.config.hold_s, req.deadline)
            with self.view.holding():  # wait for the fleet to change: a replica catching up, or joining
                while (left := deadline - time.monotonic()) > 0:
                    await asyncio.sleep(min(0.1, left))
                    outcome = await self._pass(req, attempts, send, t0)
                    if outcome is True:
                        self.metrics.held_seconds.observe(time.monotonic() - held_since)
                        return
                    last = outcome or last
            self.metrics.held_seconds.observe(time.monotonic() - held_since)
        except (httpcore.TimeoutException, TimeoutError) as e:  # silent too long, or past the total timeout
            self.metrics.outcome("timeout")
            await error_response(504, f"the replica did not answer in time: {e}", "upstream_timeout")(
                scope, receive, send
            )
            return
        await self._refuse(req, last, scope, receive, send)

    def _not_served(self, want: Want) -> Response | None:
        """A 404 when no live replica serves what the request names (its model, format or run), naming what the
        fleet serves; None when one does (then the request holds) or when the fleet is empty or unread (replicas
        may be booting: a hold, then 503)."""
        members = self.view.snapshot.members
        if not members:
            return None
        models = sorted({r.model for r in members})
        if want.model is not None and want.model not in models:
            return _not_found(f"The model `{want.model}` does not exist. This fleet serves: {', '.join(models)}.")
        mine = [r for r in members if want.model is None or r.model == want.model]
        of = f"model `{want.model}`" if want.model is not None else "any model"
        if want.served_format is not None:
            formats = sorted({r.served_format for r in mine})
            mine = [r for r in mine if r.served_format.lower() == want.served_format.lower()]
            if not mine:
                return _not_found(
                    f"No replica serves {of} in format {want.served_format}. Formats served: {', '.join(formats)} "
                    f"(ask for NAME@FORMAT or X-Flipsync-Format)."
                )
        if want.run is not None and not any(r.run == want.run for r in mine):
            runs = sorted({r.run for r in mine})
            return _not_found(f"No replica of run {want.run} serves {of}. Runs served: {', '.join(runs)}.")
        return None

    async def _pass(self, req: ForwardRequest, attempts: list[int], send: Send, t0: float) -> Retry | bool | None:
        """Try every replica that may serve ``req`` once, best first: True once one answered, else the last
        refusal (None: no replica to try)."""
        candidates, snap = self.view.candidates(req.want)
        if snap is not self._pruned:  # a new snapshot: forget the replicas that left (health, metrics, connections)
            self._prune(snap)
        ejector = self.ejector
        healthy = [r for r in candidates if not ejector.ejected(r.replica)]
        # Every one ejected (a fleet of one, or a burst that failed them all): try them all the same, as Envoy's
        # panic mode does, rather than refuse what one of them may serve.
        panic = not healthy and bool(candidates)
        candidates, outcome = self.affinity.order(req.affinity, candidates if panic else healthy, self.view.in_flight)
        if attempts[0] == 0 and candidates:
            self.metrics.affinity_outcome(outcome)
        last: Retry | None = None
        for r in candidates:
            # one probe at a time for a replica back from its backoff
            admission = Admission.PANIC if panic else ejector.admit(r.replica)
            if admission is Admission.SKIP:
                continue
            attempts[0] += 1
            try:
                await self._attempt(r, snap, req, attempts[0], send, t0)
            except Retry as e:
                last = e
                self.metrics.retry(e.reason)
                ejector.failed(r.replica, "draining" if e.draining else e.reason, admission)
                continue
            except BaseException:
                ejector.failed(r.replica, "abandoned", admission)  # a timeout or a cancel: the probe slot frees
                raise
            if req.cut:
                ejector.failed(r.replica, "stream_cut", admission)
            else:
                ejector.succeeded(r.replica, admission)
            self.affinity.served(req.affinity, r.replica)
            return True
        return last

    def _prune(self, snap: FleetSnapshot) -> None:
        self._pruned = snap
        keep = {r.replica for r in snap.members} | set(self.view.in_flight)
        self.ejector.forget(keep)
        self.metrics.forget(keep)
        if self.http is not None:
            self.http.forget([r.url for r in snap.members])

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
        forwarded = req.headers
        if self._replica_auth is not None:  # the gateway's own key, not the client's (a gateway key)
            forwarded = [h for h in forwarded if h[0] != b"authorization"] + [self._replica_auth]
        headers = [(b"host", netloc(r.url)), (b"content-length", str(len(req.body)).encode()), *forwarded]
        floor = floor_version(req.want, head, self.config.max_lag)
        if floor is not None:
            headers.append((H_MIN.encode(), str(floor).encode()))
        upstream = httpcore.Request(
            b"POST",
            r.url.rstrip("/") + req.path,
            headers=headers,
            content=req.body,
            extensions={"timeout": self._attempt_timeouts(req)},
        )
        view = self.view
        view.in_flight[r.replica] = view.in_flight.get(r.replica, 0) + 1
        rm = self.metrics.replica(r.replica)
        rm.requests.inc()
        sent = time.monotonic()
        try:
            try:
                resp = await self.http.handle_async_request(upstream)
                rm.ttfb.observe(time.monotonic() - sent)
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
                    draining = status == 503 and header_value(resp.headers, b"x-flipsync-draining") == b"1"
                    reason = {409: "refused_409", 503: "refused_503"}.get(status, "upstream_502")
                    raise Retry(reason, status, body, draining=draining)
                await self._answer(resp.status, resp.headers, body, r, head, attempt, send)
                self.metrics.outcome("upstream_status")
                return
            if is_stream:
                await self._relay_stream(resp, r, head, attempt, send, t0, req.receive, req=req)
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

    def _attempt_timeouts(self, req: ForwardRequest) -> dict[str, float | None]:
        """httpcore's timeouts for one attempt: a stream's read timeout bounds each silence; a whole answer has
        none; what is left of a total timeout bounds both."""
        timeouts = self._timeouts if req.stream else self._whole_timeouts
        if req.deadline is None:
            return timeouts
        left = req.deadline - time.monotonic()
        if left <= 0:
            raise httpcore.ReadTimeout(f"the total timeout of {self.config.total_timeout_s:g} s has passed")
        return {k: left if v is None else min(v, left) for k, v in timeouts.items()}

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
        *,
        req: ForwardRequest | None = None,
    ) -> None:
        stream = resp.aiter_stream()
        deadline = None if req is None else req.deadline
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
                    if deadline is not None and time.monotonic() > deadline:
                        raise httpcore.ReadTimeout(f"past the total timeout of {self.config.total_timeout_s:g} s")
            except (httpcore.NetworkError, httpcore.RemoteProtocolError, httpcore.TimeoutException) as e:
                # The status line (200) has gone out and the tokens sent cannot be taken back: say why in an
                # error event, then return without the chunked body's last chunk, so that uvicorn closes the
                # connection mid-body and every client (aiohttp, httpx, openai) sees a failed response, not a
                # short success (docs/fleet.md#the-gateway).
                past = deadline is not None and time.monotonic() > deadline  # the gateway's own total timeout
                if past:
                    self.metrics.outcome("timeout")
                    msg = f"the stream from replica {r.replica} ran past the total timeout: {e}"
                    err = {"error": {"message": msg, "type": "upstream_timeout", "code": 504}}
                else:
                    self.view.unreachable(r)
                    self.metrics.outcome("stream_cut")
                    if req is not None:
                        req.cut = True  # a mark against the replica's health (ejection)
                    msg = f"replica {r.replica} broke off the stream: {type(e).__name__}: {e}"
                    err = {"error": {"message": msg, "type": "upstream_unavailable", "code": 502}}
                log.warning("%s; cutting the client's stream", msg)
                await send({"type": "http.response.body", "body": sse_event(err), "more_body": True})
                return
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
        # The gateway has held the request already: a retry at once would only hold again (the openai client
        # would triple the wait), so x-should-retry says no, and Retry-After when to ask again.
        headers = {**NO_RETRY, "Retry-After": self.retry_after}
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

    def ready_replicas(self) -> int:
        """Replicas that could take an unconstrained request now: ready, not draining, not ejected here."""
        ready = self.view.snapshot.ready(self.config.max_lag)
        return sum(1 for r in ready if not self.ejector.ejected(r.replica))

    def drain(self, timeout_s: float | None = None) -> bool:
        """Leave (SIGTERM): ``/readyz`` answers 503 at once, so load balancers stop sending; requests that still
        arrive are served, and this returns once none is in flight (True) or after ``timeout_s`` (False). Call
        it from a thread other than the server's (``serve_until_signal``'s ``before_exit`` does)."""
        timeout_s = self.config.drain_timeout_s if timeout_s is None else timeout_s
        self.draining = True
        self.metrics.draining.set(1)
        n = self.active
        log.info("draining: /readyz answers 503; waiting for %d request(s) in flight (at most %g s)", n, timeout_s)
        done = _drain_wait(self, timeout_s)
        if not done:
            log.warning("%d request(s) still in flight after %g s of draining; leaving anyway", self.active, timeout_s)
        return done

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
            m["health"] = self.ejector.describe(m["replica"])
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
                "affinity": self.config.affinity.enabled,
                "auth": self.config.api_keys is not None,
            },
            "draining": self.draining,
            "in_flight": self.active,
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

        @app.get("/livez")
        async def livez() -> Response:
            return JSONResponse({"live": True, "draining": self.draining})  # 200 while the process serves

        @app.get("/readyz")
        async def readyz() -> Response:
            n = self.ready_replicas()
            ok = n > 0 and not self.draining
            return JSONResponse(
                {"ready": ok, "ready_replicas": n, "draining": self.draining, "error": self.view.error},
                status_code=200 if ok else 503,
                headers=None if ok else {"Retry-After": self.retry_after},
            )

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


def _drain_wait(gateway: Gateway, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while gateway.active > 0:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def create_gateway_app(
    pool: Pool, config: GatewayConfig | None = None
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """The gateway's ASGI application (uvicorn serves it; its lifespan starts the fleet refresher)."""
    return Gateway(pool, config).app
