"""Following a board through a regional copy the cloud replicates late and in any order: `MirrorStore` waits
for late objects or reads them from the origin, and measures the replication lag. See docs/integrations/mirrors.md.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flipsync.board.layout import LATEST, MANIFEST
from flipsync.domain.manifest import Manifest
from flipsync.errors import ConfigError, IntegrityError, NotFoundError, TransientStoreError
from flipsync.stores import ObjectInfo, Store, StoreWrapper

log = logging.getLogger(__name__)
T = TypeVar("T")

_VERSION_MANIFEST = re.compile(rf"^(?P<run>(?:.*/)?runs/[^/]+)/versions/(?P<v>\d+)/{re.escape(MANIFEST)}$")


@dataclass(frozen=True)
class MirrorPolicy:
    """How a reader treats objects the mirror does not have yet: one read waits up to ``wait_s`` for a missing
    object to appear (looking every ``poll_s``), then with ``fallback`` reads it from the origin board; else it
    fails with ``TransientStoreError`` and the replica stays on its last whole version."""

    wait_s: float = 30.0
    poll_s: float = 0.2
    fallback: bool = True

    def __post_init__(self) -> None:
        if not self.wait_s >= 0 or not self.poll_s > 0:
            raise ConfigError(f"mirror wait must be >= 0 s and its poll > 0 s, got {self.wait_s}, {self.poll_s}")


@dataclass
class MirrorStats:
    """What the mirror store saw so far."""

    manifests: int = 0  # version manifests seen to appear on the mirror (one lag sample each)
    lag_last_s: float | None = None  # replication lag of the newest of them
    lag_max_s: float = 0.0  # the largest lag seen
    lag_sum_s: float = 0.0  # sum of the lags (mean = lag_sum_s / manifests)
    waits: int = 0  # reads that found the object missing on the mirror and waited for it
    waited_s: float = 0.0  # total time those reads waited
    origin_reads: int = 0  # objects read from the origin instead of the mirror
    origin_bytes: int = 0
    unavailable: int = 0  # reads that gave up: neither the mirror (within wait_s) nor the origin had the object


class MirrorStore(StoreWrapper):
    """A read-only Store over a mirror of a board; ``mirror`` and ``origin`` are rooted at the same board."""

    def __init__(
        self,
        mirror: Store,
        origin: Store | None = None,
        policy: MirrorPolicy | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(mirror)
        self.origin = origin
        self.policy = policy or MirrorPolicy()
        if self.policy.fallback and origin is None:
            self.policy = replace(self.policy, fallback=False)
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._newest: dict[str, int] = {}  # run root -> newest version manifest seen on the mirror
        # Lag samples come only from manifests this reader saw appear: absent at one look, present at a later
        # one (a replica that boots late would otherwise count its whole catch-up as lag).
        self._missed: set[str] = set()  # version manifests looked for and not there (yet)
        self._appeared: dict[str, float] = {}  # missed manifests now seen: when they were first seen
        self._stats = MirrorStats()

    def __repr__(self) -> str:
        return f"MirrorStore({self.url!r}, origin={self.origin.url if self.origin else None!r})"

    # -- writes: refused -----------------------------------------------------------------------------

    def _read_only(self, what: str) -> ConfigError:
        return ConfigError(f"{self.url} is a mirror, read-only here: {what} the origin board instead")

    def put(self, path: str, data: bytes | bytearray | memoryview, *, create_only: bool = False) -> None:
        raise self._read_only("publish to")

    def delete(self, paths: Sequence[str]) -> None:
        raise self._read_only("prune")

    def make_durable(self, paths: Sequence[str]) -> None:
        raise self._read_only("publish to")

    # -- reads ---------------------------------------------------------------------------------------

    def exists(self, path: str) -> bool:
        found = self.inner.exists(path)
        if found:
            self._seen(path)
        else:
            self._miss(path)
        return found

    def head(self, path: str) -> ObjectInfo:
        return self._read(path, "head", lambda s: s.head(path), size_of=lambda info: 0)

    def get(self, path: str, *, size: int | None = None) -> bytes:
        data = self._read(path, "get", lambda s: s.get(path, size=size), size_of=len)
        if _VERSION_MANIFEST.match(path):
            self._sample_lag(path, data)
        return data

    def get_range(self, path: str, start: int, end: int) -> bytes:
        return self._read(path, "get_range", lambda s: s.get_range(path, start, end), size_of=len)

    def close(self) -> None:
        self._stop.set()  # a read waiting for a late object gives up now
        self.inner.close()
        if self.origin is not None:
            self.origin.close()

    # -- the policy ----------------------------------------------------------------------------------

    def _read(self, path: str, op: str, call: Callable[[Store], T], *, size_of: Callable[[T], int]) -> T:
        try:
            out = call(self.inner)
        except NotFoundError:
            self._miss(path)
        else:
            self._seen(path)
            return out
        expected = self._expected(path)
        if expected and self.policy.wait_s > 0 and self._wait_on_mirror(path):
            out = call(self.inner)
            self._seen(path)
            return out
        if self.policy.fallback and self.origin is not None and (expected or path.endswith(MANIFEST)):
            try:
                out = call(self.origin)
            except NotFoundError:
                if not expected:
                    raise
            else:
                with self._lock:
                    self._stats.origin_reads += 1
                    self._stats.origin_bytes += size_of(out)
                log.info("mirror %s lacks %s; read it from the origin %s", self.url, path, self.origin.url)
                return out
        if not expected:
            raise NotFoundError(f"{self.url}/{path} does not exist")
        with self._lock:
            self._stats.unavailable += 1
        where = "nor on the origin" if self.policy.fallback else "(origin fallback is off)"
        raise TransientStoreError(
            f"{op} {self.url}/{path}: the mirror still lacks this object after {self.policy.wait_s:g} s {where}; "
            "its replication is behind or dropped it. The replica stays on its last whole version and tries "
            "again; raise the wait (--mirror-wait) or read late objects from the origin (--origin URL)"
        )

    def _expected(self, path: str) -> bool:
        """Whether a missing object must exist on the board (replication lag), not merely "not yet published"."""
        if path.endswith("/" + LATEST) or path == LATEST:
            return False
        m = _VERSION_MANIFEST.match(path)
        if m is not None:
            with self._lock:
                newest = self._newest.get(m.group("run"))
            return newest is not None and int(m.group("v")) < newest
        return not path.endswith(MANIFEST)  # parts are read only because a manifest lists them

    def _wait_on_mirror(self, path: str) -> bool:
        t0 = time.monotonic()
        deadline = t0 + self.policy.wait_s
        with self._lock:
            self._stats.waits += 1
        try:
            while not self._stop.is_set():
                if self.inner.exists(path):
                    log.debug("mirror %s: %s arrived after %.2f s", self.url, path, time.monotonic() - t0)
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    log.debug("mirror %s: %s missing after %.1f s", self.url, path, self.policy.wait_s)
                    return False
                self._stop.wait(min(self.policy.poll_s, left))
            return False
        finally:
            with self._lock:
                self._stats.waited_s += time.monotonic() - t0

    # -- lag -----------------------------------------------------------------------------------------

    def _miss(self, path: str) -> None:
        if _VERSION_MANIFEST.match(path):
            with self._lock:
                self._missed.add(path)

    def _seen(self, path: str) -> None:
        m = _VERSION_MANIFEST.match(path)
        if m is None:
            return
        now = self._clock()
        with self._lock:
            if path in self._missed:
                self._missed.discard(path)
                self._appeared[path] = now
            run, v = m.group("run"), int(m.group("v"))
            if v > self._newest.get(run, -1):
                self._newest[run] = v

    def _sample_lag(self, path: str, data: bytes) -> None:
        with self._lock:
            seen = self._appeared.pop(path, None)
        if seen is None:
            return  # there at the first look, read from the origin, or sampled already
        try:
            created = Manifest.from_json(data).created_at.timestamp()
        except (IntegrityError, ValueError):
            return  # the catalog reports an unusable manifest itself
        lag = max(0.0, seen - created)
        with self._lock:
            self._stats.manifests += 1
            self._stats.lag_last_s = lag
            self._stats.lag_max_s = max(self._stats.lag_max_s, lag)
            self._stats.lag_sum_s += lag

    @property
    def stats(self) -> MirrorStats:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._stats)


def find_mirror(store: Store) -> MirrorStore | None:
    """The MirrorStore inside a chain of store wrappers (fetch-ahead, ...), if any."""
    s: object = store
    for _ in range(16):
        if isinstance(s, MirrorStore):
            return s
        s = getattr(s, "inner", None)
    return None


class MirrorCollector(Collector):
    """Prometheus collector of a MirrorStore's stats: ``registry.register(MirrorCollector(store))``."""

    def __init__(self, store: MirrorStore) -> None:
        self.store = store

    def collect(self) -> Iterator[Metric]:
        s = self.store.stats
        yield GaugeMetricFamily(
            "flipsync_mirror_lag_seconds",
            "Replication lag of the newest version manifest: first seen on the mirror minus its created time",
            value=-1.0 if s.lag_last_s is None else s.lag_last_s,
        )
        yield GaugeMetricFamily("flipsync_mirror_lag_max_seconds", "Largest replication lag seen", value=s.lag_max_s)
        counters: list[tuple[str, str, float]] = [
            ("manifests", "Version manifests seen to appear (lag samples)", s.manifests),
            ("waits", "Reads that waited for an object the mirror did not have yet", s.waits),
            ("wait_seconds", "Time reads waited for late objects", s.waited_s),
            ("origin_reads", "Objects read from the origin board instead", s.origin_reads),
            ("origin_bytes", "Bytes read from the origin board instead", s.origin_bytes),
            ("unavailable", "Reads that gave up on an object (the replica retries)", s.unavailable),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(f"flipsync_mirror_{name}", doc, value=value)
