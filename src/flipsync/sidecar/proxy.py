"""The version-aware, OpenAI-compatible proxy in front of one engine, and the sidecar's control API.
See docs/sidecar.md#the-proxy."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from flipsync.auth import ApiKeys, is_open, unauthorized
from flipsync.domain.requests import (
    BODY_FIELD,
    H_END,
    H_START,
    H_VERSION,
    BadRequest,
    encode,
    parse_constraint,
    read_json,
)
from flipsync.serving import NO_RETRY, error_response, sse_event
from flipsync.sidecar.load import LoadReader
from flipsync.sidecar.replica import Replica

log = logging.getLogger(__name__)

# What the metrics count a refusal of a gated request as, by its status.
_OUTCOMES = {400: "bad_request", 413: "bad_request", 415: "bad_request", 409: "rejected_version", 503: "unavailable"}
_OUTCOMES |= dict.fromkeys((502, 504), "upstream_error")
# Hop-by-hop headers (RFC 9110 7.6.1) and those the proxy recomputes.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "content-encoding",
        "accept-encoding",
    }
)


@dataclass(frozen=True)
class ProxyConfig:
    upstream_url: str
    connect_timeout_s: float = 5.0
    # The engine's longest silence while it streams (until its first byte, between two chunks). A non-streaming
    # answer comes whole at its end, so no read timeout bounds it: a long generation is never cut while the engine
    # is still generating it (as the gateway does; the engine's health is the replica's to watch).
    request_timeout_s: float = 600.0
    admit_timeout_s: float = 120.0  # how long a request waits at a closed gate (a keyframe reload)
    max_wait_s: float = 300.0  # cap of /flipsync/wait
    retry_after_s: int = 1
    max_body_bytes: int = 64 << 20
    api_keys: ApiKeys | None = None  # clients must send one of these (Authorization: Bearer); None: no check


_BAD_JSON = "upstream_invalid_response"
_TOO_DEEP_RESPONSE = (
    "the engine at {upstream} answered JSON nested too deeply to parse (about 1000 levels or more); "
    "check the engine and the request that produced it"
)


def _forward_headers(headers: Any) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k.lower() not in _HOP and not k.lower().startswith("x-flipsync-")}
    out["accept-encoding"] = "identity"  # relay bytes as they are; SSE is rewritten event by event
    return out


def _response_headers(headers: httpx.Headers) -> dict[str, str]:
    # The proxy's own server sets date and server.
    return {k: v for k, v in headers.items() if k.lower() not in _HOP and k.lower() not in ("date", "server")}


def _stamp_event(line: bytes, stamp: dict[str, int | None]) -> bytes:
    """Add ``weight_version`` to one SSE ``data:`` line holding a JSON object; anything else as it is."""
    if not line.startswith(b"data:") or not (payload := line[5:].strip()).startswith(b"{"):
        return line
    ending = b"\r\n" if line.endswith(b"\r\n") else b"\n" if line.endswith(b"\n") else b""
    try:
        doc = json.loads(payload)
        if not isinstance(doc, dict):
            return line
        doc[BODY_FIELD] = stamp
        return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + ending
    except ValueError:
        return line
    except RecursionError:  # the status line has gone out: say so in the stream, as for a broken-off engine
        msg = "the engine sent an event whose JSON nests too deeply to parse; check the engine"
        return sse_event({"error": {"message": msg, "type": _BAD_JSON}})


class StreamCut(Exception):
    """Raised by a stream's body once its upstream broke off: the response ends without its last chunk."""


def _is_cut(e: BaseException) -> bool:
    if isinstance(e, BaseExceptionGroup):  # Starlette runs the body in a task group on older ASGI servers
        return all(_is_cut(x) for x in e.exceptions)
    return isinstance(e, StreamCut)


class _ClosingStream(StreamingResponse):
    """A streaming response that always runs ``on_close`` (also when the client left before the first byte,
    when the body generator never starts), so a gate ticket or an upstream connection is never leaked. A body
    that raises `StreamCut` returns without completing the response: the server closes the connection with
    the chunked body unterminated (uvicorn logs that it did)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except BaseException as e:
            if not _is_cut(e):
                raise
        finally:
            await self._on_close()


def create_proxy_app(replica: Replica, config: ProxyConfig, *, load: LoadReader | None = None) -> FastAPI:
    """The sidecar's HTTP face: version-aware proxy to ``config.upstream_url`` plus control and metrics;
    ``load`` reads the engine's load for ``/flipsync/status``."""
    metrics = replica.metrics
    gate = replica.gate
    upstream = config.upstream_url.rstrip("/")
    retry_after = str(max(1, config.retry_after_s, math.ceil(replica.config.poll_interval_s)))
    clients: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        clients["upstream"] = httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            # Idle connections are let go before the engine's server would close them (uvicorn's keep-alive, which
            # vLLM and SGLang serve with, is 5 s): a connection closed as it is reused fails the request on it.
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64, keepalive_expiry=2.0),
        )
        try:
            yield
        finally:
            await clients.pop("upstream").aclose()

    app = FastAPI(title="flipsync sidecar", lifespan=lifespan)

    # -- control ------------------------------------------------------------------------------------------

    tokenizer: list[str | None] = []  # the engine's digest, asked once (vLLM's loads a tokenizer: off the loop)

    @app.get("/flipsync/status")
    async def status() -> dict[str, Any]:
        engine_load = None if load is None else await asyncio.to_thread(load.read)  # may scrape the engine
        if not tokenizer:
            tokenizer.append(await asyncio.to_thread(lambda: replica.engine.tokenizer_digest))
        return {
            **replica.status(),
            "tokenizer": tokenizer[0],
            "load": None if engine_load is None else engine_load.to_dict(),
            "proxy": {
                "upstream": upstream,
                "in_flight": gate.in_flight,
                "gate_open": gate.is_open,
                "draining": gate.draining,
            },
        }

    @app.get("/flipsync/health")
    async def health() -> Response:
        ok = replica.serving and not gate.draining
        return JSONResponse(
            {"serving": ok, "version": replica.version, "state": replica.state.value, "draining": gate.draining},
            status_code=200 if ok else 503,
            headers=None if ok else {"Retry-After": retry_after},
        )

    @app.get("/flipsync/wait")
    async def wait(min_version: int, timeout_s: float = 30.0) -> Response:
        if min_version < 0 or not timeout_s >= 0:
            return error_response(
                400, "min_version must be >= 0 and timeout_s a non-negative number", "invalid_request_error"
            )
        ok = await replica.wait_version_async(min_version, min(timeout_s, config.max_wait_s))
        body = {"satisfied": ok, "version": replica.version, "head": replica.head, "min_version": min_version}
        return JSONResponse(body, status_code=200 if ok else 408, headers=None if ok else {"Retry-After": retry_after})

    @app.post("/flipsync/sync", status_code=202)
    async def sync_now() -> dict[str, Any]:
        replica.wake()
        return {"version": replica.version, "state": replica.state.value}

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.in_flight.set(gate.in_flight)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # -- the proxy ----------------------------------------------------------------------------------------

    def refuse(status: int, message: str, kind: str, headers: dict[str, str] | None = None, **extra: Any) -> Response:
        """An error answer of the gated proxy, counted under the outcome its status means. A malformed request
        (400, 413, 415) is the same on a retry: ``x-should-retry: false`` tells the openai client so."""
        metrics.requests.labels(outcome=_OUTCOMES[status]).inc()
        if status in (400, 413, 415):
            headers = {**NO_RETRY, **(headers or {})}
        return error_response(status, message, kind, headers, **extra)

    async def send(
        request: Request,
        path: str,
        content: bytes,
        error: Callable[..., Response] = error_response,
        *,
        as_json: bool = False,
        whole: bool = False,
    ) -> httpx.Response | Response:
        """The upstream's streamed answer, or the ``error`` to answer instead when it cannot be reached.
        ``as_json``: ``content`` was re-encoded as UTF-8 JSON, and says so in its Content-Type. ``whole``: the
        answer comes in one piece at its end (not a stream), so no read timeout applies."""
        client, q = clients["upstream"], request.url.query
        url = f"{upstream}/{path}" + (f"?{q}" if q else "")
        headers = _forward_headers(request.headers)
        if as_json:
            headers = {k: v for k, v in headers.items() if k.lower() != "content-type"}
            headers["content-type"] = "application/json"
        timeout = httpx.Timeout(None, connect=config.connect_timeout_s) if whole else httpx.USE_CLIENT_DEFAULT
        again = True
        while True:
            req = client.build_request(request.method, url, headers=headers, content=content, timeout=timeout)
            try:
                return await client.send(req, stream=True)
            except httpx.TimeoutException as e:
                return error(504, f"the engine at {upstream} timed out: {e}", "upstream_timeout")
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
                failure: httpx.HTTPError = e
                if again:
                    # No answer began: most often a pooled connection the engine closed as it was reused (its
                    # keep-alive ran out). The request is sent once more, on a new connection.
                    again = False
                    log.info("the engine at %s dropped a connection before answering (%r); sending again", upstream, e)
                    continue
            except httpx.HTTPError as e:
                failure = e
            detail = f"{type(failure).__name__}: {failure}"
            return error(502, f"the engine at {upstream} is unreachable: {detail}", "upstream_unavailable")

    async def passthrough(request: Request, path: str) -> Response:
        resp = await send(request, path, await request.body())
        if isinstance(resp, Response):
            return resp
        headers = _response_headers(resp.headers)
        if replica.version is not None:
            headers[H_VERSION] = str(replica.version)
        return _ClosingStream(resp.aiter_raw(), resp.aclose, status_code=resp.status_code, headers=headers)

    async def gated(request: Request, path: str) -> Response:
        raw = await request.body()
        if len(raw) > config.max_body_bytes:
            return refuse(413, f"the body exceeds {config.max_body_bytes} bytes", "invalid_request_error")
        # Every body is read as JSON whatever its Content-Type says (engines parse it anyway, so a constraint
        # skipped here would be silently ignored); one that is not JSON is refused, never forwarded unchecked.
        try:
            parsed = read_json(
                raw, request.headers.get("content-type"), request.headers.get("content-encoding"), config.max_body_bytes
            )
            if parsed is not None and not isinstance(parsed.doc, dict):
                raise BadRequest(f"the body must be a JSON object, not {type(parsed.doc).__name__}")
            body = parsed.doc if parsed is not None else None
            field = body.pop(BODY_FIELD, None) if isinstance(body, dict) else None
            constraint = parse_constraint(field, request.headers)
            reencoded = parsed is not None and (field is not None or not parsed.as_sent)
            if reencoded:  # the engine reads the same JSON, as UTF-8 with a JSON Content-Type
                raw = encode(body)
        except BadRequest as e:
            return refuse(e.status, str(e), "invalid_request_error")

        def refusal() -> Response | None:
            if gate.draining:
                return refuse(
                    503,
                    "this replica is leaving the fleet (draining): send the request to another one",
                    "service_unavailable",
                    {"Retry-After": retry_after, "X-Flipsync-Draining": "1"},
                )
            current = replica.version
            if current is None or not replica.serving:
                why = replica.status()["error"]
                return refuse(
                    503,
                    "this replica holds no verified version right now"
                    + (f" ({why['kind']}: {why['message']})" if why else f" (state {replica.state.value})"),
                    "service_unavailable",
                    {"Retry-After": retry_after},
                )
            if not constraint.satisfied_by(current):
                # A replica's version only moves forward: an exact version it has passed never comes back here.
                passed = constraint.exact_version is not None and constraint.exact_version < current
                retry = NO_RETRY if passed else {"Retry-After": retry_after}
                return refuse(
                    409,
                    f"this replica serves v{current}; the request needs {constraint.describe()}",
                    "weight_version_unavailable",
                    {**retry, H_VERSION: str(current)},
                    weight_version={
                        "current": current,
                        "head": replica.head,
                        "min_version": constraint.min_version,
                        "exact_version": constraint.exact_version,
                    },
                )
            return None

        if (early := refusal()) is not None:
            return early
        if not await gate.enter(pinned=constraint.pinned, timeout=config.admit_timeout_s):
            return refuse(
                503, "an update is taking longer than expected", "service_unavailable", {"Retry-After": retry_after}
            )
        left = False

        def leave() -> None:
            nonlocal left
            if not left:
                left = True
                gate.leave(pinned=constraint.pinned)
                metrics.in_flight.set(gate.in_flight)

        try:
            metrics.in_flight.set(gate.in_flight)
            if (late := refusal()) is not None:  # a commit happened while it waited at the gate
                leave()
                return late
            start = replica.version
            whole = not (isinstance(body, dict) and body.get("stream") is True)
            resp = await send(request, path, raw, refuse, as_json=reencoded, whole=whole)
            if isinstance(resp, Response):
                leave()
                return resp
            out_headers = _response_headers(resp.headers)
            out_headers[H_START] = str(start)
            out_headers[H_VERSION] = str(start)
            if resp.headers.get("content-type", "").startswith("text/event-stream"):
                metrics.requests.labels(outcome="ok" if resp.status_code < 400 else "upstream_status").inc()

                async def close() -> None:
                    await resp.aclose()
                    leave()

                return _ClosingStream(
                    _relay_stream(resp, start), close, status_code=resp.status_code, headers=out_headers
                )
            try:
                data = await resp.aread()
            except httpx.HTTPError as e:
                return refuse(502, f"the engine at {upstream} broke off its response: {e}", "upstream_unavailable")
            finally:
                await resp.aclose()
                end = replica.version_upper_bound()
                leave()
            out_headers[H_END] = str(end)
            if resp.status_code < 400 and "json" in resp.headers.get("content-type", ""):
                try:
                    doc = json.loads(data)
                    if isinstance(doc, dict):
                        doc[BODY_FIELD] = {"start": start, "end": end}
                        data = json.dumps(doc).encode()
                except ValueError:
                    pass  # not JSON after all: relay it as it is
                except RecursionError:
                    return refuse(502, _TOO_DEEP_RESPONSE.format(upstream=upstream), _BAD_JSON)
            metrics.requests.labels(outcome="ok" if resp.status_code < 400 else "upstream_status").inc()
            return Response(data, status_code=resp.status_code, headers=out_headers)
        except BaseException:
            leave()
            raise

    async def _relay_stream(resp: httpx.Response, start: int | None) -> AsyncIterator[bytes]:
        buf = b""
        try:
            async for chunk in resp.aiter_bytes():
                buf += chunk
                cut = buf.rfind(b"\n") + 1
                if not cut:
                    continue
                lines, buf = buf[:cut], buf[cut:]
                stamp = {"start": start, "end": replica.version_upper_bound()}
                yield b"".join(_stamp_event(line, stamp) for line in lines.splitlines(keepends=True))
            if buf:
                yield _stamp_event(buf, {"start": start, "end": replica.version_upper_bound()})
        except httpx.HTTPError as e:
            # The status line (200) has gone out: say why in an error event, then cut the connection without the
            # chunked body's end, so that every client (aiohttp, httpx, openai) sees a failed response rather
            # than a short success.
            msg = f"the engine broke off the stream: {type(e).__name__}: {e}"
            log.warning("%s; cutting the client's stream", msg)
            yield sse_event({"error": {"message": msg, "type": "upstream_unavailable", "code": 502}})
            raise StreamCut(msg) from e

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def proxy(request: Request, path: str) -> Response:
        keys = config.api_keys
        if keys is not None and not is_open("/" + path) and not keys.allows(request.headers.get("authorization")):
            return unauthorized("authorization" in request.headers)  # the model API only: /flipsync/* stay open
        if request.method == "POST":
            return await gated(request, path)
        return await passthrough(request, path)

    return app
