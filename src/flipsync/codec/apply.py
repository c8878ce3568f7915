"""Apply a patch in place, all or nothing (docs/codec.md, "Apply: all or nothing"): check, stage, then commit
with an undo record. Everything but the optional digest check is O(changed)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from flipsync.codec.bits import KIND_CODE, DType, bits_numpy, dtype_named, dtype_of, int_view
from flipsync.codec.class_index import ClassIndex
from flipsync.codec.fingerprint import FP_SEED, MASK64, FingerprintTable, Hasher, TensorId, combine_digests, fmix64
from flipsync.codec.jit import kernel, prefetch_write
from flipsync.codec.patch import Patch
from flipsync.codec.section import Base, decode_streams
from flipsync.domain.headers import SectionHeader
from flipsync.errors import BaseMismatchError, CorruptPatchError, PatchError, VerificationError

Verify = Literal["fingerprint", "digest"]
PARALLEL_STAGE_CHANGES = 100_000  # below this, a thread pool costs more than it saves


@dataclass
class StagedWrite:
    """Ready-to-scatter buffers for one tensor: positions and the old and new bits, on its device."""

    name: str
    positions: torch.Tensor
    old_bits: torch.Tensor
    new_bits: torch.Tensor
    target: TensorId


@dataclass
class UndoRecord:
    """What a commit overwrote; ``rollback`` restores the tensors, the fingerprint table and the class index."""

    writes: list[StagedWrite] = field(default_factory=list)
    table_before: dict[str, TensorId] = field(default_factory=dict)
    index: ClassIndex | None = None

    def rollback(self, tensors: MutableMapping[str, torch.Tensor], table: FingerprintTable) -> None:
        for w in reversed(self.writes):
            scatter(tensors[w.name], w.positions, w.old_bits)
        if self.index is not None:
            _move_index(self.index, reversed(self.writes), {w.name: table[w.name] for w in self.writes},
                        self.table_before, undo=True)  # fmt: skip
            self.index = None
        table.update(self.table_before)
        self.writes.clear()


def _move_index(
    index: ClassIndex, writes: Iterable[StagedWrite], before: Mapping[str, TensorId], after: Mapping[str, TensorId],
    *, undo: bool = False,
) -> None:  # fmt: skip
    """Keep ``index`` current after ``writes`` (undone, with ``undo``): O(changed), host tensors only."""
    for w in writes:
        if w.positions.device.type != "cpu":
            index.drop(w.name)
            continue
        u = dtype_named(w.target.dtype).uint_numpy
        old, new = w.old_bits.numpy().view(u), w.new_bits.numpy().view(u)
        if undo:
            old, new = new, old
        index.moved(w.name, w.positions.numpy(), old, new, before[w.name].fp, after[w.name].fp)


@dataclass
class ApplyResult:
    undo: UndoRecord
    n_changed: int
    stage_s: float
    commit_s: float


_SCATTER_AHEAD = 32  # prefetch this many writes ahead: random stores otherwise stall on the store buffer


@kernel
def _scatter_cpu(flat: np.ndarray, positions: np.ndarray, bits: np.ndarray) -> None:
    n = positions.shape[0]
    for i in range(n):
        if i + _SCATTER_AHEAD < n:  # ~1.3x faster on tensors far larger than the cache
            prefetch_write(flat, positions[i + _SCATTER_AHEAD])  # type: ignore[call-arg]  # numba passes typingctx
        flat[positions[i]] = bits[i]


def scatter(t: torch.Tensor, positions: torch.Tensor, bits: torch.Tensor) -> None:
    """Write ``bits`` at flat ``positions`` of ``t`` in place (CPU: a compiled loop, faster than ``index_copy_``)."""
    flat = int_view(t)
    if flat.device.type == "cpu":
        _scatter_cpu(flat.numpy(), positions.numpy(), bits.numpy())
    else:
        flat.index_copy_(0, positions, bits)


def _torch_bits(bits: np.ndarray, d: DType, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits.view(d.int_numpy))).to(device)


_MODE = {"step": 0, "raw": 1, "mixed": 2}
_BLOCK = 2048  # values per kernel block: its gathered bits stay in L1 between the kernel's three loops


@kernel
def _stage_kernel(
    src: np.ndarray,
    positions: np.ndarray,
    gathered: bool,
    symbols: np.ndarray,
    raw: np.ndarray,
    mode: int,
    kind: int,
    width: int,
    old_out: np.ndarray,
    new_out: np.ndarray,
) -> tuple[int, np.uint64]:
    """Everything staging does per changed value, block by block: gather the old bits (unless ``gathered``),
    apply the zigzagged step or raw pattern through the order key (bits.to_key/from_key, truncated to
    ``width``), and accumulate the fingerprint delta. Returns (index of the first raw value wider than
    ``width``, or -1; fingerprint delta mod 2**64). Three tight loops per block rather than one fused loop: a
    bare gather loop keeps many cache misses in flight, and the others vectorise (one fused loop was 4x slower)."""
    one = np.uint64(1)
    zero = np.uint64(0)
    half = one << np.uint64(width - 1)
    mask = (half - one) | half
    top = mask  # the largest pattern of this width
    acc = zero
    n = positions.shape[0]
    for b0 in range(0, n, _BLOCK):
        b1 = min(n, b0 + _BLOCK)
        if gathered:
            for i in range(b0, b1):
                old_out[i] = src[i]
        else:
            for i in range(b0, b1):
                old_out[i] = src[positions[i]]
        if mode != 1:  # steps (for a mixed section, raw entries are overwritten below)
            if kind == 0:  # sign-magnitude float: negative patterns reversed
                for i in range(b0, b1):
                    u = np.uint64(old_out[i])
                    z = np.uint64(symbols[i])
                    key = ((top - u) if (u & half) else (u + half)) + ((z >> one) ^ (zero - (z & one)))
                    new_out[i] = ((key - half) if (key & half) else (top - key)) & mask
            elif kind == 1:  # two's complement: offset binary
                for i in range(b0, b1):
                    z = np.uint64(symbols[i])
                    new_out[i] = (((np.uint64(old_out[i]) ^ half) + ((z >> one) ^ (zero - (z & one)))) ^ half) & mask
            else:
                for i in range(b0, b1):
                    z = np.uint64(symbols[i])
                    new_out[i] = (np.uint64(old_out[i]) + ((z >> one) ^ (zero - (z & one)))) & mask
        if mode != 0:
            for i in range(b0, b1):
                if mode == 1 or raw[i]:
                    z = np.uint64(symbols[i])
                    if z & ~mask:
                        return i, acc
                    new_out[i] = z
        for i in range(b0, b1):
            h = fmix64(np.uint64(positions[i]) + FP_SEED)
            acc += fmix64(h ^ np.uint64(new_out[i])) - fmix64(h ^ np.uint64(old_out[i]))
    return -1, acc


def stage(
    tensors: MutableMapping[str, torch.Tensor],
    patch: Patch,
    table: FingerprintTable,
    *,
    check: bool = True,
    index: ClassIndex | None = None,
) -> list[StagedWrite]:
    """Decode and prepare every write without touching the tensors; verifies the target fingerprints.
    ``check=False`` skips the base check, allowed only for all-raw (idempotent overwrite) patches (verified by
    a full rehash at commit). ``index``: the receiver's class index of ``tensors`` (pass it to :func:`commit`)."""
    if not check and not patch.header.idempotent:
        raise PatchError("only overwrite-mode patches can be applied without checking their base")
    for s in patch.sections:  # layout first: the most actionable message
        if s.name not in tensors:
            raise BaseMismatchError(f"the patch changes tensor {s.name!r}, which the target tensors do not have")
        t = tensors[s.name]
        if dtype_of(t).name != s.dtype or tuple(t.shape) != s.shape:
            raise BaseMismatchError(
                f"tensor {s.name!r} is {tuple(t.shape)} {dtype_of(t).name}, the patch expects {s.shape} {s.dtype}"
            )
        if not t.is_contiguous():
            raise PatchError(f"tensor {s.name!r} is not contiguous; patches are applied to contiguous storage")
    if check and table.view_fp() != patch.header.base.view:  # reads only the fingerprint table
        version = patch.header.base.version
        raise BaseMismatchError(
            f"this patch applies to view {patch.header.base.view}"
            + (f" (version {version})" if version is not None else "")
            + f", but the tensors hold view {table.view_fp()}; fetch the patches in between or resync from a keyframe"
        )

    def prepare(s: SectionHeader) -> StagedWrite:
        t, held = tensors[s.name], table.get(s.name)
        base: Base = t  # for ctx positions on the host: its bits held by the receiver's class index
        if index is not None and held is not None and t.device.type == "cpu" and patch.section_needs_base(s.name):
            base = index.base(s.name, bits_numpy(t), dtype_named(s.dtype), held.fp)
        d, positions, symbols, raw = decode_streams(s, patch.section_blob(s.name), base)
        n = positions.size
        if n and positions[-1] >= t.numel():  # the decoders bound positions by the header's shape already
            raise CorruptPatchError(f"section {s.name!r} has positions past the end of its tensor")
        old_bits, new_bits = np.empty(n, dtype=d.uint_numpy), np.empty(n, dtype=d.uint_numpy)
        if t.device.type == "cpu":
            src, gathered = bits_numpy(t), False
        else:  # the old bits, gathered on the device
            src, gathered = int_view(t)[torch.from_numpy(positions).to(t.device)].cpu().numpy().view(d.uint_numpy), True
        raw = raw if raw is not None else np.zeros(0, dtype=bool)
        mode, kind = _MODE[s.mode], KIND_CODE[d.kind]
        bad, delta = _stage_kernel(src, positions, gathered, symbols, raw, mode, kind, d.bits, old_bits, new_bits)
        if bad >= 0:
            raise CorruptPatchError(f"section {s.name!r} has raw values wider than {d.name}")
        fp = (table[s.name].fp + int(delta)) & MASK64  # the target view check below vouches for it
        return StagedWrite(
            name=s.name,
            positions=torch.from_numpy(positions).to(t.device),
            old_bits=_torch_bits(old_bits, d, t.device),
            new_bits=_torch_bits(new_bits, d, t.device),
            target=TensorId(d.name, s.shape, fp),
        )

    # Sections are independent and their decoders release the GIL for most of the work: large patches are
    # staged on every core (reads only; the first error is raised, nothing is written either way).
    workers = min(len(patch.sections), os.cpu_count() or 1)
    if workers < 2 or patch.header.n_changed < PARALLEL_STAGE_CHANGES:
        staged = [prepare(s) for s in patch.sections]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="flipsync-stage") as pool:
            staged = list(pool.map(prepare, patch.sections))
    if check:  # every tensor matching its target is not enough: the header's target view must be what results
        after = table.copy()
        after.update({w.name: w.target for w in staged})
        if after.view_fp() != patch.header.target.view:
            target = patch.header.target
            raise VerificationError(
                f"applying this patch would give view {after.view_fp()}, not the target view {target.view}"
                + (f" (version {target.version})" if target.version is not None else "")
                + " its header names; the patch is corrupt or crafted (nothing was changed)"
            )
    return staged


def commit(
    tensors: MutableMapping[str, torch.Tensor],
    staged: list[StagedWrite],
    table: FingerprintTable,
    *,
    verify: Verify = "fingerprint",
    full_fingerprint: bool = False,
    hasher: Hasher | None = None,
    digest: str | None = None,
    index: ClassIndex | None = None,
) -> UndoRecord:
    """Scatter staged writes in place; on any failure restore every byte and re-raise. ``digest``: the patch's
    combined target digest, checked with ``verify="digest"``. ``index``: the one given to :func:`stage`."""
    undo = UndoRecord(table_before={w.name: table[w.name] for w in staged})
    with ExitStack() as own:
        h = hasher or (own.enter_context(Hasher()) if verify == "digest" or full_fingerprint else None)
        try:
            for w in staged:
                undo.writes.append(w)
                scatter(tensors[w.name], w.positions, w.new_bits)
                table[w.name] = w.target
            if full_fingerprint and h is not None:
                for w in staged:
                    table[w.name] = TensorId(w.target.dtype, w.target.shape, h.fingerprint(tensors[w.name]))
            if verify == "digest" and h is not None:
                held = {w.name: h.digest(tensors[w.name]) for w in staged}
                if digest is not None and combine_digests(held.items()) != digest:
                    raise VerificationError(
                        "the changed tensors do not match the patch's target content digest after applying; rolled back"
                    )
            if index is not None:
                _move_index(index, undo.writes, undo.table_before, table)
                undo.index = index
        except BaseException:
            undo.rollback(tensors, table)
            raise
    return undo


def apply_patch(
    tensors: MutableMapping[str, torch.Tensor],
    patch: Patch,
    table: FingerprintTable,
    *,
    verify: Verify = "fingerprint",
    check: bool = True,
    hasher: Hasher | None = None,
    index: ClassIndex | None = None,
) -> ApplyResult:
    """Apply ``patch`` to ``tensors`` in place and update ``table`` (and ``index``, see :func:`stage`)."""
    t0 = time.perf_counter()
    staged = stage(tensors, patch, table, check=check, index=index)
    t1 = time.perf_counter()
    undo = commit(
        tensors, staged, table, verify=verify, full_fingerprint=not check, hasher=hasher, digest=patch.header.digest,
        index=index,
    )  # fmt: skip
    t2 = time.perf_counter()
    return ApplyResult(
        undo=undo, n_changed=sum(int(w.positions.numel()) for w in staged), stage_s=t1 - t0, commit_s=t2 - t1
    )
