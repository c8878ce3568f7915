"""Squash a chain of patches v -> v+1 -> ... -> v+k into one patch v -> v+k, without the base tensors.

Steps compose by addition in order-key space, so two steps at one position merge into their sum (and
vanish when they cancel); a raw value overrides what came before it, and steps after a raw value move
that raw value. Positions touched by both kinds become a ``mixed`` section. Fingerprints compose too: the
squashed section keeps the first base and the last target.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numba
import numpy as np
import torch

from flipsync.codec.bits import bits_numpy, from_key, to_key
from flipsync.codec.patch import Patch, PatchBuilder, TensorChange, check_decoded_size
from flipsync.errors import PatchError


@numba.njit(nogil=True, cache=True)
def _merge_sorted(
    a_pos: np.ndarray,
    a_val: np.ndarray,
    a_raw: np.ndarray,
    b_pos: np.ndarray,
    b_val: np.ndarray,
    b_raw: np.ndarray,
    out_pos: np.ndarray,
    out_val: np.ndarray,
    out_raw: np.ndarray,
) -> int:
    """Merge two sorted, unique position lists (``a`` then ``b``) into ``out``; return how many were kept.

    One linear pass over both (a sort-based union costs O(n log n) and three sorts). An empty raw array
    means "no raw values". b's raw value wins; otherwise b's step adds to a's value, keeping a's kind; a step
    chain that cancels out is dropped (the element ends as it was).
    """
    na, nb = a_pos.shape[0], b_pos.shape[0]
    a_has_raw, b_has_raw = a_raw.shape[0] > 0, b_raw.shape[0] > 0
    i = j = n = 0
    while i < na or j < nb:
        if j == nb or (i < na and a_pos[i] < b_pos[j]):
            p, v, r = a_pos[i], a_val[i], a_has_raw and a_raw[i]
            i += 1
        elif i == na or b_pos[j] < a_pos[i]:
            p, v, r = b_pos[j], b_val[j], b_has_raw and b_raw[j]
            j += 1
        else:
            p = a_pos[i]
            if b_has_raw and b_raw[j]:
                v, r = b_val[j], True
            else:
                v, r = a_val[i] + b_val[j], a_has_raw and a_raw[i]  # int64 wraps, as numpy's add does
            i += 1
            j += 1
        if r or v != 0:
            out_pos[n], out_val[n], out_raw[n] = p, v, r
            n += 1
    return n


def _merge(a: TensorChange, b: TensorChange) -> TensorChange:
    """``a`` then ``b`` on the same tensor."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise PatchError(f"tensor {a.name!r} changes layout inside the chain; squash cannot merge it")
    size = a.n + b.n
    positions, values, raw = np.empty(size, np.int64), np.empty(size, np.int64), np.empty(size, np.bool_)
    n = _merge_sorted(
        np.ascontiguousarray(a.positions, np.int64),
        np.ascontiguousarray(a.values, np.int64),
        np.zeros(0, np.bool_) if a.raw is None else np.ascontiguousarray(a.raw, np.bool_),
        np.ascontiguousarray(b.positions, np.int64),
        np.ascontiguousarray(b.values, np.int64),
        np.zeros(0, np.bool_) if b.raw is None else np.ascontiguousarray(b.raw, np.bool_),
        positions,
        values,
        raw,
    )
    raw = raw[:n]
    return TensorChange(
        name=a.name,
        dtype=a.dtype,
        shape=a.shape,
        positions=positions[:n],
        values=values[:n],
        raw=raw if raw.any() else None,
        # both ends or neither: a compact header leaves them to the view fingerprints
        base_fp=a.base_fp if b.target_fp is not None else None,
        target_fp=b.target_fp if a.base_fp is not None else None,
        target_digest=b.target_digest,
    )


def _after(bits: np.ndarray, change: TensorChange) -> np.ndarray:
    """A tensor's bits (flat) once ``change`` is applied to them."""
    out = bits.copy()
    old = to_key(bits[change.positions], change.dtype)
    out[change.positions] = from_key(change.new_keys(old), change.dtype)
    return out


def squash(
    patches: Sequence[Patch], *, max_decoded_bytes: int | None = None, base: Mapping[str, torch.Tensor] | None = None
) -> Patch:
    """One patch equivalent to applying ``patches`` in order; refuses a broken chain.

    ``max_decoded_bytes``: for patches from elsewhere (``flipsync squash`` passes
    ``DEFAULT_MAX_DECODED_BYTES``), refuse with CorruptPatchError, before decoding, a chain whose headers
    declare more changes than that much decoded memory holds: no tensors bound the declared counts here.
    None (a publisher squashing what it built itself): no cap.

    ``base``: the view the first patch applies to, needed when a section's positions are coded against its
    base (``ctx``); the tensors those sections touch are then followed through the chain (a copy of each).
    """
    if not patches:
        raise PatchError("squash needs at least one patch")
    if max_decoded_bytes is not None:
        check_decoded_size(patches, max_decoded_bytes)
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
    current: dict[str, np.ndarray] = {}  # bits of the tensors followed for ctx sections, at the next patch's base
    for p in patches:
        for section in p.sections:
            name = section.name
            if name not in current and p.section_needs_base(name) and base is not None and name in base:
                start = bits_numpy(base[name].detach().contiguous()).reshape(-1)
                current[name] = _after(start, merged[name]) if name in merged else start.copy()
            change = p.change(name, current.get(name))
            if name in current:
                current[name] = _after(current[name], change)
            merged[name] = _merge(merged[name], change) if name in merged else change
    builder = PatchBuilder()
    for name in sorted(merged):
        change = merged[name]
        if change.n == 0 and (change.base_fp is None or change.base_fp == change.target_fp):
            continue
        if change.n == 0:
            raise PatchError(f"tensor {name!r} returns to its base bits but its fingerprints disagree")
        builder.add(change)
    return builder.build(base=patches[0].header.base, target=patches[-1].header.target, served_format=formats.pop())
