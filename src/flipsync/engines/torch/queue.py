"""The torch engine's generation pool, counting what it holds: sequences queued for a thread and being generated,
the load the engine reports for routing (``TorchEngine.load``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class GenerationPool(ThreadPoolExecutor):
    """A thread pool that counts its jobs: ``waiting`` (submitted, no thread yet) and ``running``."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "") -> None:
        super().__init__(max_workers, thread_name_prefix=thread_name_prefix)
        self._count_lock = threading.Lock()
        self.waiting = 0
        self.running = 0

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        started = threading.Event()

        def run() -> T:
            with self._count_lock:
                self.waiting -= 1
                self.running += 1
            started.set()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._count_lock:
                    self.running -= 1

        def cancelled(f: Future[T]) -> None:
            if f.cancelled() and not started.is_set():  # never ran: it leaves the queue here
                with self._count_lock:
                    self.waiting -= 1

        with self._count_lock:
            self.waiting += 1
        future = super().submit(run)
        future.add_done_callback(cancelled)
        return future
