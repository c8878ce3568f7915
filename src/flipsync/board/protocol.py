"""`ArtifactWriter` publishes one artifact: its parts made durable in a fresh attempt folder, then its manifest
created create-only, conflicts and ambiguous creates resolved safely. See docs/board.md ("Publish protocol")."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

from flipsync.board.catalog import content_hash
from flipsync.board.layout import MANIFEST, new_attempt_id
from flipsync.board.signing import Signer
from flipsync.domain.manifest import Kind, Manifest, Part, utc_now_iso
from flipsync.errors import BoardError, ConflictError, IntegrityError, NotFoundError, PermanentStoreError, StoreError
from flipsync.stores import Store

log = logging.getLogger(__name__)

Meta = Mapping[str, str | int | float | bool]


class ArtifactWriter:
    """Uploads and publishes artifacts (versions, keyframes, spans) of one run as one publisher: ``upload`` makes the
    parts durable, ``publish`` creates the manifest that makes them an artifact."""

    def __init__(
        self,
        store: Store,
        run: str,
        publisher_id: str,
        *,
        signer: Signer | None = None,
        clock: Callable[[], str] = utc_now_iso,
    ) -> None:
        self.store = store
        self.run = run
        self.publisher_id = publisher_id
        self.signer = signer
        self._clock = clock

    def fenced_off(self, version: int, existing: bytes | None) -> ConflictError:
        """The error for a version someone else published first (``existing``: its manifest, if read)."""
        return ConflictError(
            f"publisher {self.publisher_id} is fenced off: v{version} of run {self.run!r} was "
            f"already published{describe(existing)}. This publisher's view is stale: resume() from the board's "
            "HEAD, or take over with publish_snapshot on top of it"
        )

    def upload(self, folder: str, files: Iterable[tuple[str, bytes]]) -> list[Part]:
        """Put ``files`` in a fresh attempt folder under ``folder`` and make them durable."""
        attempt = new_attempt_id()
        parts: list[Part] = []
        for name, data in files:
            rel = f"{attempt}/{name}"
            self.store.put(f"{folder}/{rel}", data)
            parts.append(Part(path=rel, size=len(data), hash=content_hash(data)))
        self.store.make_durable([f"{folder}/{p.path}" for p in parts])
        return parts

    def publish(
        self,
        folder: str,
        parts: Sequence[Part],
        kind: Kind,
        version: int,
        base: tuple[int, str] | None,
        target_view_fp: str,
        served_format: str,
        meta: Meta,
        *,
        existing: Callable[[], Manifest] | None = None,
    ) -> Manifest:
        """Create the manifest of durable ``parts`` (relative to ``folder``), create-only. Without ``existing``
        it is a version's and fences (the first creator wins, the others get ConflictError); with it, the
        artifact is idempotent: one with the same end views already there is read by ``existing()`` and returned.
        """
        if not parts:
            raise BoardError(f"nothing to publish for {kind.value} v{version}: no parts")
        m = Manifest(
            run=self.run,
            version=version,
            kind=kind,
            base_version=base[0] if base else None,
            target_version=version,
            base_view_fp=base[1] if base else None,
            target_view_fp=target_view_fp,
            served_format=served_format,
            parts=tuple(parts),
            created=self._clock(),
            publisher=self.publisher_id,
            meta=dict(meta),
        )
        if self.signer is not None:
            m = self.signer.sign(m)
        payload = m.to_json().encode("ascii")
        written = [f"{folder}/{path}" for p in parts for path, _ in p.objects]
        try:
            self._create_manifest(f"{folder}/{MANIFEST}", payload, written, version=version, fence=existing is None)
        except ConflictError:
            if existing is None:
                raise
            other = existing()
            if (other.base_view_fp, other.target_view_fp) != (m.base_view_fp, m.target_view_fp):
                raise
            return other
        where = f"{self.store.url}/{folder}"
        log.info("published %s v%d (%d parts, %d bytes) to %s", kind.value, version, len(parts), m.total_size, where)
        return m

    def _create_manifest(self, path: str, payload: bytes, written: list[str], *, version: int, fence: bool) -> None:
        """Create the manifest once; the store retries a transient failure within its own bounds (a retried
        create whose earlier try landed reports a conflict, so a conflict is read back and compared)."""
        try:
            self.store.put(path, payload, create_only=True)
            return
        except ConflictError as e:
            failure: BoardError = e
        except PermanentStoreError:
            raise  # refused: nothing was created, and trying again will not help
        except StoreError as e:
            # The last try may still have landed (a timeout). Never delete parts here: a late-landing manifest
            # would then point at nothing. Read it back once.
            failure = e
        existing = self.read_existing(path)
        if existing == payload:
            return  # an earlier try of ours landed after all
        if existing is None and not isinstance(failure, ConflictError):
            raise type(failure)(
                f"{failure}. v{version} of run {self.run!r} is not published; its parts stay until retention "
                "removes them"
            ) from failure
        # Someone else's manifest: our parts are unreferenced, so removing them is safe.
        self._cleanup(written)
        if not fence:
            raise ConflictError(f"{self.store.url}/{path} already exists") from None
        raise self.fenced_off(version, existing) from None

    def read_existing(self, path: str) -> bytes | None:
        try:
            return self.store.get(path)
        except NotFoundError:
            return None
        except StoreError as e:
            log.warning("cannot read back %s: %s", path, e)
            return None

    def _cleanup(self, written: list[str]) -> None:
        try:
            self.store.delete(written)
        except StoreError as e:  # retention removes unreferenced parts later
            log.warning("could not remove %d unreferenced parts: %s", len(written), e)


def describe(raw: bytes | None) -> str:
    """Who published the manifest ``raw`` (empty when there is none), for a fenced-off message."""
    if raw is None:
        return ""
    try:
        m = Manifest.from_json(raw)
    except IntegrityError:
        return " (its manifest is unreadable)"
    return f" by {m.publisher} at {m.created} (view {m.target_view_fp[:16]})"
