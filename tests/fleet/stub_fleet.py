"""A gateway (in this process, on a thread) over stub replicas (`flipsync.fleet.stub_replica`), found as a
static pool: routing, affinity, ejection and the service's knobs tested without engines."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from flipsync.fleet.gateway import Gateway
from flipsync.fleet.pool import Pool, StaticPool
from flipsync.fleet.routing import GatewayConfig
from flipsync.fleet.stub_replica import StubReplica
from flipsync.serving import ServerThread


def poll(check: Callable[[], bool], timeout: float = 30.0, every: float = 0.02) -> bool:
    """Whether ``check`` came true within ``timeout`` seconds (generous: CI machines are loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every)
    return check()


@dataclass
class StubFleet:
    gateway: Gateway
    server: ServerThread
    client: httpx.Client
    stubs: list[StubReplica]

    @property
    def url(self) -> str:
        return self.server.url

    def replica_of(self, stub: StubReplica) -> str:
        return f"127.0.0.1-{stub.port}"

    def fleet(self) -> dict[str, Any]:
        return self.gateway.fleet()

    def ready(self) -> int:
        return int(self.fleet()["ready"])


@contextmanager
def stub_fleet(
    n: int = 4, *, stubs: list[StubReplica] | None = None, pool: Pool | None = None, **config: Any
) -> Iterator[StubFleet]:
    """A gateway over ``n`` new stubs (or ``stubs``; or over ``pool``), once it sees them all ready."""
    made = stubs if stubs is not None else [StubReplica() for _ in range(n)]
    for s in made:
        if not s.port:  # not started yet
            s.start()
    pool = pool if pool is not None else StaticPool([s.url for s in made], timeout_s=5.0)
    cfg = GatewayConfig(**{"refresh_s": 0.1, "held_refresh_s": 0.05, "hold_s": 3.0, **config})
    gateway = Gateway(pool, cfg)
    server = ServerThread(gateway.app).start()
    client = httpx.Client(base_url=server.url, timeout=60.0)
    fleet = StubFleet(gateway, server, client, made)
    try:
        assert poll(lambda: fleet.ready() == max(1, len(made))), fleet.fleet()
        yield fleet
    finally:
        client.close()
        server.stop()
        pool.close()
        for s in made:
            s.stop()
