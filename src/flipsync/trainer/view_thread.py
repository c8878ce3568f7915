"""Computing a step's served view off the training thread, before the next optimizer step, so the training
thread only waits when the computation takes longer than a forward and backward pass. See docs/trainer.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from flipsync.trainer.publish_thread import lower_priority

log = logging.getLogger(__name__)


class ViewThread:
    """Runs one job at a time; ``wait_idle`` returns once the last submitted job finished."""

    def __init__(self, *, nice: int, threads: int) -> None:
        self._cond = threading.Condition()
        self._job: Callable[[], None] | None = None
        self._busy = False
        self._closing = False
        self.error: BaseException | None = None  # the last job's failure, taken by the publisher
        self._nice = nice
        self._threads = threads
        self._thread = threading.Thread(target=self._main, name="flipsync-view", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            while self._job is not None or self._busy:  # one step at a time (the pre-step hook waits)
                self._cond.wait()
            self._job = job
            self._cond.notify_all()

    def wait_idle(self) -> None:
        with self._cond:
            while (self._job is not None or self._busy) and self._thread.is_alive():
                self._cond.wait(0.5)

    def take_error(self) -> BaseException | None:
        with self._cond:
            e, self.error = self.error, None
            return e

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def _main(self) -> None:
        lower_priority(self._nice)
        torch.set_num_threads(self._threads)  # per thread (an OpenMP setting): training keeps its own
        while True:
            with self._cond:
                while self._job is None and not self._closing:
                    self._cond.wait()
                if self._job is None:
                    return
                job, self._job, self._busy = self._job, None, True
            try:
                job()
            except BaseException as e:
                self.error = e
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
