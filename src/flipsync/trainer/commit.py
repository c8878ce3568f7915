"""One rank's half of publishing a sharded version: upload its part.

In a sharded trainer every rank uploads its own part of a version to the version's attempt folder (chosen by
rank 0), makes it durable, and reports the part's manifest entry (path, size, BLAKE3). Rank 0 then commits
the version with the board's ``Publisher.commit_uploaded_patch``, which checks that every part is there and
creates the manifest with the same fences as ``publish_patch``.
"""

from __future__ import annotations

from flipsync.board import content_hash
from flipsync.board.store import Store
from flipsync.domain.manifest import Part


def part_name(rank: int) -> str:
    return f"patch-{rank:05d}.safetensors"


def upload_part(store: Store, version_dir: str, attempt: str, rank: int, data: bytes) -> Part:
    """Upload one rank's part of a version and make it durable; return its manifest entry."""
    rel = f"{attempt}/{part_name(rank)}"
    path = f"{version_dir}/{rel}"
    store.put(path, data)
    store.make_durable([path])
    return Part(path=rel, size=len(data), hash=content_hash(data))
