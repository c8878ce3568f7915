"""Diff served *pieces* and build the patch part of one rank.

`flipsync.codec.diff_views` diffs whole tensors. A rank of a sharded trainer holds only some rows of a
tensor, so here the changed positions of a piece are shifted by its offset into the full tensor, and its
fingerprint contribution is computed with those global positions. The codec's fingerprint is a sum over
elements, so the full tensor's fingerprint is the sum of its pieces' and a change moves it by the sum of
every rank's deltas: ranks exchange only those deltas (8 bytes per changed tensor), never tensor data.
The values themselves are coded by the codec (`TensorChange`, `PatchBuilder`) exactly as `diff_views` does,
on a thread of their own while the next piece is diffed, when the caller gives one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from flipsync.codec import (
    DiffEngine,
    FingerprintTable,
    Hasher,
    Patch,
    PatchBuilder,
    TensorChange,
    TensorId,
    bits_numpy,
    dtype_named,
    encode_change,
    fingerprint_delta,
    fingerprint_of,
    fp_hex,
    key_steps,
)
from flipsync.domain.headers import SectionHeader, ViewRef
from flipsync.errors import PatchError
from flipsync.trainer.pieces import Piece, PieceSpec

MASK = (1 << 64) - 1
_FP_CHUNK = 1 << 22  # elements per fingerprint call when positions must be materialised


@dataclass
class PieceChange:
    """The changed elements of one piece, with global positions, and its fingerprint delta."""

    name: str
    positions: np.ndarray
    old_bits: np.ndarray
    new_bits: np.ndarray
    delta: int
    digest: str | None  # content digest of the whole tensor, when this piece is the whole tensor
    coded: Future[tuple[SectionHeader, bytes]] | None = None  # its section, fingerprints left blank


Emit = Callable[[str, bytes], None]


def _code(
    name: str,
    shape: tuple[int, ...],
    positions: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    dtype: str,
    emit: Emit | None,
    base: torch.Tensor | None = None,
) -> tuple[SectionHeader, bytes]:
    """One piece's section as `build_part` would code it, with blank fingerprints (run on the coder), handed
    to ``emit`` as soon as it is coded. ``base``: the whole tensor the change applies to, on the host, to also
    try coding the positions against it (``ctx``; the replica then needs it to decode)."""
    d = dtype_named(dtype)
    change = TensorChange(name, d, shape, positions, key_steps(old, new, d), None, 0, 0)
    section, blob = encode_change(change, base)
    if emit is not None:
        emit(name, blob)
    return section, blob


def _emit_coded(work: Future[tuple[SectionHeader, bytes]], name: str, emit: Emit | None) -> tuple[SectionHeader, bytes]:
    """A section coded on the pool, handed to ``emit`` (run on the one-thread coder: in piece order)."""
    coded = work.result()
    if emit is not None:
        emit(name, coded[1])
    return coded


def piece_fingerprint(hasher: Hasher, piece: Piece) -> int:
    """This piece's share of its tensor's fingerprint (global positions)."""
    t = piece.tensor.detach().contiguous()
    if piece.offset == 0:
        return hasher.fingerprint(t)
    bits = bits_numpy(t.cpu())
    acc = 0
    for s in range(0, bits.size, _FP_CHUNK):
        e = min(bits.size, s + _FP_CHUNK)
        acc += fingerprint_of(np.arange(piece.offset + s, piece.offset + e, dtype=np.int64), bits[s:e])
    return acc & MASK


def diff_pieces(
    old: Mapping[str, Piece],
    new: Mapping[str, Piece],
    engine: DiffEngine,
    hasher: Hasher,
    coder: Executor | None = None,
    emit: Emit | None = None,
    known: Mapping[str, Any] | None = None,
    context: bool = False,
    pool: Executor | None = None,
) -> list[PieceChange]:
    """Changed elements of every piece (same layout on both sides, checked by the caller).

    While the next piece is diffed, a changed whole tensor's content digest is hashed on the hasher's pool
    and, with a ``coder``, each piece's section is coded on it (only its fingerprints wait for the other
    ranks' deltas: `build_part` fills them in) and handed to ``emit`` (name, coded bytes), in piece order.
    ``known``: changes of pieces already diffed against ``old`` (`FusedDiff`), used instead of a diff.
    ``pool``: threads that code sections side by side; the ``coder`` (one thread) then only hands them to
    ``emit`` in piece order, and without a coder `build_part` collects them.
    """
    found: list[tuple[str, np.ndarray, np.ndarray, np.ndarray, int, Callable[[], str] | None, Any]] = []
    for name in sorted(new):
        a, b = old[name], new[name]
        ta, tb = a.tensor.detach().contiguous(), b.tensor.detach().contiguous()
        changes = known.get(name) if known is not None else None
        if changes is None:
            changes = engine.changes(ta, tb)
        if not changes.size:
            continue
        positions = changes.positions + b.offset
        delta = fingerprint_delta(positions, changes.old, changes.new)
        digest = hasher.digest_soon(tb) if b.whole else None
        coded = None
        # ctx ranks are counted over the whole tensor: a row shard cannot count the rows it does not hold
        held = ta if context and a.whole and ta.device.type == "cpu" else None
        args = (name, b.shape, positions, changes.old, changes.new, b.dtype_name)
        if pool is not None:
            coded = pool.submit(_code, *args, None, held)
            if coder is not None:
                coded = coder.submit(_emit_coded, coded, name, emit)
        elif coder is not None:
            coded = coder.submit(_code, *args, emit, held)
        found.append((name, positions, changes.old, changes.new, delta, digest, coded))
    return [PieceChange(n, p, o, w, d, dg() if dg else None, c) for n, p, o, w, d, dg, c in found]


def advance(table: FingerprintTable, deltas: Mapping[str, int]) -> FingerprintTable:
    """The table after adding fingerprint deltas to the named tensors."""
    out = table.copy()
    for name, d in deltas.items():
        tid = out[name]
        out[name] = TensorId(tid.dtype, tid.shape, (tid.fp + d) & MASK)
    return out


def build_part(
    changes: list[PieceChange],
    before: FingerprintTable,
    *,
    base: ViewRef,
    target: ViewRef,
    served_format: str,
) -> Patch:
    """One rank's part: a complete flipsync patch from the view ``base`` to ``target``."""
    builder = PatchBuilder()
    for c in changes:
        tid = before[c.name]
        if c.coded is not None:
            section, blob = c.coded.result()
            if (section.dtype, tuple(section.shape)) != (tid.dtype, tuple(tid.shape)):
                raise PatchError(f"piece {c.name!r} was coded as {section.dtype} {section.shape}, not {tid}")
            base_fp, target_fp = fp_hex(tid.fp), fp_hex(tid.fp + c.delta)
            builder.add_encoded(replace(section, base_fp=base_fp, target_fp=target_fp, target_digest=c.digest), blob)
            continue
        d = dtype_named(tid.dtype)
        builder.add(
            TensorChange(
                name=c.name,
                dtype=d,
                shape=tid.shape,
                positions=c.positions,
                values=key_steps(c.old_bits, c.new_bits, d),
                raw=None,
                base_fp=tid.fp,
                target_fp=(tid.fp + c.delta) & MASK,
                target_digest=c.digest,
            )
        )
    return builder.build(base=base, target=target, served_format=served_format)


def table_of_pieces(layout: Mapping[str, PieceSpec], partials: list[dict[str, int]]) -> FingerprintTable:
    """The view's fingerprint table from every rank's piece fingerprints (summed per tensor).

    ``layout`` gives each tensor's dtype and full shape (any of its pieces' specs).
    """
    fps: dict[str, int] = {}
    for part in partials:
        for name, fp in part.items():
            fps[name] = (fps.get(name, 0) + fp) & MASK
    return FingerprintTable({name: TensorId(s.dtype, s.shape, fps.get(name, 0)) for name, s in layout.items()})
