"""Squash a chain of patches v -> v+1 -> ... -> v+k into one patch v -> v+k, without the base tensors.

Steps compose by addition in order-key space, so two steps at one position merge into their sum (and
vanish when they cancel); a raw value overrides what came before it, and steps after a raw value move
that raw value. Positions touched by both kinds become a ``mixed`` section. Fingerprints compose too: the
squashed section keeps the first base and the last target.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from flipsync.codec.patch import Patch, PatchBuilder, TensorChange
from flipsync.errors import PatchError


def _merge(a: TensorChange, b: TensorChange) -> TensorChange:
    """``a`` then ``b`` on the same tensor."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise PatchError(f"tensor {a.name!r} changes layout inside the chain; squash cannot merge it")
    positions = np.union1d(a.positions, b.positions)
    in_a = np.isin(positions, a.positions, assume_unique=True)
    in_b = np.isin(positions, b.positions, assume_unique=True)
    n = positions.size
    a_val, a_raw = np.zeros(n, np.int64), np.zeros(n, bool)
    b_val, b_raw = np.zeros(n, np.int64), np.zeros(n, bool)
    a_val[in_a], b_val[in_b] = a.values, b.values
    if a.raw is not None:
        a_raw[in_a] = a.raw
    if b.raw is not None:
        b_raw[in_b] = b.raw
    # b raw wins; otherwise b's step (zero where b is absent) is added to a's value, keeping a's kind.
    values = np.where(b_raw, b_val, a_val + b_val)
    raw = b_raw | (a_raw & ~b_raw)
    keep = raw | (values != 0)  # a step chain that cancels out leaves the element as it was
    return TensorChange(
        name=a.name,
        dtype=a.dtype,
        shape=a.shape,
        positions=positions[keep],
        values=values[keep],
        raw=raw[keep] if raw.any() else None,
        base_fp=a.base_fp,
        target_fp=b.target_fp,
        target_digest=b.target_digest,
    )


def squash(patches: Sequence[Patch]) -> Patch:
    """One patch equivalent to applying ``patches`` in order; refuses a broken chain."""
    if not patches:
        raise PatchError("squash needs at least one patch")
    for prev, nxt in itertools.pairwise(patches):
        if prev.header.target.view != nxt.header.base.view:
            raise PatchError(
                f"patches do not form a chain: one ends at view {prev.header.target.view} "
                f"(version {prev.header.target.version}), the next starts at {nxt.header.base.view} "
                f"(version {nxt.header.base.version})"
            )
    formats = {p.header.served_format for p in patches}
    if len(formats) > 1:
        raise PatchError(f"patches of different served formats cannot be squashed: {sorted(map(str, formats))}")
    merged: dict[str, TensorChange] = {}
    for p in patches:
        for change in p.changes():
            merged[change.name] = _merge(merged[change.name], change) if change.name in merged else change
    builder = PatchBuilder()
    for name in sorted(merged):
        change = merged[name]
        if change.n == 0 and change.base_fp == change.target_fp:
            continue
        if change.n == 0:
            raise PatchError(f"tensor {name!r} returns to its base bits but its fingerprints disagree")
        builder.add(change)
    return builder.build(base=patches[0].header.base, target=patches[-1].header.target, served_format=formats.pop())
