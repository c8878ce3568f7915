"""Commit a version whose parts several processes uploaded.

`flipsync.board.Publisher.publish_patch` uploads the parts itself, then creates the manifest. In a sharded
trainer every rank uploads its own part to the version's attempt folder (chosen by rank 0), makes it
durable, and reports its path, size and BLAKE3 hash; rank 0 then creates the manifest listing them all.
`PartsPublisher` adds that second half to the board's publisher, with the same fences as ``publish_patch``:
the base must be HEAD (else ConflictError), the manifest is created create-only, and a loser's parts are
deleted. Everything else (snapshots, keyframes, spans, resume, cadence) is the board's own code.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from flipsync.board import Publisher as BoardPublisher
from flipsync.board import content_hash
from flipsync.board.layout import MANIFEST
from flipsync.board.publish import Meta
from flipsync.board.store import Store
from flipsync.domain.manifest import Kind, Manifest, Part
from flipsync.errors import BoardError

log = logging.getLogger(__name__)


def part_name(rank: int) -> str:
    return f"patch-{rank:05d}.safetensors"


def upload_part(store: Store, version_dir: str, attempt: str, rank: int, data: bytes) -> Part:
    """Upload one rank's part of a version and make it durable; return its manifest entry."""
    rel = f"{attempt}/{part_name(rank)}"
    path = f"{version_dir}/{rel}"
    store.put(path, data)
    store.make_durable([path])
    return Part(path=rel, size=len(data), hash=content_hash(data))


class PartsPublisher(BoardPublisher):
    """The board's Publisher, plus committing a patch version from parts that are already uploaded."""

    def commit_uploaded_patch(
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
        """Create version ``target_version``'s manifest over ``parts`` (durable, in its version folder)."""
        self._check_patch_on_head(base_version, target_version, base_view_fp, served_format)
        if not parts:
            raise BoardError(f"nothing to publish for v{target_version}: no parts")
        folder = self.layout.version_dir(target_version)
        m = Manifest(
            run=self.run,
            version=target_version,
            kind=Kind.PATCH,
            base_version=base_version,
            target_version=target_version,
            base_view_fp=base_view_fp,
            target_view_fp=target_view_fp,
            served_format=served_format,
            parts=tuple(parts),
            created=self._clock(),
            publisher=self.publisher_id,
            meta={**(meta or {}), "origin": self._origin if self._origin is not None else 0},
        )
        if self.signer is not None:
            m = self.signer.sign(m)
        written = [f"{folder}/{p.path}" for p in parts]
        self._create_manifest(
            f"{folder}/{MANIFEST}", m.to_json().encode("ascii"), written, version=target_version, fence=True
        )
        log.info("published patch v%d from %d uploaded parts (%d bytes)", target_version, len(parts), m.total_size)
        self._advance_patch(m)
        return m
