"""The publisher's background thread: takes the newest step from the slot and publishes it, and applies the
error policy (stop, skip or fence) that the next ``step()``, ``flush()`` or ``close()`` surfaces.
See docs/trainer.md ("Errors").
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from flipsync.errors import BoardError, TransientStoreError
from flipsync.trainer.config import PublisherConfig
from flipsync.trainer.rank_group import RankGroup
from flipsync.trainer.rounds import Published, RoundSkipped, VersionRounds
from flipsync.trainer.slot import Item, Slot

log = logging.getLogger(__name__)

UPLOADS = 4  # a part's chunks in flight at once (object stores take concurrent puts well)


def lower_priority(nice: int) -> None:
    """Lower the calling thread's priority (Linux: per thread); a no-op where unsupported."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:  # not permitted, or not a per-thread platform
        log.debug("could not lower the publisher thread's priority: %s", e)


class PublishThread:
    """Runs the version rounds on items from the slot, in a thread or inline."""

    def __init__(self, rounds: VersionRounds, slot: Slot, group: RankGroup, config: PublisherConfig) -> None:
        self.rounds = rounds
        self.slot = slot
        self.group = group
        self._release = rounds.drop
        self.config = config
        self.error: BaseException | None = None  # fatal: the worker stopped
        self.notice: BaseException | None = None  # raised once by the next call, then cleared
        self.store_failures = 0
        self.unpublished: Item | None = None  # the newest step whose publication failed, kept for a retry
        self.published: list[Published] = []
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- threads --------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="flipsync-publisher", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self, timeout_s: float | None) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _main(self) -> None:
        lower_priority(self.config.nice)
        torch.set_num_threads(self.config.pool_threads)  # per thread (an OpenMP setting): training keeps its own
        self.rounds.open_pools(UPLOADS)  # made here, they inherit the lowered priority
        try:
            if self.group.size == 1:
                while (item := self.slot.take()) is not None:
                    self.handle(item, item.step)
            else:
                self._sharded_loop()
        except BaseException as e:
            self.error = e
            log.error("the flipsync publisher stopped: %s", e)
        finally:
            self.slot.close()
            self.slot.clear()
            self.rounds.close_pools()

    def _sharded_loop(self) -> None:
        while True:
            steps = self.group.all_gather(self.slot.newest(), "which steps are ready")
            closed = [r for r, s in enumerate(steps) if s is None]
            if len(closed) == len(steps):
                return  # every rank closed with nothing left
            target = max(s for s in steps if s is not None)
            if closed:
                raise BoardError(
                    f"ranks {closed} closed their publisher while others still publish step {target}; "
                    "every rank must call step() for the same steps before close()"
                )
            item = self.slot.take(at_least=target, timeout_s=self.config.timeout_s)
            if item is None:
                raise BoardError(f"this rank's publisher closed before step {target}, which other ranks publish")
            self.handle(item, target)

    # -- one item -------------------------------------------------------------------------------------

    def handle(self, item: Item, target: int) -> Published | None:
        """Publish one item; classify failures by the policy in the module doc (fatal ones stick).

        The slot hears that the item is done only after the bookkeeping below: ``flush()`` reads ``unpublished``
        and the stats as soon as the slot is idle, and must not find a step this version covers.
        """
        try:
            return self._handle(item, target)
        except BaseException as e:
            self.error = e
            raise
        finally:
            self.slot.done()

    def _handle(self, item: Item, target: int) -> Published | None:
        try:
            published = self.rounds.run(item, target)
        except RoundSkipped as skip:
            self._skipped(item, target, skip)
            return None
        self.store_failures = 0
        with self._lock:
            self.published.append(published)
            held, self.unpublished = self.unpublished, None
        if held is not None and held is not item:  # covered by this version
            self._release(held)
        return published

    def take_unpublished(self) -> Item | None:
        """The kept step whose publication failed, handed back for another try (None: nothing failed)."""
        with self._lock:
            item, self.unpublished = self.unpublished, None
        return item

    def _skipped(self, item: Item, target: int, skip: RoundSkipped) -> None:
        if skip.reason == "retry":
            if item.step > target:
                self.slot.push_back(item)
            else:
                self._release(item)
            return
        if skip.reason == "step":
            if item.error is None:  # the rank that failed raised it already
                self.notice = BoardError(str(skip))
            log.warning("%s", skip)
            return
        self.store_failures += 1
        with self._lock:
            held, self.unpublished = self.unpublished, item
        if held is not None and held is not item:  # the newer step covers it
            self._release(held)
        if self.store_failures >= self.config.max_store_failures:
            raise TransientStoreError(
                f"{skip}; gave up after {self.store_failures} failed publications in a row. Nothing half-"
                "published is visible; check the board's store, then resume the run (resume=True)"
            )
        log.warning("%s; the next step's publication will cover this one", skip)
