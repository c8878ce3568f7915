"""Find the elements whose bit patterns differ between two tensors.

CPU: a single-pass numba kernel XORs 64-bit words, skips equal words and emits the lane indices of the
differing elements; the tensor is cut into chunks processed by one thread per core with the GIL released.
That runs near memory bandwidth, where ``np.flatnonzero(a != b)`` allocates a full bool temporary.
CUDA: the same answer from torch ops on the device, chunked to bound the temporary.
"""

from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch

from flipsync.codec.bits import dtype_of, int_view
from flipsync.errors import PatchError

CHUNK_BYTES = 8 << 20  # per task: small enough to balance the cores, large enough to amortise dispatch
MIN_CHUNK_BYTES = 1 << 20
_CUDA_CHUNK = 1 << 26


@numba.njit(nogil=True, cache=True)
def _emit_lanes(x: np.uint64, base: int, lanes: int, lane_bits: int, out: np.ndarray, n: int) -> int:
    # Every lane index is written; the count advances only for changed lanes (no branch per lane).
    mask = np.uint64((1 << lane_bits) - 1) if lane_bits < 64 else np.uint64(0xFFFFFFFFFFFFFFFF)
    for lane in range(lanes):
        out[n] = base + lane
        n += ((x >> np.uint64(lane * lane_bits)) & mask) != 0
    return n


@numba.njit(nogil=True, cache=True)
def _changed_lanes(a: np.ndarray, b: np.ndarray, lane_bits: int, out: np.ndarray) -> int:
    """Write the lane indices (relative to a[0]) of differing lanes of uint64 words a, b into out.

    Blocks of 8 words are OR-reduced first (a loop the compiler vectorises), so runs of equal words cost
    one SIMD compare. ``out`` must hold one slot per lane.
    """
    lanes = 64 // lane_bits
    n = 0
    nw = a.shape[0]
    nblk = nw // 8
    for blk in range(nblk):
        s = blk * 8
        acc = np.uint64(0)
        for j in range(8):
            acc |= a[s + j] ^ b[s + j]
        if acc != 0:
            for w in range(s, s + 8):
                x = a[w] ^ b[w]
                if x != 0:
                    n = _emit_lanes(x, w * lanes, lanes, lane_bits, out, n)
    for w in range(nblk * 8, nw):
        x = a[w] ^ b[w]
        if x != 0:
            n = _emit_lanes(x, w * lanes, lanes, lane_bits, out, n)
    return n


def _chunk_positions(a8: np.ndarray, b8: np.ndarray, start: int, stop: int, esize: int) -> np.ndarray:
    """Changed element indices inside bytes [start, stop) of two uint8 arrays; start, stop are 8-aligned."""
    words_a = a8[start:stop].view(np.uint64)
    words_b = b8[start:stop].view(np.uint64)
    out = np.empty((stop - start) // esize, dtype=np.int32)
    n = _changed_lanes(words_a, words_b, esize * 8, out)
    return out[:n].astype(np.int64) + start // esize


class DiffEngine:
    """Finds changed positions; holds the thread pool so repeated diffs do not re-create it."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads or os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="flipsync-diff")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> DiffEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def changed_positions(self, old: torch.Tensor, new: torch.Tensor) -> np.ndarray:
        """Sorted int64 flat indices where the bit patterns of ``old`` and ``new`` differ."""
        if old.shape != new.shape or old.dtype != new.dtype:
            raise PatchError(
                f"cannot diff tensors of different layouts: {tuple(old.shape)} {old.dtype} "
                f"vs {tuple(new.shape)} {new.dtype}"
            )
        if old.device != new.device:
            raise PatchError(f"cannot diff tensors on different devices ({old.device} vs {new.device})")
        if old.device.type != "cpu":
            return _changed_positions_torch(old, new)
        esize = dtype_of(old).bits // 8
        a8 = int_view(old).numpy().view(np.uint8)
        b8 = int_view(new).numpy().view(np.uint8)
        nbytes = a8.shape[0]
        body = nbytes - nbytes % 8
        # At least one chunk per thread for tensors over 1 MiB, so small tensors use both cores too.
        chunk = max(MIN_CHUNK_BYTES, min(CHUNK_BYTES, -(-body // self.threads)))
        chunk += -chunk % 64
        bounds = [*range(0, body, chunk), body]
        spans = list(itertools.pairwise(bounds))
        if len(spans) <= 1:
            parts = [_chunk_positions(a8, b8, s, e, esize) for s, e in spans]
        else:
            parts = list(self._pool.map(lambda se: _chunk_positions(a8, b8, se[0], se[1], esize), spans))
        if body < nbytes:  # a tail shorter than one word
            ta = a8[body:].view(_uint_np(esize))
            tb = b8[body:].view(_uint_np(esize))
            parts.append(np.flatnonzero(ta != tb).astype(np.int64) + body // esize)
        if not parts:
            return np.empty(0, dtype=np.int64)
        return np.concatenate(parts)


def _uint_np(esize: int) -> np.dtype:
    return np.dtype(f"<u{esize}")


def _changed_positions_torch(old: torch.Tensor, new: torch.Tensor) -> np.ndarray:
    a, b = int_view(old), int_view(new)
    parts = []
    for s in range(0, a.numel(), _CUDA_CHUNK):
        e = min(s + _CUDA_CHUNK, a.numel())
        idx = torch.nonzero(a[s:e] != b[s:e]).reshape(-1)
        parts.append(idx.cpu().numpy() + s)
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def changed_positions_reference(old: torch.Tensor, new: torch.Tensor) -> np.ndarray:
    """The obvious method, kept as the baseline the benchmark compares against."""
    a = int_view(old).cpu().numpy()
    b = int_view(new).cpu().numpy()
    return np.flatnonzero(a != b)
