"""Where the publisher keeps served views between steps: on the device, or in pinned host memory (pooled), with
`StreamFence` ordering the publisher's CUDA work against the optimizer's. See docs/trainer.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch

from flipsync.errors import ConfigError
from flipsync.formats.view import Alloc
from flipsync.trainer.pieces import LocalView, Piece

KeepOn = Literal["host", "device"]
_Key = tuple[tuple[int, ...], torch.dtype, bool]  # shape, dtype, pinned


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    return sorted({t.device for t in tensors if t.device.type == "cuda"}, key=lambda d: d.index or 0)


class StreamFence:
    """Orders GPU work across threads: events recorded on one thread's streams, awaited on another's."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices
        self._events: dict[torch.device, torch.cuda.Event] = {}

    def record(self, streams: dict[torch.device, torch.cuda.Stream] | None = None) -> StreamFence:
        """Mark the work issued so far on the calling thread's current stream of every device (or on ``streams``)."""
        for d in self.devices:
            with torch.cuda.device(d):
                e = torch.cuda.Event()
                e.record(None if streams is None else streams[d])
                self._events[d] = e
        return self

    def wait(self) -> None:
        """Make the calling thread's current streams wait for the recorded work (no CPU wait)."""
        for d, e in self._events.items():
            with torch.cuda.device(d):
                torch.cuda.current_stream().wait_event(e)

    def synchronize(self) -> None:
        """Block the calling thread until the recorded work is done."""
        for e in self._events.values():
            e.synchronize()


class Stager:
    """Moves served views to where they are kept, reusing pinned buffers."""

    def __init__(self, keep_on: KeepOn) -> None:
        if keep_on not in ("host", "device"):
            raise ConfigError(f"keep_on must be 'host' or 'device', not {keep_on!r}")
        self.keep_on = keep_on
        self._pool: dict[_Key, list[torch.Tensor]] = {}
        self._mine: dict[int, _Key] = {}  # data pointer -> pool key, for every buffer this stager made
        self._lock = threading.Lock()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stage(self, view: LocalView) -> tuple[LocalView, Callable[[], None]]:
        """Start moving ``view``: the moved view, and what to call before reading it on another thread."""
        devices = cuda_devices(p.tensor for p in view.values())
        if not devices:
            return view, lambda: None
        if self.keep_on == "device":
            return view, StreamFence(devices).record().synchronize
        out: LocalView = dict(view)
        for d in devices:
            with torch.cuda.device(d):
                stream = self._streams.setdefault(d, torch.cuda.Stream())
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for name, p in view.items():
                        if p.tensor.device != d:
                            continue
                        buf = self._buffer(tuple(p.tensor.shape), p.tensor.dtype)
                        buf.copy_(p.tensor, non_blocking=True)
                        p.tensor.record_stream(stream)  # the device copy may be freed before the copy ran
                        out[name] = Piece(buf, p.offset, p.shape)
        return out, StreamFence(devices).record(self._streams).synchronize

    @contextmanager
    def buffers(self) -> Iterator[Alloc]:
        """An `Alloc` for one view's computation: reusable buffers for the casts it runs on the CPU (None
        for other devices, whose casts stay where they ran). Fresh CPU tensors cost page faults on first
        touch, as much as the cast itself. If the computation fails, the buffers it took go back to the pool.
        """
        taken: list[torch.Tensor] = []

        def alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
            if device.type != "cpu":
                return None
            taken.append(self._buffer(shape, dtype, pinned=False))
            return taken[-1]

        try:
            yield alloc
        except BaseException:
            self._give_back(taken)
            raise

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype, *, pinned: bool = True) -> torch.Tensor:
        key = (shape, dtype, pinned)
        with self._lock:
            free = self._pool.get(key)
            if free:
                return free.pop()
        t = torch.empty(shape, dtype=dtype, pin_memory=pinned)
        with self._lock:
            self._mine[t.data_ptr()] = key
        return t

    def release(self, view: LocalView | None) -> None:
        """Give a view's buffers back for reuse (called when the view is no longer needed)."""
        if view:
            self._give_back(p.tensor for p in view.values())

    def _give_back(self, tensors: Iterable[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                key = self._mine.get(t.data_ptr())
                if key is not None and key[:2] == (tuple(t.shape), t.dtype):
                    free = self._pool.setdefault(key, [])
                    if all(f is not t for f in free):  # a view released twice must not hand it out twice
                        free.append(t)

    def clear(self) -> None:
        with self._lock:
            self._pool.clear()
            self._mine.clear()
