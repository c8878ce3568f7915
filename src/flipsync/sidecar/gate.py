"""The request gate: admission of proxied requests, and the pause around a commit, so a request never starts on
a half-applied version; also the final drain when a sidecar leaves the fleet.
See docs/sidecar.md ("Commit modes") and docs/fleet.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum

from flipsync.sidecar.notify import Notifier

log = logging.getLogger(__name__)


class CommitMode(StrEnum):
    QUIESCE = "quiesce"
    IN_PLACE = "in_place"


@dataclass
class Pause:
    """What one closing of the gate cost: how long it waited for in-flight requests, and whether they drained."""

    drain_s: float = 0.0
    drained: bool = True
    closed_s: float = 0.0


class RequestGate:
    """Counts requests in flight and holds new ones while a commit is under way."""

    def __init__(self) -> None:
        self._n = Notifier()
        self._open = True
        self._in_flight = 0
        self._pinned = 0
        self._draining = False

    @property
    def is_open(self) -> bool:
        return self._open

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def pinned(self) -> int:
        return self._pinned

    @property
    def draining(self) -> bool:
        """True once the sidecar is leaving: the proxy admits nothing new."""
        return self._draining

    def start_draining(self) -> None:
        with self._n.lock:
            self._draining = True
            self._n.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False if some still were after ``timeout_s``."""
        return self._n.wait(lambda: self._in_flight == 0, timeout_s)

    async def enter(self, *, pinned: bool, timeout: float) -> bool:
        """Admit one request once the gate is open; False if it stayed closed for ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with self._n.lock:
                if self._open:
                    self._in_flight += 1
                    self._pinned += int(pinned)
                    return True
            if not await self._n.wait_async(lambda: self._open, deadline - time.monotonic()):
                return False

    def leave(self, *, pinned: bool) -> None:
        with self._n.lock:
            self._in_flight -= 1
            self._pinned -= int(pinned)
            self._n.notify_all()

    @contextmanager
    def closed(self, mode: CommitMode, drain_timeout_s: float) -> Iterator[Pause]:
        """Close the gate, drain what ``mode`` asks for (bounded), run the body, reopen (always)."""
        t0 = time.monotonic()
        pause = Pause()
        with self._n.lock:
            self._open = False
            self._n.notify_all()
        try:
            quiesce = mode is CommitMode.QUIESCE
            pause.drained = self._n.wait(lambda: (self._in_flight if quiesce else self._pinned) == 0, drain_timeout_s)
            pause.drain_s = time.monotonic() - t0
            if not pause.drained:
                log.warning(
                    "%d request(s) still in flight after %.1f s of draining; committing anyway "
                    "(they will report both versions)",
                    self._in_flight,
                    drain_timeout_s,
                )
            yield pause
        finally:
            with self._n.lock:
                self._open = True
                self._n.notify_all()
            pause.closed_s = time.monotonic() - t0
