"""One rank's half of publishing a version: stream its part to the attempt folder in chunks while it is still
being coded, header last, and report the part's manifest entry for rank 0 to publish.
See docs/trainer.md ("Sharded training") and docs/board.md ("Layout").
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Executor, Future, wait

import blake3

from flipsync.board.layout import part_name
from flipsync.domain.manifest import Chunk, Part
from flipsync.errors import ConfigError, FlipsyncError, PermanentStoreError
from flipsync.stores import Store

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 8 << 20
MIN_CHUNK_BYTES = 4096


def check_chunk_bytes(chunk_bytes: int) -> None:
    if chunk_bytes < MIN_CHUNK_BYTES:
        raise ConfigError(f"chunk_bytes: stream chunks must be at least {MIN_CHUNK_BYTES} bytes, got {chunk_bytes}")


class PartStream:
    """Lays out and uploads one rank's part of one version: ``add`` takes the file's data area in file order
    (``PatchEncoder``'s stream, on a coding thread), ``finish`` its head and tail, once. Uploads run on
    ``uploader`` (inline without one); each object is made durable before the part is reported."""

    def __init__(
        self,
        store: Store,
        version_dir: str,
        attempt: str,
        rank: int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        uploader: Executor | None = None,
    ) -> None:
        check_chunk_bytes(chunk_bytes)
        self.store = store
        self.version_dir = version_dir
        self.name = f"{attempt}/{part_name(rank)}"
        self.chunk_bytes = chunk_bytes
        self._uploader = uploader
        self._pending: list[bytes | memoryview] = []
        self._pending_bytes = 0
        self._chunks: list[tuple[str, bytes]] = []
        self._uploads: list[Future[None]] = []
        self._first = b""
        self._settled = False  # kept or aborted: abort() does nothing more
        self._lock = threading.Lock()  # add() runs on the coder, abort() may run on the publishing thread

    def add(self, data: bytes | memoryview) -> None:
        """The next bytes of the file's data area."""
        with self._lock:
            self._pending.append(data)
            self._pending_bytes += len(data)
            if self._pending_bytes >= self.chunk_bytes:
                self._flush()

    def _flush(self) -> None:
        data = b"".join(self._pending)
        self._pending, self._pending_bytes = [], 0
        rel = f"{self.name}.{len(self._chunks) + 1:05d}"
        self._chunks.append((rel, data))
        if self._uploader is None:
            self._put(rel, data)
        else:
            self._uploads.append(self._uploader.submit(self._put, rel, data))

    def _put(self, rel: str, data: bytes) -> None:
        path = f"{self.version_dir}/{rel}"
        self.store.put(path, data)
        self.store.make_durable([path])

    def finish(self, head: bytes, tail: bytes) -> Part:
        """Upload what is left (the header, the part's first object, last of all) and wait for every upload;
        the part's manifest entry."""
        with self._lock:
            if self._chunks and (self._pending or tail):
                self._pending.append(tail)
                self._flush()
            first = head + b"".join(self._pending) + tail if not self._chunks else head
            self._first = first
        self._put(self.name, first)
        self._wait()
        digest = blake3.blake3(first)
        for _, data in self._chunks:
            digest.update(data)
        size = len(first) + sum(len(d) for _, d in self._chunks)
        return Part(self.name, size, digest.hexdigest(), tuple(Chunk(rel, len(d)) for rel, d in self._chunks))

    def file_bytes(self) -> bytes:
        """The whole part file, after ``finish``."""
        return b"".join([self._first, *(d for _, d in self._chunks)])

    def _wait(self) -> None:
        errors = []
        for f in self._uploads:
            try:
                f.result()
            except FlipsyncError as e:
                errors.append(e)
        if errors:  # a refusal first: it decides that the publisher stops
            raise next((e for e in errors if isinstance(e, PermanentStoreError)), errors[0])

    def keep(self) -> None:
        """The version that references this part exists: ``abort`` must never delete it now."""
        self._settled = True

    def abort(self, *, delete: bool = True) -> list[str]:
        """Stop the uploads; unless kept (the version will not reference them), remove what was uploaded, best
        effort, once. ``delete=False`` leaves the objects and returns their paths, for the caller to delete
        later (once the store works again) or to leave to retention (a manifest listing them may land)."""
        if self._settled:
            return []
        self._settled = True
        with self._lock:
            uploads, self._uploads = self._uploads, []
        for f in uploads:
            f.cancel()
        wait(uploads)  # an upload still running would land after the delete
        paths = [f"{self.version_dir}/{rel}" for rel in (self.name, *(r for r, _ in self._chunks))]
        if not delete:
            return paths
        remove_unpublished(self.store, paths)
        return []


def remove_unpublished(store: Store, paths: list[str]) -> None:
    """Delete the objects of a part no version references; best effort (retention removes them otherwise)."""
    try:
        store.delete(paths)
    except FlipsyncError as e:
        log.debug("could not remove an unpublished part: %s", e)
