"""Find the elements whose bit patterns differ between two tensors. CPU: a numba kernel XORs 64-bit words, in
chunks on every core (dense chunks: a branch-free compaction). CUDA: chunked torch ops."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from numba.cpython.unsafe.numbers import trailing_zeros

from flipsync.codec.bits import dtype_of, int_view
from flipsync.codec.jit import kernel
from flipsync.errors import PatchError

CHUNK_BYTES = 8 << 20  # per task: small enough to balance the cores, large enough to amortise dispatch
MIN_CHUNK_BYTES = 1 << 20
_CUDA_CHUNK = 1 << 26

DENSE_FRACTION = 0.08  # above this, numpy's vectorised compare-and-compact beats the sparse kernel
_PROBE_WORDS = 4096  # words scanned to estimate a chunk's density


@kernel
def _changed_lanes(
    a: np.ndarray,
    b: np.ndarray,
    lane_bits: int,
    out: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    values: bool,
) -> int:
    """Write the lane indices (relative to a[0]) of differing lanes of uint64 words a, b into out; with
    ``values``, also their old and new patterns (already in registers: spares the caller a gather per change).
    In a differing word every lane is folded onto its lowest bit (SWAR), and only the set bits are visited."""
    lanes = 64 // lane_bits
    low = np.uint64(0)
    for i in range(lanes):
        low |= np.uint64(1) << np.uint64(i * lane_bits)
    lane_mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - lane_bits)
    lane_shift = 0
    while (1 << lane_shift) < lane_bits:
        lane_shift += 1
    n = 0
    for w in range(a.shape[0]):
        x = a[w] ^ b[w]
        if x != 0:
            s = lane_bits >> 1
            while s > 0:
                x |= x >> np.uint64(s)
                s >>= 1
            x &= low
            base = w * lanes
            while x != 0:
                at = np.int64(trailing_zeros(x))  # the lane's lowest bit
                out[n] = base + (at >> lane_shift)
                if values:
                    old[n] = (a[w] >> np.uint64(at)) & lane_mask
                    new[n] = (b[w] >> np.uint64(at)) & lane_mask
                n += 1
                x &= x - np.uint64(1)
    return n


@dataclass(frozen=True)
class Changes:
    """The elements whose bit patterns differ between two tensors, with both patterns."""

    positions: np.ndarray  # sorted int64 flat indices
    old: np.ndarray  # the bit patterns before (unsigned, the element's width)
    new: np.ndarray  # and after

    @property
    def size(self) -> int:
        return int(self.positions.size)

    @property
    def nbytes(self) -> int:
        return self.positions.nbytes + self.old.nbytes + self.new.nbytes


_Found = tuple[np.ndarray, np.ndarray | None, np.ndarray | None]  # positions, and old, new when asked


# One pool thread's kernel output buffers for chunks of one element size, reused across chunks: chunk-relative
# int32 indices, old and new patterns.
_Scratch = tuple[np.ndarray, np.ndarray, np.ndarray]


@kernel
def _dense_lanes(a: np.ndarray, b: np.ndarray, out: np.ndarray, old: np.ndarray, new: np.ndarray, values: bool) -> int:
    """The indices of differing elements of a, b (element-typed) into out, and with ``values`` their patterns:
    branch-free compaction, faster than the word-skipping kernel once a tenth or more of the elements change."""
    n = 0
    for i in range(a.shape[0]):
        x, y = a[i], b[i]
        out[n] = i
        if values:
            old[n] = x
            new[n] = y
        n += x != y
    return n


@kernel
def _widen(rel: np.ndarray, first: int) -> np.ndarray:
    """Chunk-relative int32 indices -> absolute int64 positions, in one pass (faster than numpy's add)."""
    out = np.empty(rel.shape[0], dtype=np.int64)
    for i in range(rel.shape[0]):
        out[i] = rel[i] + first
    return out


class DiffEngine:
    """Finds changed elements; holds the thread pool so repeated diffs do not re-create it."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads or os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="flipsync-diff")
        self._local = threading.local()  # one set of kernel output buffers per pool thread and element size

    def _scratch(self, chunk_bytes: int, esize: int) -> _Scratch:
        bufs: dict[int, _Scratch] = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(esize)
        if buf is None or buf[0].shape[0] < chunk_bytes // esize:
            count, dt = chunk_bytes // esize, _uint_np(esize)
            buf = bufs[esize] = (np.empty(count, np.int32), np.empty(count, dt), np.empty(count, dt))
        return buf

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> DiffEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def changed_positions(self, old: torch.Tensor, new: torch.Tensor) -> np.ndarray:
        """Sorted int64 flat indices where the bit patterns of ``old`` and ``new`` differ."""
        return self.changed_positions_many([(old, new)])[0]

    def changed_positions_many(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[np.ndarray]:
        """``changed_positions`` of several pairs at once: small tensors share the pool (every core is used)."""
        return [positions for positions, _, _ in self._find(pairs, values=False)]

    def changes(self, old: torch.Tensor, new: torch.Tensor) -> Changes:
        """The changed positions of ``old`` and ``new`` with the bit patterns on both sides, from one scan."""
        return self.changes_many([(old, new)])[0]

    def changes_many(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[Changes]:
        """``changes`` of several pairs at once (see `changed_positions_many`)."""
        return [Changes(p, o, n) for p, o, n in self._find(pairs, values=True)]  # type: ignore[arg-type]

    def _find(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], values: bool) -> list[_Found]:
        for old, new in pairs:
            if old.shape != new.shape or old.dtype != new.dtype:
                raise PatchError(
                    f"cannot diff tensors of different layouts: {tuple(old.shape)} {old.dtype} "
                    f"vs {tuple(new.shape)} {new.dtype}"
                )
            if old.device != new.device:
                raise PatchError(f"cannot diff tensors on different devices ({old.device} vs {new.device})")
        cpu = [(i, a, b) for i, (a, b) in enumerate(pairs) if a.device.type == "cpu"]
        total = sum(a.numel() * a.element_size() for _, a, _ in cpu)
        chunk = max(MIN_CHUNK_BYTES, min(CHUNK_BYTES, -(-total // self.threads)))
        chunk += -chunk % 64
        tasks: list[tuple[int, np.ndarray, np.ndarray, int, int, int]] = []
        for i, a, b in cpu:
            esize = dtype_of(a).bits // 8
            a8, b8 = int_view(a).numpy().view(np.uint8), int_view(b).numpy().view(np.uint8)
            tasks += [(i, a8, b8, s, min(s + chunk, a8.shape[0]), esize) for s in range(0, a8.shape[0], chunk)]

        def run(batch: list[tuple[int, np.ndarray, np.ndarray, int, int, int]]) -> list[_Found]:
            return [_span_changes(*t[1:], self._scratch(chunk, t[5]), values) for t in batch]

        # Small tensors go to the pool several to a job: a job costs tens of microseconds to hand over.
        batches: list[list[tuple[int, np.ndarray, np.ndarray, int, int, int]]] = []
        held = chunk
        for t in tasks:
            if held + (t[4] - t[3]) > chunk:
                batches.append([])
                held = 0
            batches[-1].append(t)
            held += t[4] - t[3]
        done = self._pool.map(run, batches) if len(batches) > 1 else map(run, batches)
        parts: list[list[_Found]] = [[] for _ in pairs]
        for batch, found in zip(batches, done, strict=True):
            for task, f in zip(batch, found, strict=True):
                parts[task[0]].append(f)
        out: list[_Found] = []
        for i, (a, b) in enumerate(pairs):
            if a.device.type != "cpu":
                out.append(_changes_torch(a, b, values))
            else:
                out.append(_joined(parts[i]) if parts[i] else _nothing(dtype_of(a).bits // 8, values))
        return out


def _joined(parts: list[_Found]) -> _Found:
    """The changes found in consecutive spans, as one."""
    if len(parts) == 1:
        return parts[0]
    columns = zip(*parts, strict=True)
    return tuple(np.concatenate(c) if c[0] is not None else None for c in columns)  # type: ignore[return-value]


def _nothing(esize: int, values: bool) -> _Found:
    empty = np.empty(0, dtype=_uint_np(esize)) if values else None  # one zero-size array serves both sides
    return np.empty(0, dtype=np.int64), empty, empty


def _span_changes(
    a8: np.ndarray, b8: np.ndarray, start: int, stop: int, esize: int, buf: _Scratch, values: bool
) -> _Found:
    """Changed elements in bytes [start, stop): whole words by the kernel a probe picks, a short tail by numpy."""
    body = stop - (stop - start) % 8
    dt = _uint_np(esize)
    parts: list[_Found] = []
    if body > start:
        words_a, words_b = a8[start:body].view(np.uint64), b8[start:body].view(np.uint64)
        pos, old, new = (b[: (body - start) // esize] for b in buf)
        lanes = 8 // esize
        probe = min(_PROBE_WORDS, words_a.shape[0])
        n = _changed_lanes(words_a[:probe], words_b[:probe], esize * 8, pos, old, new, values)
        if n > DENSE_FRACTION * probe * lanes:
            k = _dense_lanes(a8[start:body].view(dt), b8[start:body].view(dt), pos, old, new, values)
        else:
            m = _changed_lanes(words_a[probe:], words_b[probe:], esize * 8, pos[n:], old[n:], new[n:], values)
            pos[n : n + m] += probe * lanes  # numbered from the probe's end
            k = n + m
        found = _widen(pos[:k], start // esize)
        parts.append((found, old[:k].copy(), new[:k].copy()) if values else (found, None, None))
    if body < stop:
        va, vb = a8[body:stop].view(dt), b8[body:stop].view(dt)
        rel = np.flatnonzero(va != vb)
        parts.append((rel + body // esize, va[rel], vb[rel]) if values else (rel + body // esize, None, None))
    return _joined(parts) if parts else _nothing(esize, values)


def _uint_np(esize: int) -> np.dtype:
    return np.dtype(f"<u{esize}")


def _changes_torch(old: torch.Tensor, new: torch.Tensor, values: bool) -> _Found:
    a, b = int_view(old), int_view(new)
    dt = _uint_np(dtype_of(old).bits // 8)
    parts = [_nothing(dt.itemsize, values)]
    for s in range(0, a.numel(), _CUDA_CHUNK):
        a_s, b_s = a[s : s + _CUDA_CHUNK], b[s : s + _CUDA_CHUNK]
        idx = torch.nonzero(a_s != b_s).reshape(-1)
        found = idx.cpu().numpy().astype(np.int64) + s
        parts.append(
            (found, a_s[idx].cpu().numpy().view(dt), b_s[idx].cpu().numpy().view(dt)) if values else (found, None, None)
        )
    return _joined(parts)


def changed_positions_reference(old: torch.Tensor, new: torch.Tensor) -> np.ndarray:
    """The obvious method, kept as the baseline the benchmark compares against."""
    a = int_view(old).cpu().numpy()
    b = int_view(new).cpu().numpy()
    return np.flatnonzero(a != b)
