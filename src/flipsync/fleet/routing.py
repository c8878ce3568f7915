"""The gateway's routing state: its settings and its view of the fleet, from which it picks the replicas that may
serve a request, best first (docs/fleet.md#the-gateway)."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from flipsync.auth import ApiKeys
from flipsync.board.membership import REASONS
from flipsync.domain.fleet import MemberRecord, Want, admits, rank
from flipsync.errors import FlipsyncError
from flipsync.fleet.affinity import AffinityPolicy
from flipsync.fleet.ejection import EjectionPolicy
from flipsync.fleet.metrics import GatewayMetrics
from flipsync.fleet.pool import FleetSnapshot, Pool

log = logging.getLogger(__name__)


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
    # The longest silence of a replica while it streams (until its first byte, between two chunks). A non-streaming
    # answer comes whole at its end, so its wait is bounded by total_timeout_s only (TCP keepalive notices a dead
    # host meanwhile): a long generation is never cut while the replica is still generating it.
    request_timeout_s: float = 600.0
    total_timeout_s: float | None = None  # a request's whole time, streams included (None: unbounded)
    max_body_bytes: int = 64 << 20
    retry_after_s: int = 1
    suspect_s: float = 30.0  # a replica that refused a connection: skipped until it writes again (at most this)
    max_connections: int = 4096  # requests in flight to all replicas together (each holds a connection)
    affinity: AffinityPolicy = field(default_factory=AffinityPolicy)
    ejection: EjectionPolicy = field(default_factory=EjectionPolicy)
    api_keys: ApiKeys | None = None  # clients must send one (Authorization: Bearer); None: no check
    replica_api_key: str | None = None  # sent to the replicas instead of the client's Authorization
    drain_timeout_s: float = 30.0  # on SIGTERM, the longest wait for the requests in flight


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
            snapshot = self.pool.discover_replicas().one_tokenizer_per_model()
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
