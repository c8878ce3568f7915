"""`FetchAhead`: a reader's store that downloads a version's objects while the trainer is still publishing them.
Why that is safe: docs/board.md ("Fetching ahead")."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from flipsync.board.layout import MANIFEST
from flipsync.errors import ConfigError, FlipsyncError, PermanentStoreError
from flipsync.stores import Store, StoreWrapper, WaitingStore

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 0.05
DEFAULT_MAX_BYTES = 8 << 30
DOWNLOADS = 4


class FetchAhead(StoreWrapper):
    """A Store that can download the objects of a folder before anyone asks for them (see the module doc)."""

    def __init__(
        self, inner: Store, *, interval_s: float = DEFAULT_INTERVAL_S, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        if not interval_s > 0:
            raise ConfigError(f"the fetch-ahead interval must be above 0 seconds, got {interval_s}")
        if max_bytes < 0:
            raise ConfigError(f"the fetch-ahead limit must be at least 0 bytes, got {max_bytes}")
        super().__init__(inner)
        self.interval_s = interval_s
        self.max_bytes = max_bytes
        self._pool = ThreadPoolExecutor(DOWNLOADS, thread_name_prefix="flipsync-ahead")
        self._lock = threading.Lock()
        self._folder: str | None = None
        self._seen: set[str] = set()
        self._held: dict[str, tuple[int, Future[bytes]]] = {}
        self._held_bytes = 0
        self.hits = 0  # reads answered by an early download

    def watch(self, folder: str) -> bool:
        """List ``folder`` and start downloading what is new in it; True once its manifest is there."""
        listed = self.inner.list(folder)
        manifest = f"{folder}/{MANIFEST}"
        with self._lock:
            if folder != self._folder:
                self._forget()
                self._folder = folder
            for o in listed:
                if o.path == manifest or o.path in self._seen:
                    continue
                if self._held_bytes + o.size > self.max_bytes:
                    continue  # read on demand instead
                self._seen.add(o.path)
                self._held_bytes += o.size
                self._held[o.path] = (o.size, self._pool.submit(self.inner.get, o.path, size=o.size))
        return any(o.path == manifest for o in listed)

    def _forget(self) -> None:
        for _, fut in self._held.values():
            fut.cancel()
        self._held.clear()
        self._seen.clear()
        self._held_bytes = 0

    @property
    def held(self) -> int:
        """Objects downloaded or downloading that nobody has read yet."""
        with self._lock:
            return len(self._held)

    def get(self, path: str, *, size: int | None = None) -> bytes:
        with self._lock:
            held = self._held.pop(path, None)
            if held is not None:
                self._held_bytes -= held[0]
        if held is not None:
            try:
                data = held[1].result()
            except PermanentStoreError:
                raise  # refused for good: reading it again would be refused too
            except FlipsyncError as e:  # read it again below; a real problem shows there
                log.debug("fetching %s ahead failed: %s", path, e)
            else:
                if size is None or len(data) == size:
                    with self._lock:
                        self.hits += 1
                    return data
        return self.inner.get(path, size=size)

    def wait_exists(self, path: str, timeout_s: float) -> bool | None:
        return self.inner.wait_exists(path, timeout_s) if isinstance(self.inner, WaitingStore) else None

    def close(self) -> None:
        with self._lock:
            self._forget()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.inner.close()
