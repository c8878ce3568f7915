"""A store wrapper that limits read bandwidth with a token bucket, so a loopback board behaves like a WAN link
(``flipsync demo --bandwidth``, the cross-region benchmark). Readers sleep until their bytes are covered, so
concurrent ones share the link; writes are not limited (the trainer's side of the link is its own datacenter).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

from flipsync.errors import ConfigError
from flipsync.stores import Store, StoreWrapper

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(text: str) -> float:
    """``"100mbit"``, ``"1gbit"``, ``"10Gbps"``, ``"50MB/s"`` or a number of bytes per second -> bytes/s."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|bps|b/s|b|byte|bytes|/s)?\s*", text.lower())
    if not m:
        raise ConfigError(f"cannot read bandwidth {text!r}; write e.g. 100mbit, 1gbit or 50MB/s")
    value, unit, kind = float(m[1]), m[2], m[3] or ""
    bits = kind in ("bit", "bps") or (kind == "b" and "B" not in text.split(m[1])[-1])
    rate = value * _UNITS[unit] / (8 if bits else 1)
    if rate <= 0:
        raise ConfigError(f"bandwidth must be positive, got {text!r}")
    return rate


class TokenBucket:
    """``take(n)`` blocks until ``n`` bytes may pass at ``bytes_per_s``, with bursts of at most 50 ms of traffic."""

    def __init__(
        self,
        bytes_per_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.rate = bytes_per_s
        self.capacity = max(1.0, bytes_per_s * 0.05)
        self._tokens = self.capacity
        self._clock, self._sleep = clock, sleep
        self._last = clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Large reads pass in bursts of up to ``capacity`` bytes. Each burst is taken at once and its debt slept
        off (readers queue in turn): waiting for a single byte, as before, woke every ~80 ns at 100 mbit and
        spun a core for the whole download, starving every process beside it."""
        left = float(n)
        while left > 0:
            with self._lock:
                now = self._clock()
                self._tokens = min(self.capacity, self._tokens + (now - self._last) * self.rate)
                self._last = now
                burst = min(left, self.capacity)
                self._tokens -= burst
                left -= burst
                wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
            if wait:
                self._sleep(wait)


class ThrottledStore(StoreWrapper):
    """Wraps a Store; reads pay the bucket. Writes and metadata calls (head, list) pass through unlimited."""

    def __init__(self, inner: Store, bytes_per_s: float) -> None:
        super().__init__(inner)
        self.bucket = TokenBucket(bytes_per_s)
        self.bytes_read = 0

    def get(self, path: str, *, size: int | None = None) -> bytes:
        data = self.inner.get(path, size=size)
        self._pay(len(data))
        return data

    def get_range(self, path: str, start: int, end: int) -> bytes:
        data = self.inner.get_range(path, start, end)
        self._pay(len(data))
        return data

    def _pay(self, n: int) -> None:
        self.bucket.take(n)
        self.bytes_read += n
