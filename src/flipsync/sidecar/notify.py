"""Wake-ups that cross the thread / asyncio boundary.

The reconcile loop runs in a thread; the proxy's handlers are asyncio tasks. Both wait on the same shared
state (the gate, the replica's version), so a state change must wake threads blocked on a condition and
tasks awaiting a future on their own event loop alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Notifier:
    """A condition variable that threads and asyncio tasks (on any loop) can wait on.

    Mutate the shared state while holding ``lock`` and call ``notify_all`` before releasing it.
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
