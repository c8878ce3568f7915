"""The request gate: admission of proxied requests, the pause around a commit and the final drain; and `Notifier`,
the wake-ups shared across threads and event loops. See docs/sidecar.md#commit-modes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum

log = logging.getLogger(__name__)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Notifier:
    """A condition variable that threads and asyncio tasks (on any loop) can wait on: the reconcile loop runs in a
    thread, the proxy's handlers are asyncio tasks, and both wait on the same state (the gate, the replica's
    version). Mutate the shared state while holding ``lock`` and call ``notify_all`` before releasing it.
    """

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def notify_all(self) -> None:
        """Wake every waiter; the caller holds ``lock``."""
        self.lock.notify_all()
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):  # that loop has closed: nobody is waiting any more
                loop.call_soon_threadsafe(_resolve, fut)

    def wait(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block this thread until ``predicate()`` holds (checked under the lock) or ``timeout`` passes."""
        with self.lock:
            return self.lock.wait_for(predicate, timeout=max(0.0, timeout))

    async def wait_async(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Await until ``predicate()`` holds (checked under the lock) or ``timeout`` passes."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            with self.lock:
                if predicate():
                    return True
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                fut: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, fut))
            try:
                await asyncio.wait_for(fut, remaining)
            except TimeoutError:
                with self.lock:
                    with contextlib.suppress(ValueError):
                        self._waiters.remove((loop, fut))
                    return predicate()


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
        self._n = Notifier()  # guards the fields below (written here only, read anywhere)
        self.is_open = True
        self.in_flight = 0
        self._pinned = 0
        self.draining = False  # True once the sidecar is leaving: the proxy admits nothing new

    def start_draining(self) -> None:
        with self._n.lock:
            self.draining = True
            self._n.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False if some still were after ``timeout_s``."""
        return self._n.wait(lambda: self.in_flight == 0, timeout_s)

    async def enter(self, *, pinned: bool, timeout: float) -> bool:
        """Admit one request once the gate is open; False if it stayed closed for ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with self._n.lock:
                if self.is_open:
                    self.in_flight += 1
                    self._pinned += int(pinned)
                    return True
            if not await self._n.wait_async(lambda: self.is_open, deadline - time.monotonic()):
                return False

    def leave(self, *, pinned: bool) -> None:
        with self._n.lock:
            self.in_flight -= 1
            self._pinned -= int(pinned)
            self._n.notify_all()

    @contextmanager
    def closed(self, mode: CommitMode, drain_timeout_s: float) -> Iterator[Pause]:
        """Close the gate, drain what ``mode`` asks for (bounded), run the body, reopen (always)."""
        t0 = time.monotonic()
        pause = Pause()
        with self._n.lock:
            self.is_open = False
            self._n.notify_all()
        try:
            quiesce = mode is CommitMode.QUIESCE
            pause.drained = self._n.wait(lambda: (self.in_flight if quiesce else self._pinned) == 0, drain_timeout_s)
            pause.drain_s = time.monotonic() - t0
            if not pause.drained:
                log.warning(
                    "%d request(s) still in flight after %.1f s of draining; committing anyway "
                    "(they will report both versions)",
                    self.in_flight,
                    drain_timeout_s,
                )
            yield pause
        finally:
            with self._n.lock:
                self.is_open = True
                self._n.notify_all()
            pause.closed_s = time.monotonic() - t0
