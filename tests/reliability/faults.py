"""A seeded fault-injecting Store: failures, delays, corrupted reads, stale listings and torn part writes.

Wraps any board Store. Each call draws from its own ``random.Random(seed)``, so a schedule replays exactly.
``enabled`` switches every fault off at once (to check convergence after the faults are gone); ``counts``
says what was injected. Manifests are never torn: object stores write whole objects (a PUT lands entirely or
not at all), which is what the create-only protocol relies on; parts may be torn, as by a store that
exposes partial uploads, and must then fail their hash check.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from flipsync.errors import StoreError
from flipsync.stores import ObjectInfo, Store


@dataclass
class FaultRates:
    fail: float = 0.0  # the call raises StoreError (before a write lands)
    delay: float = 0.0  # the call sleeps up to delay_s first
    delay_s: float = 0.01
    corrupt: float = 0.0  # a read returns the bytes with one bit flipped
    stale: float = 0.0  # a listing misses the newest objects, a head of a new object says not found
    torn: float = 0.0  # a part write leaves a truncated object behind and raises


class FaultyStore:
    def __init__(self, inner: Store, rates: FaultRates, seed: int) -> None:
        self.inner = inner
        self.url = f"faulty+{inner.url}"
        self.rates = rates
        self.rng = random.Random(seed)
        self.enabled = True
        self.counts: collections.Counter[str] = collections.Counter()

    def _roll(self, kind: str) -> bool:
        p = getattr(self.rates, kind)
        hit = self.enabled and p > 0 and self.rng.random() < p
        if hit:
            self.counts[kind] += 1
        return hit

    def _enter(self, what: str) -> None:
        if self._roll("delay"):
            time.sleep(self.rng.random() * self.rates.delay_s)
        if self._roll("fail"):
            raise StoreError(f"{self.url}: injected failure of {what}")

    def _maybe_corrupt(self, data: bytes) -> bytes:
        if data and self._roll("corrupt"):
            buf = bytearray(data)
            buf[self.rng.randrange(len(buf))] ^= 1 << self.rng.randrange(8)
            return bytes(buf)
        return data

    def put(self, path: str, data: bytes | bytearray | memoryview, *, create_only: bool = False) -> None:
        self._enter(f"put {path}")
        if not path.endswith("manifest.json") and len(data) > 1 and self._roll("torn"):
            self.inner.put(path, bytes(data)[: self.rng.randrange(1, len(data))])
            raise StoreError(f"{self.url}: injected torn write of {path}")
        self.inner.put(path, data, create_only=create_only)

    def get(self, path: str, *, size: int | None = None) -> bytes:
        self._enter(f"get {path}")
        return self._maybe_corrupt(self.inner.get(path, size=size))

    def get_range(self, path: str, start: int, end: int) -> bytes:
        self._enter(f"get_range {path}")
        return self._maybe_corrupt(self.inner.get_range(path, start, end))

    def head(self, path: str) -> ObjectInfo:
        self._enter(f"head {path}")
        return self.inner.head(path)

    def exists(self, path: str) -> bool:
        self._enter(f"exists {path}")
        return self.inner.exists(path)

    def list(self, prefix: str) -> list[ObjectInfo]:
        self._enter(f"list {prefix}")
        found = self.inner.list(prefix)
        if found and self._roll("stale"):
            newest = max(o.modified for o in found)
            found = [o for o in found if o.modified < newest]
        return found

    def list_dirs(self, prefix: str) -> list[str]:
        self._enter(f"list_dirs {prefix}")
        found = self.inner.list_dirs(prefix)
        if found and self._roll("stale"):
            found = sorted(found)[:-1]
        return found

    def delete(self, paths: Sequence[str]) -> None:
        self._enter("delete")
        self.inner.delete(paths)

    def make_durable(self, paths: Sequence[str]) -> None:
        self.inner.make_durable(paths)

    def close(self) -> None:
        self.inner.close()
