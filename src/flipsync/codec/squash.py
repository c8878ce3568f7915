"""Join patches into one: squash a chain v -> ... -> v+k without the base tensors (steps add in order-key space;
a raw value overrides what came before it, and later steps move it), and ``join_parts`` for a version's parts."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from flipsync.codec.bits import bits_numpy, from_key, to_key
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.codec.jit import kernel
from flipsync.codec.patch import Patch, check_decoded_size
from flipsync.codec.section import TensorChange
from flipsync.domain.headers import ViewRef
from flipsync.errors import CorruptPatchError, PatchError


@kernel
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
    """Merge sorted unique position lists ``a`` then ``b`` into ``out`` (an empty raw array: none raw); returns
    how many were kept. b's raw value wins; else b's step adds to a's value, keeping a's kind (a 0 step: dropped)."""
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
    n = _merge_sorted(*_columns(a), *_columns(b), positions, values, raw)
    raw = raw[:n]
    return TensorChange(a.name, a.dtype, a.shape, positions[:n], values[:n], raw if raw.any() else None)


def _columns(c: TensorChange) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``_merge_sorted``'s view of a change: contiguous int64 positions and values, raw flags (empty: none)."""
    raw = np.zeros(0, np.bool_) if c.raw is None else np.ascontiguousarray(c.raw, np.bool_)
    return np.ascontiguousarray(c.positions, np.int64), np.ascontiguousarray(c.values, np.int64), raw


def _after(bits: np.ndarray, change: TensorChange) -> np.ndarray:
    """A tensor's bits (flat) once ``change`` is applied to them."""
    out = bits.copy()
    old = to_key(bits[change.positions], change.dtype)
    out[change.positions] = from_key(change.new_keys(old), change.dtype)
    return out


def squash(
    patches: Sequence[Patch], *, max_decoded_bytes: int | None = None, base: Mapping[str, torch.Tensor] | None = None
) -> Patch:
    """One patch equivalent to applying ``patches`` in order; refuses a broken chain. ``max_decoded_bytes``:
    refuse (CorruptPatchError, before decoding) a chain declaring more changes than that much memory holds.
    ``base``: the view the first patch applies to, needed for ``ctx`` sections (followed through the chain)."""
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
    # a tensor whose changes cancel out is left out (from_changes drops empty changes); the view fingerprints
    # at both ends vouch for the result when it is staged
    return Patch.from_changes(
        (merged[name] for name in sorted(merged)),
        base=patches[0].header.base,
        target=patches[-1].header.target,
        served_format=formats.pop(),
    )


def join_parts(
    parts: Sequence[Patch],
    *,
    target: ViewRef | None = None,
    table: FingerprintTable | None = None,
    base: Mapping[str, torch.Tensor] | None = None,
) -> Patch:
    """One patch from the parts of one version (a chain, or shards of one view, which end at ``target``);
    CorruptPatchError if they are not. ``table``: the receiver's tensors, whose layouts every section must
    match before anything is decoded (only real shapes bound the declared counts). ``base``: as for `squash`."""
    if not parts:
        raise CorruptPatchError("a version needs at least one part")
    if table is not None:
        for s in (s for part in parts for s in part.header.sections):
            tid = table.get(s.name)
            if tid is None or tid.dtype != s.dtype or tuple(tid.shape) != tuple(s.shape):
                have = "no such tensor" if tid is None else f"{tid.dtype} {list(tid.shape)}"
                raise CorruptPatchError(
                    f"a part changes tensor {s.name!r} as {s.dtype} {list(s.shape)}, but the receiver holds {have} "
                    "(a patch never changes layout: this one is for another model, or crafted)"
                )
    if len(parts) == 1:
        return parts[0]
    if all(a.header.target.view == b.header.base.view for a, b in itertools.pairwise(parts)):
        if base is None and any(p.needs_base for p in parts):
            raise PatchError(
                "the parts code positions against their base values (ctx), so joining them needs the tensors "
                "they apply to: pass the receiver's view as base"
            )
        try:
            return squash(parts, base=base)
        except PatchError as e:
            raise CorruptPatchError(f"the parts do not squash into one patch: {e}") from None
    first = parts[0].header.base
    if target is None or any(p.header.base.view != first.view for p in parts):
        raise CorruptPatchError(f"the {len(parts)} parts neither form a chain nor are shards of one view")
    try:
        return Patch.merge_disjoint(parts, base=first, target=target, served_format=parts[0].header.served_format)
    except PatchError as e:
        raise CorruptPatchError(str(e)) from None
