"""Applying a version made of several parts (one per trainer rank) on a replica.

A version's parts are ordinary flipsync patches that form a chain: part 0's base is the previous version's
view, each part's target is the next part's base, and the last part's target is the version's view (the
manifest records the two ends). Each part is checked and verified by the codec as usual; the parts touch
disjoint elements (each rank diffs only its own rows or tensors).

- `apply_parts`: stage every part (decode, check the base of each against the fingerprints the parts
  before it lead to, verify targets), then commit all writes at once: all or nothing for the whole version.
- `stage_parts`: the stage half, for an engine that stages while serving and commits later with
  ``flipsync.codec.commit``.
- `join_parts`: one patch for the whole version (the codec's squash of the chain), for an engine port that
  takes a single patch.
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping, Sequence

import torch

from flipsync.codec import ApplyResult, FingerprintTable, Hasher, Patch, StagedWrite, Verify, commit, squash, stage
from flipsync.errors import PatchError

PartLike = bytes | bytearray | memoryview | Patch


def _patches(parts: Sequence[PartLike]) -> list[Patch]:
    if not parts:
        raise PatchError("a version has at least one part; got none")
    return [p if isinstance(p, Patch) else Patch.from_bytes(p) for p in parts]


def join_parts(parts: Sequence[PartLike]) -> Patch:
    """The version's parts as one patch (first base -> last target); refuses parts that are not a chain."""
    patches = _patches(parts)
    return patches[0] if len(patches) == 1 else squash(patches)


def stage_parts(
    tensors: MutableMapping[str, torch.Tensor], parts: Sequence[PartLike], table: FingerprintTable
) -> list[StagedWrite]:
    """Decode and check every part against ``tensors`` without writing; the writes for one commit.

    Each part's base is checked against the fingerprints that the parts before it lead to. A part whose
    changes overlap an earlier part's fails its target check (`VerificationError`), never silently.
    """
    virtual = table.copy()
    writes: list[StagedWrite] = []
    for patch in _patches(parts):
        staged = stage(tensors, patch, virtual)
        for w in staged:
            virtual[w.name] = w.target
        writes.extend(staged)
    return writes


def apply_parts(
    tensors: MutableMapping[str, torch.Tensor],
    parts: Sequence[PartLike],
    table: FingerprintTable,
    *,
    verify: Verify = "fingerprint",
    hasher: Hasher | None = None,
) -> ApplyResult:
    """Apply every part of a version in place, all or nothing; ``table`` ends at the version's view."""
    t0 = time.perf_counter()
    writes = stage_parts(tensors, parts, table)
    t1 = time.perf_counter()
    undo = commit(tensors, writes, table, verify=verify, hasher=hasher)
    t2 = time.perf_counter()
    return ApplyResult(
        undo=undo, n_changed=sum(int(w.positions.numel()) for w in writes), stage_s=t1 - t0, commit_s=t2 - t1
    )
