"""The hand-off between the training thread and the publisher's background thread: a one-item slot where a
newer step replaces a pending one (the squash), and snapshots are held apart.
See docs/trainer.md ("Back-pressure: squash, never queue").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flipsync.errors import BoardError
from flipsync.trainer.pieces import FusedDiff, LocalView


class MemoryAccount:
    """Bytes of served views the publisher holds (base, in flight, pending), and their high-water mark."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.current += n
            self.peak = max(self.peak, self.current)

    def sub(self, n: int) -> None:
        with self._lock:
            self.current -= n


@dataclass
class Item:
    """One trainer step's served view, on its way to the board."""

    step: int
    view: LocalView | None
    wait: Callable[[], None] = field(default=lambda: None)
    snapshot: bool = False  # publish a full view (the run's first version, or after a layout change)
    error: str | None = None  # the view could not be computed on this rank (sharded runs report it)
    meta: dict[str, str | int] = field(default_factory=dict)  # extra manifest metadata for this step
    view_s: float = 0.0  # seconds computing the view took (for `Published.timings`)
    token: object = field(default_factory=object)  # this item's view, as a `FusedDiff` names its base
    fused: FusedDiff | None = None  # changes found while the view was computed, against another item's view


class Slot:
    """A one-item mailbox whose newer items replace older ones (see the module doc)."""

    def __init__(self, release: Callable[[Item], None], *, squash: bool = True) -> None:
        self._cond = threading.Condition()
        self._squash = squash  # False: a push waits for the worker to take the pending item (nothing merged)
        self._held: Item | None = None  # a snapshot waiting for the worker: taken first, never merged
        self._pending: Item | None = None
        self._busy = False  # the worker holds an item
        self._closing = False
        self._release = release
        self.squashed_steps = 0

    def _place(self, item: Item) -> None:
        if (old := self._pending) is not None:  # merged, into a snapshot too: nothing older is held back
            item.snapshot = item.snapshot or old.snapshot
            item.meta = {**old.meta, **item.meta}
            self.squashed_steps += 1
            self._release(old)
        if item.snapshot and self._held is None:
            self._held, self._pending = item, None
        else:
            self._pending = item

    def push(self, item: Item) -> None:
        with self._cond:
            while not self._squash and self._pending is not None and not self._closing:
                self._cond.wait()
            self._place(item)
            self._cond.notify_all()

    def push_back(self, item: Item) -> None:
        """Return an item the worker took but could not use, unless something newer arrived meanwhile."""
        with self._cond:
            newest = self._pending or self._held
            if newest is None or newest.step < item.step:
                self._place(item)
            else:
                self._release(item)
            self._busy = False
            self._cond.notify_all()

    def drop_pending_view(self) -> None:
        """Free a pending view that the step being computed will replace (keeps its flags for the merge)."""
        with self._cond:
            if self._pending is not None and self._pending.view is not None:
                self._release(self._pending)
                self._pending.view = None

    def newest(self) -> int | None:
        """Block until an item is pending or the slot closes; the pending step, or None when closed."""
        with self._cond:
            while self._next() is None and not self._closing:
                self._cond.wait()
            item = self._next()
            return item.step if item is not None else None

    def _next(self) -> Item | None:
        """The item the worker takes next: a held snapshot before the pending steps that came after it."""
        if self._held is not None:
            return self._held
        p = self._pending
        return p if p is not None and (p.view is not None or p.error is not None) else None

    def take(self, at_least: int | None = None, timeout_s: float | None = None) -> Item | None:
        """The pending item (with step >= ``at_least``), waiting for it; None when the slot closed empty."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                item = self._next()
                if item is not None and (at_least is None or item.step >= at_least):
                    if item is self._held:
                        self._held = None
                    else:
                        self._pending = None
                    self._busy = True
                    self._cond.notify_all()  # a push waiting for the pending item to go (squash=False)
                    return item
                if self._closing and (at_least is None or self._next() is None):
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise BoardError(
                        f"this rank's training loop did not reach step {at_least} within {timeout_s:g} s while "
                        "the other ranks published it; every rank must call step() for the same steps"
                    )
                self._cond.wait(left)

    def done(self) -> None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float | None, alive: Callable[[], bool]) -> bool:
        """Wait until nothing is pending or in flight (or the worker stopped); False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while (self._next() is not None or self._busy) and alive():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.1 if left is None else min(0.1, left))
            return True

    def clear(self) -> None:
        with self._cond:
            for item in (self._held, self._pending):
                if item is not None:
                    self._release(item)
            self._held = self._pending = None
