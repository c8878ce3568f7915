"""A readers-writer lock between decode steps (many at once) and weight writes (one, exclusive).

Writers go first: once a commit asks, no new decode step starts, so the pause is the longest step in flight
plus the write itself. A decode step therefore sees either the old or the new weights, never a mix.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class StepLock:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def step(self) -> Iterator[None]:
        """Held around one forward pass."""
        with self._cond:
            while self._writer or self._writers_waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self) -> Iterator[float]:
        """Held around a weight write; yields how long it waited for the steps in flight to finish."""
        t0 = time.perf_counter()
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._writers_waiting -= 1
            self._writer = True
        try:
            yield time.perf_counter() - t0
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
