"""The HTTP pieces of forwarding a request to a replica: headers, the client's request, the retry signal."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpcore
from starlette.types import Receive

from flipsync.domain.fleet import Want

H_FORMAT = "x-flipsync-format"
H_RUN = "x-flipsync-run"
H_REPLICA = "x-flipsync-replica"
H_FLEET_HEAD = "x-flipsync-fleet-head"
H_ATTEMPTS = "x-flipsync-attempts"
# Hop-by-hop headers (RFC 9110 7.6.1), those recomputed here, and the gateway's own.
DROP_REQUEST_HEADERS = frozenset(
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
DROP_RESPONSE_HEADERS = frozenset(
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


class Retry(Exception):
    """One attempt that another replica may do better: ``reason`` (a metric label) and the refusal, if any."""

    def __init__(self, reason: str, status: int | None = None, body: bytes = b"", *, draining: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.body = body
        self.draining = draining  # a 503 from a replica leaving on purpose: no mark against its health


@dataclass
class ForwardRequest:
    path: str  # with the query string
    headers: list[tuple[bytes, bytes]]
    body: bytes
    want: Want
    receive: Receive | None = None  # the client's channel, to see it go away mid-stream
    affinity: str | None = None  # what ties it to a replica (a session, a GRPO group): domain.balance.affinity_key
    stream: bool = False  # it asked for a stream ("stream": true)
    deadline: float | None = None  # monotonic time its total timeout ends (None: unbounded)
    cut: bool = False  # its stream was cut after the first byte (a mark against the replica's health)


async def watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    """Set ``gone`` once the client disconnects (the request body was read already: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


def netloc(url: str) -> bytes:
    return urlsplit(url).netloc.encode("ascii")


def header_value(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes:
    for k, v in headers:
        if k.lower() == name:
            return v
    return b""


async def read_all(resp: httpcore.Response) -> bytes:
    try:
        return b"".join([chunk async for chunk in resp.aiter_stream()])
    finally:
        await resp.aclose()


def is_engine_unreachable(body: bytes) -> bool:
    """A sidecar's 502 that says its engine is unreachable (another replica may be up)."""
    return b"upstream_unavailable" in body[:4096]
