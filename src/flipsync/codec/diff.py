"""Find the elements whose bit patterns differ between two tensors.

CPU: a single-pass numba kernel XORs 64-bit words, skips equal words and emits the lane indices of the
differing elements; the tensor is cut into chunks processed by one thread per core with the GIL released.
For the sparse changes of RL steps that runs near memory bandwidth, where ``np.flatnonzero(a != b)``
allocates a full bool temporary; chunks that turn out dense (over 8% changed) use numpy instead.
CUDA: the same answer from torch ops on the device, chunked to bound the temporary.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch

from flipsync.codec.bits import dtype_of, int_view
from flipsync.errors import PatchError

CHUNK_BYTES = 8 << 20  # per task: small enough to balance the cores, large enough to amortise dispatch
MIN_CHUNK_BYTES = 1 << 20
_CUDA_CHUNK = 1 << 26


# Lowest-set-bit index by de Bruijn multiplication: bit i of an isolated bit t maps to slot (t * M) >> 58.
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_BIT_INDEX = np.zeros(64, dtype=np.int64)
for _i in range(64):
    _BIT_INDEX[((1 << _i) * 0x03F79D71B4CB0A89 % (1 << 64)) >> 58] = _i

DENSE_FRACTION = 0.08  # above this, numpy's vectorised compare-and-compact beats the sparse kernel
_PROBE_WORDS = 4096  # words scanned to estimate a chunk's density


@numba.njit(nogil=True, cache=True)
def _changed_lanes(a: np.ndarray, b: np.ndarray, lane_bits: int, out: np.ndarray, bit_index: np.ndarray) -> int:
    """Write the lane indices (relative to a[0]) of differing lanes of uint64 words a, b into out.

    Equal words cost one XOR and a well-predicted branch. In a differing word every lane is folded onto
    its lowest bit (SWAR: or-shifts, then a mask), and only the set bits are visited, lowest first.
    """
    lanes = 64 // lane_bits
    low = np.uint64(0)
    for i in range(lanes):
        low |= np.uint64(1) << np.uint64(i * lane_bits)
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
                bit = x & (~x + np.uint64(1))
                out[n] = base + (bit_index[(bit * _DEBRUIJN) >> np.uint64(58)] >> lane_shift)
                n += 1
                x &= x - np.uint64(1)
    return n


def _chunk_positions(
    a8: np.ndarray, b8: np.ndarray, start: int, stop: int, esize: int, scratch: np.ndarray
) -> np.ndarray:
    """Changed element indices inside bytes [start, stop) of two uint8 arrays; start, stop are 8-aligned.

    A probe of the chunk's first words picks the method: the sparse kernel, or numpy on dense chunks.
    ``scratch`` (int32, one slot per element of the chunk at least) is the kernel's output buffer.
    """
    words_a = a8[start:stop].view(np.uint64)
    words_b = b8[start:stop].view(np.uint64)
    out = scratch[: (stop - start) // esize]
    lane_bits = esize * 8
    probe = min(_PROBE_WORDS, words_a.shape[0])
    n = _changed_lanes(words_a[:probe], words_b[:probe], lane_bits, out, _BIT_INDEX)
    if n > DENSE_FRACTION * probe * (64 // lane_bits):
        dt = _uint_np(esize)
        rest = np.flatnonzero(a8[start + 8 * probe : stop].view(dt) != b8[start + 8 * probe : stop].view(dt))
        tail = rest.astype(np.int64) + probe * (64 // lane_bits)
        return np.concatenate([out[:n].astype(np.int64), tail]) + start // esize
    m = _changed_lanes(words_a[probe:], words_b[probe:], lane_bits, out[n:], _BIT_INDEX)
    out[n : n + m] += probe * (64 // lane_bits)  # numbered from the probe's end
    return out[: n + m].astype(np.int64) + start // esize


class DiffEngine:
    """Finds changed positions; holds the thread pool so repeated diffs do not re-create it."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads or os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="flipsync-diff")
        self._local = threading.local()  # one kernel output buffer per pool thread, reused across chunks

    def _scratch(self, chunk_bytes: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.shape[0] < chunk_bytes:
            buf = self._local.buf = np.empty(chunk_bytes, dtype=np.int32)
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
        """``changed_positions`` of several pairs at once: small tensors share the pool instead of each
        running alone, so a view of many small tensors still uses every core."""
        for old, new in pairs:
            _check_pair(old, new)
        cpu = [(i, a, b) for i, (a, b) in enumerate(pairs) if a.device.type == "cpu"]
        total = sum(a.numel() * a.element_size() for _, a, _ in cpu)
        chunk = max(MIN_CHUNK_BYTES, min(CHUNK_BYTES, -(-total // self.threads)))
        chunk += -chunk % 64
        tasks: list[tuple[int, np.ndarray, np.ndarray, int, int, int]] = []
        for i, a, b in cpu:
            esize = dtype_of(a).bits // 8
            a8, b8 = int_view(a).numpy().view(np.uint8), int_view(b).numpy().view(np.uint8)
            tasks += [(i, a8, b8, s, min(s + chunk, a8.shape[0]), esize) for s in range(0, a8.shape[0], chunk)]
        done = (
            self._pool.map(lambda t: _span_positions(*t[1:], self._scratch(chunk)), tasks)
            if len(tasks) > 1
            else map(lambda t: _span_positions(*t[1:], self._scratch(chunk)), tasks)
        )
        parts: list[list[np.ndarray]] = [[] for _ in pairs]
        for task, positions in zip(tasks, done, strict=True):
            parts[task[0]].append(positions)
        out = []
        for i, (a, b) in enumerate(pairs):
            if a.device.type != "cpu":
                out.append(_changed_positions_torch(a, b))
            else:
                out.append(np.concatenate(parts[i]) if parts[i] else np.empty(0, dtype=np.int64))
        return out


def _check_pair(old: torch.Tensor, new: torch.Tensor) -> None:
    if old.shape != new.shape or old.dtype != new.dtype:
        raise PatchError(
            f"cannot diff tensors of different layouts: {tuple(old.shape)} {old.dtype} "
            f"vs {tuple(new.shape)} {new.dtype}"
        )
    if old.device != new.device:
        raise PatchError(f"cannot diff tensors on different devices ({old.device} vs {new.device})")


def _span_positions(
    a8: np.ndarray, b8: np.ndarray, start: int, stop: int, esize: int, scratch: np.ndarray
) -> np.ndarray:
    """Changed element indices in bytes [start, stop): whole words by the kernel, a short tail by numpy."""
    body = stop - (stop - start) % 8
    head = _chunk_positions(a8, b8, start, body, esize, scratch) if body > start else np.empty(0, dtype=np.int64)
    if body == stop:
        return head
    dt = _uint_np(esize)
    tail = np.flatnonzero(a8[body:stop].view(dt) != b8[body:stop].view(dt)).astype(np.int64) + body // esize
    return np.concatenate([head, tail])


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
