"""Ejection: a replica that fails fast (502, a 503 that is not a drain, a refused or dropped connection) is taken
out of rotation for a while that doubles at each ejection, then probed back in with one trial request
(docs/fleet.md#ejection). Per gateway, in memory: every gateway judges by the answers it gets itself."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from flipsync.fleet.metrics import GatewayMetrics

log = logging.getLogger(__name__)

# Retry reasons that say the replica itself is failing (a 409 says only that its record was out of date, a drain
# that it is leaving on purpose).
FAILURES = frozenset({"unreachable", "broken", "refused_503", "upstream_502", "stream_cut"})


@dataclass(frozen=True)
class EjectionPolicy:
    """``after`` failures in a row, each within ``window_s`` of the one before, eject a replica for ``backoff_s``,
    doubling at each ejection that follows a failed probe, up to ``max_backoff_s``. ``after=0``: never eject."""

    after: int = 2
    window_s: float = 10.0
    backoff_s: float = 15.0
    max_backoff_s: float = 300.0

    def backoff(self, ejections: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** max(0, ejections - 1))


class Admission(Enum):
    SKIP = "skip"  # ejected (or its one probe is out): try another replica
    NORMAL = "normal"
    PROBE = "probe"  # the one trial request after a backoff
    PANIC = "panic"  # every candidate is ejected: tried all the same; an answer brings it back


@dataclass
class _Health:
    failures: int = 0  # in a row
    last_failure: float = 0.0
    ejections: int = 0  # in a row: the backoff doubles with each
    until: float = 0.0  # ejected until this monotonic time (0: in rotation)
    probing: bool = False
    errors: int = 0  # every failure since this gateway started
    reasons: dict[str, int] = field(default_factory=dict)


class Ejector:
    """The health of each replica as this gateway sees it: ``admit`` before an attempt, ``failed`` or ``succeeded``
    after it. Used from the event loop only (no lock)."""

    def __init__(
        self, policy: EjectionPolicy, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        self.health: dict[str, _Health] = {}

    def ejected(self, replica: str) -> bool:
        """Out of rotation now, and not yet due for its probe (or its probe is out)."""
        h = self.health.get(replica)
        return h is not None and h.until > 0 and (h.probing or self.clock() < h.until)

    def admit(self, replica: str) -> Admission:
        h = self.health.get(replica)
        if h is None or h.until == 0:
            return Admission.NORMAL
        if h.probing or self.clock() < h.until:
            return Admission.SKIP
        h.probing = True
        log.info("probing replica %s after %g s out of rotation", replica, self.policy.backoff(h.ejections))
        return Admission.PROBE

    def failed(self, replica: str, reason: str, admission: Admission) -> None:
        if reason not in FAILURES:
            if admission is Admission.PROBE:  # a 409 or a drain: not a verdict on its health; probe again
                self.health[replica].probing = False
            return
        h = self.health.setdefault(replica, _Health())
        now = self.clock()
        h.errors += 1
        h.reasons[reason] = h.reasons.get(reason, 0) + 1
        self.metrics.replica(replica).errors(reason)
        if admission is Admission.PROBE:
            h.probing = False
            self._eject(replica, h, now, f"its probe failed ({reason})")
            return
        if h.until > 0:  # ejected already (an attempt sent before): nothing more to decide
            return
        h.failures = h.failures + 1 if now - h.last_failure <= self.policy.window_s else 1
        h.last_failure = now
        if self.policy.after and h.failures >= self.policy.after:
            self._eject(replica, h, now, f"{h.failures} failures in a row, the last {reason}")

    def _eject(self, replica: str, h: _Health, now: float, why: str) -> None:
        h.ejections += 1
        h.failures = 0
        backoff = self.policy.backoff(h.ejections)
        h.until = now + backoff
        m = self.metrics.replica(replica)
        m.ejections.inc()
        m.ejected.set(1)
        log.warning("ejected replica %s for %g s: %s", replica, backoff, why)

    def succeeded(self, replica: str, admission: Admission) -> None:
        h = self.health.get(replica)
        if h is None:
            return
        if admission in (Admission.PROBE, Admission.PANIC) or (h.until == 0 and h.failures):
            if h.until:
                log.info("replica %s answered its probe: back in rotation", replica)
                self.metrics.replica(replica).ejected.set(0)
            h.failures = h.ejections = 0
            h.until = 0.0
            h.probing = False

    def describe(self, replica: str) -> dict[str, object]:
        """What ``/flipsync/fleet`` says of a replica's health here."""
        h = self.health.get(replica)
        if h is None:
            return {"errors": 0, "ejected": False}
        left = max(0.0, h.until - self.clock()) if h.until else 0.0
        return {
            "errors": h.errors,
            "error_reasons": dict(h.reasons),
            "ejected": h.until > 0,
            "ejected_for_s": round(left, 3),
            "ejections_in_a_row": h.ejections,
        }

    def forget(self, keep: set[str]) -> None:
        """Drop what it knows of replicas that left the fleet (their ids may never come back)."""
        for replica in [r for r in self.health if r not in keep]:
            del self.health[replica]
