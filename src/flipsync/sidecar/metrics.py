"""Prometheus metrics of one sidecar, in its own ``CollectorRegistry`` (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, generate_latest

from flipsync.sidecar.records import State

# From sub-millisecond scatters of tiny patches to full reloads of large models.
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class SidecarMetrics:
    """Everything ``GET /metrics`` of a sidecar reports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.version = Gauge("flipsync_version", "Board version the engine holds, verified (-1: none)", registry=r)
        self.head = Gauge(
            "flipsync_head_version", "Newest version on the board when last polled (-1: none)", registry=r
        )
        self.lag = Gauge("flipsync_lag_versions", "HEAD minus the version held", registry=r)
        self.state = Enum("flipsync_state", "Reconcile loop state", states=[s.value for s in State], registry=r)
        self.engine_up = Gauge("flipsync_engine_up", "1 when the engine reports healthy", registry=r)
        self.fetched_bytes = Counter("flipsync_fetched_bytes", "Bytes of artifacts downloaded and verified", registry=r)
        self.updates = Counter("flipsync_updates", "Versions applied, by artifact kind", ["kind"], registry=r)
        self.failures = Counter(
            "flipsync_failures", "Failed reconcile passes, by kind of failure", ["kind"], registry=r
        )

        def seconds(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, buckets=SECONDS_BUCKETS, registry=r)

        self.fetch_seconds = seconds("flipsync_fetch_seconds", "Waiting for an artifact's download")
        self.stage_seconds = seconds("flipsync_stage_seconds", "Decoding a patch while serving")
        self.commit_seconds = seconds("flipsync_commit_seconds", "The engine's write of a version")
        self.pause_seconds = seconds(
            "flipsync_pause_seconds", "New requests held at the gate per update (drain + write + verify)"
        )
        self.requests = Counter("flipsync_proxy_requests", "Proxied requests by outcome", ["outcome"], registry=r)
        self.in_flight = Gauge("flipsync_proxy_in_flight", "Proxied requests in flight", registry=r)
        self.version.set(-1)
        self.head.set(-1)
        self.state.state("idle")

    def render(self) -> bytes:
        return generate_latest(self.registry)
