"""`BoardWriter` decides what is published (versions, keyframes, spans) and fences off a publisher whose base is
not HEAD, so HEAD only moves forward; one thread. See docs/board.md ("Publish protocol")."""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from flipsync.board.cadence import KeyframePolicy, SpanPolicy
from flipsync.board.cadence_state import CadenceState, CadenceTracker
from flipsync.board.catalog import Catalog
from flipsync.board.keyframes import DEFAULT_MAX_SHARD_BYTES, iter_keyframe_files
from flipsync.board.layout import part_name
from flipsync.board.protocol import ArtifactWriter, Meta
from flipsync.board.signing import Signer
from flipsync.domain.manifest import Kind, Manifest, Part, check_name, utc_now_iso
from flipsync.errors import BoardError, ConflictError, IntegrityError, NotFoundError, StoreError
from flipsync.stores import Store

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class BoardWriter:
    """Publishes one run's versions, keyframes and spans to a board."""

    def __init__(
        self,
        store: Store,
        run: str,
        *,
        publisher_id: str | None = None,
        signer: Signer | None = None,
        keyframe_policy: KeyframePolicy | None = None,
        span_policy: SpanPolicy | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        clock: Callable[[], str] = utc_now_iso,
    ) -> None:
        self.store = store
        self.catalog = Catalog(store, run)
        self.layout = self.catalog.layout
        self.run = run
        host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())[:80] or "host"
        self.publisher_id = check_name(publisher_id or f"{host}-{os.getpid()}", "publisher id")
        self.keyframe_policy = keyframe_policy or KeyframePolicy()
        self.span_policy = span_policy or SpanPolicy()
        self.max_shard_bytes = max_shard_bytes
        self._cadence = CadenceTracker(self.catalog, self.keyframe_policy, self.span_policy)
        self._artifacts = ArtifactWriter(store, run, self.publisher_id, signer=signer, clock=clock)
        self._head: Manifest | None = None
        self._resumed = False

    # -- state ----------------------------------------------------------------------------------------

    @property
    def head(self) -> Manifest | None:
        """The newest version this publisher knows of (after resume() or its own last publish)."""
        return self._head

    @property
    def cadence(self) -> CadenceState:
        """What the keyframe policy looks at now (`flipsync.board.cadence_state`)."""
        return self._cadence.state

    def resume(self) -> Manifest | None:
        """Read the board's HEAD and the keyframe cadence state; return the HEAD manifest (None: empty run)."""
        v = self.catalog.discover_head(self._head.version if self._head is not None else None)
        self._resumed = True
        self._head = self.catalog.version(v) if v is not None else None
        self._cadence.resume(self._head)
        if v is not None:
            log.info("publisher %s resumed run %s at v%d", self.publisher_id, self.run, v)
        return self._head

    def _ensure_resumed(self) -> None:
        if not self._resumed:
            self.resume()

    def keyframe_due(self) -> bool:
        """Whether the policy asks for a keyframe of the current HEAD now."""
        return self._cadence.keyframe_due()

    def spans_due(self, version: int | None = None) -> list[tuple[int, int]]:
        """The (base, target) spans the policy asks to squash after ``version`` (default: HEAD)."""
        if version is None:
            version = self._head.version if self._head is not None else None
        return [] if version is None else self._cadence.spans_due(version)

    # -- publishing ------------------------------------------------------------------------------------

    def publish_patch(
        self,
        parts: Sequence[bytes],
        *,
        base_version: int,
        target_version: int,
        base_view_fp: str,
        target_view_fp: str,
        served_format: str,
        meta: Meta | None = None,
    ) -> Manifest:
        """Publish version ``target_version`` as a patch on top of HEAD; return its manifest. ConflictError:
        this publisher is fenced off (its base is not the board's HEAD)."""
        self._check_patch_on_head(base_version, target_version, base_view_fp, served_format)
        if self.catalog.has_version(target_version):
            # Cheap early fence: do not upload parts for a version that already exists.
            raise self._artifacts.fenced_off(
                target_version, self._artifacts.read_existing(self.layout.version_manifest(target_version))
            )
        files = [(part_name(i), data) for i, data in enumerate(parts)]
        uploaded = self._artifacts.upload(self.layout.version_dir(target_version), files)
        return self._publish_patch(
            uploaded, (base_version, base_view_fp), target_version, target_view_fp, served_format, meta
        )

    def publish_uploaded_patch(
        self,
        parts: Sequence[Part],
        *,
        base_version: int,
        target_version: int,
        base_view_fp: str,
        target_view_fp: str,
        served_format: str,
        meta: Meta | None = None,
    ) -> Manifest:
        """``publish_patch`` for parts other processes already uploaded under ``layout.version_dir(target_version)``
        and made durable (sharded training, docs/board.md), with its fences. Every part must be on the board with
        its recorded size (one listing; readers check the hashes), else nothing is created."""
        self._check_patch_on_head(base_version, target_version, base_view_fp, served_format)
        folder = self.layout.version_dir(target_version)
        on_board = {o.path: o.size for o in self.store.list(folder)}
        objects = [o for p in parts for o in p.objects]
        missing = [path for path, _ in objects if f"{folder}/{path}" not in on_board]
        if missing:
            raise NotFoundError(
                f"cannot publish v{target_version} of run {self.run!r}: {len(missing)} of {len(objects)} part "
                f"objects are not on the board ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''} "
                f"under {self.store.url}/{folder}). Upload every part and make it durable before publishing"
            )
        for path, expected in objects:
            size = on_board[f"{folder}/{path}"]
            if size != expected:
                raise IntegrityError(
                    f"cannot publish v{target_version} of run {self.run!r}: part object {path} is {size} bytes on "
                    f"the board, not the {expected} bytes reported for it"
                )
        return self._publish_patch(
            parts, (base_version, base_view_fp), target_version, target_view_fp, served_format, meta
        )

    def _check_patch_on_head(
        self, base_version: int, target_version: int, base_view_fp: str, served_format: str
    ) -> None:
        """A patch version goes from HEAD to HEAD + 1 in HEAD's format; otherwise this publisher is fenced off."""
        self._ensure_resumed()
        if target_version != base_version + 1:
            raise BoardError(
                f"a version's patch goes from v{base_version} to v{base_version + 1}, not v{target_version}; "
                "publish multi-version patches with publish_span"
            )
        head = self._head
        if head is None:
            raise ConflictError(
                f"run {self.run!r} has no version yet, so there is no v{base_version} to patch: "
                "publish a snapshot first"
            )
        if base_version != head.version or base_view_fp != head.target_view_fp:
            raise ConflictError(
                f"publisher {self.publisher_id} is fenced off: its base is v{base_version} "
                f"(view {base_view_fp[:16]}), but the board's HEAD is v{head.version} "
                f"(view {head.target_view_fp[:16]}, published by {head.publisher} at {head.created}). "
                "Another trainer is publishing, or this one restarted from an older state: "
                "resume from HEAD's view, or take over with publish_snapshot"
            )
        if served_format != head.served_format:
            raise BoardError(
                f"served format {served_format!r} differs from HEAD's {head.served_format!r}; "
                "changing the format needs a snapshot"
            )

    def _publish_patch(
        self, parts: Sequence[Part], base: tuple[int, str], version: int, view_fp: str, fmt: str, meta: Meta | None
    ) -> Manifest:
        """Create a checked patch version's manifest; HEAD moves to it, lengthening the chain since the keyframe."""
        meta = {**(meta or {}), "origin": self._cadence.lineage_origin}
        m = self._artifacts.publish(
            self.layout.version_dir(version), parts, Kind.PATCH, version, base, view_fp, fmt, meta
        )
        self._advance(m)
        self._cadence.patch_published(m)
        return m

    def publish_snapshot(
        self,
        tensors: Mapping[str, torch.Tensor],
        *,
        version: int,
        view_fp: str,
        served_format: str,
        meta: Meta | None = None,
    ) -> Manifest:
        """Publish ``version`` = HEAD + 1 (0 on an empty run) as a full view: a run's first version, or a takeover."""
        self._ensure_resumed()
        head = self._head
        expected = 0 if head is None else head.version + 1
        if version != expected:
            # Fixing the number makes the create-only manifest a fence for the first version too.
            where = "the run is empty" if head is None else f"the board's HEAD is v{head.version}"
            raise ConflictError(
                f"publisher {self.publisher_id} is fenced off: a snapshot must be v{expected} ({where}), not v{version}"
            )
        meta = {**(meta or {}), "origin": version}
        m = self._publish_keyframe(self.layout.version_dir(version), tensors, version, view_fp, served_format, meta)
        self._advance(m)
        self._cadence.snapshot_published(m)
        return m

    def publish_keyframe(
        self, tensors: Mapping[str, torch.Tensor], *, version: int, view_fp: str, served_format: str
    ) -> Manifest:
        """Publish an extra keyframe of an already published version; idempotent (an existing one is returned)."""
        self._ensure_resumed()
        vm = self.catalog.version(version)
        if vm.target_view_fp != view_fp or vm.served_format != served_format:
            raise IntegrityError(
                f"the keyframe's view {view_fp[:16]} ({served_format}) is not v{version}'s view "
                f"{vm.target_view_fp[:16]} ({vm.served_format}); refusing to publish it"
            )
        if vm.kind is Kind.KEYFRAME:
            return vm  # the version is a snapshot: it is its own keyframe
        folder = self.layout.keyframe_dir(version)
        m = self._publish_keyframe(
            folder, tensors, version, view_fp, served_format, {}, existing=lambda: self.catalog.keyframe(version)
        )
        self._cadence.keyframe_published(m, self._head.version if self._head is not None else m.version)
        return m

    def publish_span(
        self,
        parts: Sequence[bytes],
        *,
        base_version: int,
        target_version: int,
        base_view_fp: str,
        target_view_fp: str,
        served_format: str,
        meta: Meta | None = None,
    ) -> Manifest:
        """Publish a squashed patch between two published versions; idempotent (an existing one is returned)."""
        for v, fp, end in ((base_version, base_view_fp, "base"), (target_version, target_view_fp, "target")):
            vm = self.catalog.version(v)
            if vm.target_view_fp != fp:
                raise IntegrityError(
                    f"the span's {end} view {fp[:16]} is not v{v}'s view {vm.target_view_fp[:16]}; "
                    "refusing to publish it"
                )
        folder = self.layout.span_dir(base_version, target_version)
        files = [(f"span-{i:05d}.safetensors", data) for i, data in enumerate(parts)]
        return self._artifacts.publish(
            folder,
            self._artifacts.upload(folder, files),
            Kind.SPAN,
            target_version,
            (base_version, base_view_fp),
            target_view_fp,
            served_format,
            dict(meta or {}),
            existing=lambda: self.catalog.span(base_version, target_version),
        )

    # -- internals ------------------------------------------------------------------------------------

    def _publish_keyframe(
        self,
        folder: str,
        tensors: Mapping[str, torch.Tensor],
        version: int,
        view_fp: str,
        served_format: str,
        meta: Meta,
        *,
        existing: Callable[[], Manifest] | None = None,
    ) -> Manifest:
        """Upload ``tensors`` as keyframe shards under ``folder`` and publish them (``existing``: see
        ``ArtifactWriter.publish``)."""
        parts = self._artifacts.upload(folder, iter_keyframe_files(tensors, self.max_shard_bytes))
        meta = {**meta, "tensors": len(tensors)}
        return self._artifacts.publish(
            folder, parts, Kind.KEYFRAME, version, None, view_fp, served_format, meta, existing=existing
        )

    def _advance(self, m: Manifest) -> None:
        self._head = m
        hint = json.dumps({"version": m.version, "publisher": m.publisher, "created": m.created})
        try:
            self.store.put(self.layout.latest, hint.encode())
        except StoreError as e:  # only a hint: readers find HEAD without it
            log.warning("could not update the HEAD hint to v%d: %s", m.version, e)
