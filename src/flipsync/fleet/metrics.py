"""Prometheus metrics of one gateway, in its own ``CollectorRegistry`` (no process-global state)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from flipsync.board.membership import REASONS

OUTCOMES = (
    "ok",
    "upstream_status",
    "rejected_version",
    "unavailable",
    "bad_request",
    "not_found",
    "stream_cut",
    "timeout",
)
RETRY_REASONS = ("unreachable", "broken", "refused_409", "refused_503", "upstream_502")
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    """Everything ``GET /metrics`` of a gateway reports; the fleet gauges are set from each snapshot."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("flipsync_gateway_requests", "Requests answered, by outcome", ["outcome"], registry=r)
        self.retries = Counter(
            "flipsync_gateway_retries", "Attempts sent to another replica, by why", ["reason"], registry=r
        )
        self.in_flight = Gauge("flipsync_gateway_in_flight", "Requests in flight through this gateway", registry=r)
        self.held_seconds = Histogram(
            "flipsync_gateway_held_seconds",
            "Time a request waited for a replica that could serve it",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "flipsync_gateway_request_seconds",
            "Time to the response's first byte (all attempts)",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.members = Gauge("flipsync_gateway_members", "Live member records, by run", ["run"], registry=r)
        self.ready = Gauge(
            "flipsync_gateway_ready_members", "Members ready for unconstrained traffic, by run", ["run"], registry=r
        )
        self.readiness = Gauge(
            "flipsync_gateway_readiness", "Fraction of live members at HEAD, by run (-1: none)", ["run"], registry=r
        )
        self.head = Gauge("flipsync_gateway_head_version", "The board's HEAD, by run (-1: none)", ["run"], registry=r)
        self.rejected = Gauge(
            "flipsync_gateway_rejected_records",
            "Member records refused at the last scan, by reason",
            ["reason"],
            registry=r,
        )
        self.refresh_failures = Counter(
            "flipsync_gateway_refresh_failures", "Scans of the pool that failed (the last good one is used)", registry=r
        )
        self.snapshot_age = Gauge(
            "flipsync_gateway_snapshot_age_seconds", "Age of the fleet snapshot routing uses", registry=r
        )
        for reason in REASONS:
            self.rejected.labels(reason=reason).set(0)
        # Per replica (labelled by replica id; a replica that leaves the fleet is forgotten, see ``forget``).
        self.replica_requests = Counter(
            "flipsync_gateway_replica_requests", "Attempts sent to each replica", ["replica"], registry=r
        )
        self.replica_errors = Counter(
            "flipsync_gateway_replica_errors",
            "Failed attempts at each replica (502, 503 other than a drain, connection refused or dropped, a cut "
            "stream), by reason",
            ["replica", "reason"],
            registry=r,
        )
        self.replica_ttfb = Histogram(
            "flipsync_gateway_replica_first_byte_seconds",
            "Time from sending an attempt to its response's first byte, per replica",
            ["replica"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.replica_ejections = Counter(
            "flipsync_gateway_replica_ejections", "Times each replica was ejected", ["replica"], registry=r
        )
        self.replica_ejected = Gauge(
            "flipsync_gateway_replica_ejected", "1 while a replica is out of rotation here", ["replica"], registry=r
        )
        self.affinity = Counter(
            "flipsync_gateway_affinity",
            "Requests by what affinity did: hit (its replica), new (hashed), moved (its replica left), spilled "
            "(its replica full), none (no session or prompt to key on)",
            ["outcome"],
            registry=r,
        )
        self._replicas: dict[str, ReplicaMetrics] = {}
        self._affinity = {o: self.affinity.labels(outcome=o) for o in ("hit", "new", "moved", "spilled", "none")}
        self.draining = Gauge("flipsync_gateway_draining", "1 once the gateway drains (SIGTERM)", registry=r)
        # Bound once: a label lookup on every request costs more than the count.
        self._outcomes = {o: self.requests.labels(outcome=o) for o in OUTCOMES}
        self._retries = {r: self.retries.labels(reason=r) for r in RETRY_REASONS}

    def outcome(self, outcome: str) -> None:
        self._outcomes[outcome].inc()

    def retry(self, reason: str) -> None:
        self._retries[reason].inc()

    def affinity_outcome(self, outcome: str) -> None:
        self._affinity[outcome].inc()

    def replica(self, replica: str) -> ReplicaMetrics:
        m = self._replicas.get(replica)
        if m is None:
            m = self._replicas[replica] = ReplicaMetrics(self, replica)
        return m

    def forget(self, keep: set[str]) -> None:
        """Drop the series of replicas no longer in the fleet (ids come and go with autoscaling)."""
        for replica in [k for k in self._replicas if k not in keep]:
            gone = self._replicas.pop(replica)
            for metric in (self.replica_requests, self.replica_ttfb, self.replica_ejections, self.replica_ejected):
                with contextlib.suppress(KeyError):
                    metric.remove(replica)
            for reason in gone.reasons():
                with contextlib.suppress(KeyError):
                    self.replica_errors.remove(replica, reason)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ReplicaMetrics:
    """One replica's series, bound once (its errors by reason bound when first seen)."""

    def __init__(self, metrics: GatewayMetrics, replica: str) -> None:
        self._metrics = metrics
        self.replica = replica
        self.requests = metrics.replica_requests.labels(replica=replica)
        self.ttfb = metrics.replica_ttfb.labels(replica=replica)
        self.ejections = metrics.replica_ejections.labels(replica=replica)
        self.ejected = metrics.replica_ejected.labels(replica=replica)
        self._errors: dict[str, Counter] = {}

    def reasons(self) -> list[str]:
        return list(self._errors)

    def errors(self, reason: str) -> None:
        c = self._errors.get(reason)
        if c is None:
            c = self._errors[reason] = self._metrics.replica_errors.labels(replica=self.replica, reason=reason)
        c.inc()
