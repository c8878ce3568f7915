"""Prometheus metrics of one gateway, in its own ``CollectorRegistry`` (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from flipsync.board.membership import REASONS

OUTCOMES = ("ok", "upstream_status", "rejected_version", "unavailable", "bad_request", "stream_cut", "timeout")
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
        # Bound once: a label lookup on every request costs more than the count.
        self._outcomes = {o: self.requests.labels(outcome=o) for o in OUTCOMES}
        self._retries = {r: self.retries.labels(reason=r) for r in RETRY_REASONS}

    def outcome(self, outcome: str) -> None:
        self._outcomes[outcome].inc()

    def retry(self, reason: str) -> None:
        self._retries[reason].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
