"""The ``ctx`` position coder: changed positions coded against the base tensor both sides hold.

A served value changes when the optimizer's step crosses its rounding step, which grows with the value's
own magnitude: in BF16 a value with a large exponent changes far less often than a small one. The receiver
holds the base, so both sides can split the tensor into *classes* by the base value's exponent bits (for
packed FP4 bytes: both codes' exponent bits) and code, per class, which of its elements changed. That costs
about sum over classes of log2 C(N_c, k_c) bits (N_c elements, k_c of them changed), below today's
log2 C(numel, n) whenever the classes change at different rates.

Coding (per tensor, adaptive: the model's parameters are the per-class counts, stored in the stream):
a table of the used classes (the gap to the previous used class id, Elias-gamma; k_c - 1 in ``nbits`` bits;
the step from the previous class's Rice parameter, zigzagged, Elias-gamma), then per class the gaps between
the *ranks* of its changed elements among the class's elements, Rice-coded. One MSB-first bit stream.

Decoding is one streaming pass over the base: each element's class is computed from its bits, and a
per-class countdown (how many more elements of the class to pass before its next change: the decoded rank
gaps) is decremented; an element whose class's countdown was at zero is a changed position. Positions come
out sorted; the pass stops at the last change. Below ~12% changed the emit is a rarely taken branch, above it
a branch-free update (a mispredicted branch per change costs more than the extra stores). Memory: the n ranks
(n is bounded by the stream's length: every rank costs at least one bit), their countdowns and per-class
state.

A large base is decoded in chunks on a thread pool, from the same stream: first each chunk's class counts
(they depend on the base alone), whose prefix sums tell each chunk the rank each class starts at, so which
ranks (a binary search per class) and which slice of the output are its own; then every chunk runs its own
pass. A chunk that cannot emit all of its share is a corrupt stream, as in the one-thread pass. The encoder's
pass (each change's class and rank) is chunked the same way and writes the same stream.

A receiver that keeps a ``ClassIndex`` (``codec.class_index``: per class, a Fenwick tree of counts over
blocks, moved by every commit) needs no pass where changes are sparse: each rank's block is found by a search of its
class's tree, and only the blocks that hold changes are read. The chunks take their class counts from it too.
"""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numba
import numpy as np

from flipsync.codec.bitpack import flush_bits, put_bits, put_rice
from flipsync.codec.bits import DType
from flipsync.codec.class_index import (
    MIN_BLOCK,
    BaseBits,
    ClassRule,
    ClassTree,
    class_rule,
    count_classes,
    tree_prefix,
    tree_rows,
)
from flipsync.codec.coders import CORRUPT, OK, TRUNCATED, Params, PositionCoder, get_int
from flipsync.codec.intrinsics import prefetch_read
from flipsync.codec.rice import best_rice_k, rice_bits, rice_decode_runs
from flipsync.errors import CorruptPatchError

_K_BITS = 6  # a class's Rice parameter, 0..62
log = logging.getLogger(__name__)


@numba.njit(nogil=True, cache=True)
def _ranks(
    base: np.ndarray, positions: np.ndarray, s1: int, m1: int, s2: int, m2: int, w1: int, counts: np.ndarray,
    cls: np.ndarray, rank: np.ndarray,
) -> None:  # fmt: skip
    """One pass: every class's element count, and each changed position's class and rank within its class."""
    j = 0
    n = positions.shape[0]
    a1, b1, a2, b2 = np.uint64(s1), np.uint64(m1), np.uint64(s2), np.uint64(m2)
    c2 = np.uint64(w1)
    for i in range(base.shape[0]):
        u = np.uint64(base[i])
        c = ((u >> a1) & b1) | (((u >> a2) & b2) << c2)
        if j < n and positions[j] == i:
            cls[j] = c
            rank[j] = counts[c]
            j += 1
        counts[c] += 1


@numba.njit(nogil=True, cache=True)
def _group_gaps(cls: np.ndarray, rank: np.ndarray, slot: np.ndarray, gaps: np.ndarray) -> None:
    """Counting sort by class (positions are in order, so ranks rise inside a class): each change's rank gap
    to the previous change of its class lands in its class's run of ``gaps``, which starts at ``slot[c]``."""
    last = np.full(slot.shape[0], -1, dtype=np.int64)
    for j in range(cls.shape[0]):
        c = cls[j]
        gaps[slot[c]] = np.uint64(rank[j] - last[c] - 1)
        slot[c] += 1
        last[c] = rank[j]


@numba.njit(inline="always")
def _put_gamma(out: np.ndarray, j: int, acc: np.uint64, nacc: int, x: int) -> tuple[int, np.uint64, int]:
    """Elias gamma code of x >= 1: as many zeros as x has bits after its first, then x."""
    width = 0
    while (x >> width) > 0:
        width += 1
    if width > 1:
        j, acc, nacc = put_bits(out, j, acc, nacc, np.uint64(0), width - 1)
    return put_bits(out, j, acc, nacc, np.uint64(x), width)


@numba.njit(nogil=True, cache=True)
def _pack(
    used: np.ndarray, k_of: np.ndarray, rice_k: np.ndarray, gaps: np.ndarray, nbits: int,
    out: np.ndarray,
) -> int:  # fmt: skip
    """The class table, then each used class's rank gaps Rice-coded (``gaps`` grouped by class, in order)."""
    acc = np.uint64(0)
    nacc = 0
    j = 0
    prev_c, prev_k = -1, 0
    for u in range(used.shape[0]):  # adjacent exponents: class gaps and Rice parameter steps are small
        j, acc, nacc = _put_gamma(out, j, acc, nacc, used[u] - prev_c)
        j, acc, nacc = put_bits(out, j, acc, nacc, np.uint64(k_of[u] - 1), nbits)
        step = rice_k[u] - prev_k
        j, acc, nacc = _put_gamma(out, j, acc, nacc, 2 * step + 1 if step >= 0 else -2 * step)
        prev_c, prev_k = used[u], rice_k[u]
    g = 0
    for u in range(used.shape[0]):
        k = rice_k[u]
        for _ in range(k_of[u]):
            j, acc, nacc = put_rice(out, j, acc, nacc, gaps[g], k)
            g += 1
    return flush_bits(out, j, acc, nacc)


@numba.njit(inline="always")
def _bit(data: np.ndarray, p: int) -> int:
    return (data[p >> 3] >> (7 - (p & 7))) & 1


@numba.njit(inline="always")
def _read(data: np.ndarray, p: int, width: int) -> np.uint64:
    v = np.uint64(0)
    for t in range(width):
        v = (v << np.uint64(1)) | np.uint64(_bit(data, p + t))
    return v


@numba.njit(inline="always")
def _gamma(data: np.ndarray, p: int, total: int) -> tuple[int, int]:
    """(value, next bit) of the Elias gamma code at bit p; value -1 if it is malformed or runs past the end."""
    zeros = 0
    while p + zeros < total and _bit(data, p + zeros) == 0:
        zeros += 1
    if zeros > 40 or p + 2 * zeros + 1 > total:
        return np.int64(-1), p
    return np.int64(_read(data, p + zeros, zeros + 1)), p + 2 * zeros + 1


@numba.njit(nogil=True, cache=True)
def _decode_ranks(
    data: np.ndarray, n_used: int, nbits: int, n_classes: int, numel: int, first: np.ndarray, end: np.ndarray,
    ranks: np.ndarray,
) -> int:  # fmt: skip
    """Read the table and the rank gaps: each used class's ranks land in ``ranks[first[c]:end[c]]`` (rising);
    an unused class has ``first[c] == -1``. Returns OK or a status."""
    total = data.shape[0] * 8
    n = ranks.shape[0]
    if n_used * (nbits + 2) > total:
        return TRUNCATED
    p = 0
    ks = np.zeros(n_used, dtype=np.int64)
    cnt = np.zeros(n_used, dtype=np.int64)
    prev = -1
    filled = 0
    k = 0
    for u in range(n_used):
        gap, p = _gamma(data, p, total)
        if gap < 0 or p + nbits > total:
            return TRUNCATED
        c = prev + gap
        k_c = int(_read(data, p, nbits)) + 1
        step, p = _gamma(data, p + nbits, total)
        if step < 0:
            return TRUNCATED
        k += (step - 1) // 2 if step & 1 else -(step // 2)
        if c >= n_classes or k < 0 or k > 62 or k_c > n - filled:
            return CORRUPT
        prev = c
        cnt[u], ks[u] = k_c, k
        first[c] = filled
        filled += k_c
        end[c] = filled
    if filled != n:
        return CORRUPT
    used = rice_decode_runs(data, p, ks, cnt, ranks, numel)  # ranks within each class, below numel
    if used < 0:
        return used
    if (p + used + 7) // 8 != data.shape[0]:
        return CORRUPT  # bytes no rank claims
    return OK


_FAR = 1 << 62  # a class's countdown when no change lies ahead of it: never reaches zero
_DENSE = 0.12  # from this share of changed elements the branch-free pass is faster (measured: 1.5-21% changed)
_PLACE_UPTO = 1.0  # changes per index block up to which reading only their blocks beats a pass (measured: 1.2)


@numba.njit(nogil=True, cache=True)
def _countdowns(first: np.ndarray, end: np.ndarray, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ranks as countdowns: ``after[home[c] + t]`` is how many elements of class c to skip after its t-th
    change before the next one (``_FAR`` after its last); one slot per class more than the ranks, and one
    at the end, so a pointer moved past a class's last change still reads a valid slot."""
    n_classes = first.shape[0]
    after = np.empty(ranks.shape[0] + n_classes + 1, dtype=np.int64)
    home = np.zeros(n_classes, dtype=np.int64)
    u = 0
    for c in range(n_classes):
        if first[c] >= 0:
            home[c] = first[c] + u
            for q in range(first[c], end[c] - 1):
                after[q + u] = ranks[q + 1] - ranks[q] - 1
            after[end[c] - 1 + u] = _FAR
            u += 1
    after[ranks.shape[0] + u :] = _FAR
    return after, home


@numba.njit(nogil=True, cache=True)
def _start(first, end, ranks, home, before, left, ptr):  # type: ignore[no-untyped-def]
    """Each class's countdown to its next change, and its pointer into the countdowns, at a point of the base
    before which class c has ``before[c]`` elements."""
    for c in range(first.shape[0]):
        left[c] = _FAR
        ptr[c] = 0
        if first[c] >= 0:
            q = first[c] + np.searchsorted(ranks[first[c] : end[c]], before[c])
            ptr[c] = home[c] + (q - first[c])
            if q < end[c]:
                left[c] = ranks[q] - before[c]


@numba.njit(nogil=True, cache=True)
def _emit(base, lo, hi, s1, m1, s2, m2, w1, left, ptr, after, out):  # type: ignore[no-untyped-def]
    """The pass over ``base[lo:hi]``: count each element down in its class, and emit, in order, the elements
    whose class's countdown was at zero; stop at the last. The emit is a (rarely taken) branch. The second
    field only when the rule has one (packed FP4 bytes): the loop-invariant test is hoisted, and a one-field
    pass runs about twice as fast."""
    n = out.shape[0]
    emitted = 0
    if n == 0:
        return 0
    two = m2 != 0
    a1, b1, a2, b2, c2 = np.uint64(s1), np.uint64(m1), np.uint64(s2), np.uint64(m2), np.uint64(w1)
    seg = base[lo:hi]  # indices from 0 and unsigned classes: no wraparound checks (measured ~25% of the pass)
    for i in range(seg.shape[0]):
        u = np.uint64(seg[i])
        c = (u >> a1) & b1
        if two:
            c |= ((u >> a2) & b2) << c2
        r = left[c] - 1
        left[c] = r
        if r < 0:
            out[emitted] = lo + i
            emitted += 1
            if emitted == n:
                return emitted
            p = ptr[c]
            left[c] = after[p]
            ptr[c] = p + 1
    return emitted


@numba.njit(nogil=True, cache=True)
def _emit_dense(base, lo, hi, s1, m1, s2, m2, w1, left, ptr, after, out):  # type: ignore[no-untyped-def]
    """``_emit`` without a branch per change, for dense changes: every element is written at the output's
    cursor, which moves on when it was a change, and the countdown and pointer are updated arithmetically."""
    n = out.shape[0]
    emitted = 0
    if n == 0:
        return 0
    two = m2 != 0
    a1, b1, a2, b2, c2 = np.uint64(s1), np.uint64(m1), np.uint64(s2), np.uint64(m2), np.uint64(w1)
    seg = base[lo:hi]
    for i in range(seg.shape[0]):
        u = np.uint64(seg[i])
        c = (u >> a1) & b1
        if two:
            c |= ((u >> a2) & b2) << c2
        r = left[c]
        hit = np.int64(r == 0)
        p = ptr[c]
        out[emitted] = lo + i
        left[c] = r - 1 + hit * (after[p] + 1)
        ptr[c] = p + hit
        emitted += hit
        if emitted == n:
            return emitted
    return emitted


@numba.njit(nogil=True, cache=True)
def _emit_from(base, lo, hi, s1, m1, s2, m2, w1, first, end, ranks, home, after, before, out, dense):  # type: ignore[no-untyped-def]
    """One pass over ``base[lo:hi]``, independent of any other: ``before`` holds each class's count before
    ``lo``, and ``out`` is the pass's share of the positions. OK, or CORRUPT if the pass does not hold them
    all (some class names ranks past its size in this base)."""
    n_classes = first.shape[0]
    left = np.empty(n_classes, dtype=np.int64)
    ptr = np.empty(n_classes, dtype=np.int64)
    _start(first, end, ranks, home, before, left, ptr)
    if dense:
        emitted = _emit_dense(base, lo, hi, s1, m1, s2, m2, w1, left, ptr, after, out)
    else:
        emitted = _emit(base, lo, hi, s1, m1, s2, m2, w1, left, ptr, after, out)
    return OK if emitted == out.shape[0] else CORRUPT


_RUN = 64  # elements ``_place`` counts at a time before it scans them
_AHEAD = 8  # how many changes ahead ``_place`` prefetches the block of


@numba.njit(nogil=True, cache=True)
def _place(base, block, tree, slot, s1, m1, s2, m2, w1, first, end, ranks, out):  # type: ignore[no-untyped-def]
    """Ranks to positions without a pass over the base. First every rank's block and its ordinal there
    (a Fenwick search each); then each block that holds changes is read, its elements counted ``_RUN`` at a
    time (a loop that vectorizes) up to the run that holds a change, which is scanned, while the block of the
    change ``_AHEAD`` places on is prefetched. ``out[first[c] + t]`` is class c's t-th change: positions come out
    grouped by class (the caller sorts them). OK, or CORRUPT for a rank past its class's size."""
    n_blocks = tree.shape[1]
    n = ranks.shape[0]
    top = 1
    while top * 2 <= n_blocks:
        top *= 2
    of = np.empty(n, dtype=np.int64)  # each rank's block
    ordinal = np.empty(n, dtype=np.int64)  # its ordinal among its class's elements in that block
    for c in range(first.shape[0]):
        if first[c] < 0:
            continue
        row = slot[c]
        if row < 0 or ranks[end[c] - 1] >= tree_prefix(tree, n_blocks, row):
            return CORRUPT  # ranks past the class's size (or a class this base lacks)
        for t in range(first[c], end[c]):
            b, q, step = 0, ranks[t], top
            while step > 0:  # the last block whose prefix holds at most ranks[t] of class c's elements
                nxt = min(b + step, n_blocks)
                v = tree[row, nxt - 1]
                take = np.int64(nxt == b + step) & np.int64(v <= q)  # no branch: the way it goes is a coin toss
                b += step * take
                q -= v * take
                step >>= 1
            of[t], ordinal[t] = b, q
    line = max(1, 64 // base.itemsize)
    two = m2 != 0
    for c in range(first.shape[0]):
        if first[c] < 0:
            continue
        t = first[c]
        while t < end[c]:
            if t + _AHEAD < n:  # the read ahead (a hint: never faults)
                lo = of[t + _AHEAD] * block
                for off in range(lo, min(lo + block, base.shape[0]), line):
                    prefetch_read(base, off)
            b = of[t]
            lo = b * block
            seg = base[lo : min(lo + block, base.shape[0])]
            placed = t
            q = ordinal[t]
            k = 0  # class c's elements passed in this block
            for r0 in range(0, seg.shape[0], _RUN):
                run = seg[r0 : r0 + _RUN]
                hits = np.int32(0)
                if two:
                    for i in range(run.shape[0]):
                        hits += np.int32((((run[i] >> s1) & m1) | (((run[i] >> s2) & m2) << w1)) == c)
                else:
                    for i in range(run.shape[0]):
                        hits += np.int32(((run[i] >> s1) & m1) == c)
                after_run = k + hits
                if after_run <= q:
                    k = after_run
                    continue
                for i in range(run.shape[0]):  # the class test is not a branch: class c comes at random
                    u = run[i]
                    cl = (u >> s1) & m1
                    if two:
                        cl |= ((u >> s2) & m2) << w1
                    m = np.int64(cl == c)
                    if m & np.int64(k == q):
                        out[t] = lo + r0 + i
                        t += 1
                        q = ordinal[t] if t < end[c] and of[t] == b else -1
                        if q < 0 or q >= after_run:  # the rest of the run holds no change
                            break
                    k += m
                k = after_run
                if q < 0:  # every change of class c in this block is placed
                    break
            if t == placed:
                return CORRUPT  # the tree does not describe this base
    return OK


@numba.njit(nogil=True, cache=True)
def _offsets(before: np.ndarray, first: np.ndarray, end: np.ndarray, ranks: np.ndarray, offs: np.ndarray) -> None:
    """``offs[j]``: how many changes lie before chunk j, given ``before[j, c]``, class c's elements before it
    (row K: the whole tensor's counts, so ``offs[K]`` is every change whose rank its class holds)."""
    for j in range(before.shape[0]):
        o = 0
        for c in range(first.shape[0]):
            if first[c] >= 0:
                o += np.searchsorted(ranks[first[c] : end[c]], before[j, c])
        offs[j] = o


def classes_and_ranks(base: np.ndarray, positions: np.ndarray, d: DType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(elements per class, class of each position, rank of each position within its class)."""
    rule = class_rule(d)
    counts = np.zeros(rule.n_classes, dtype=np.int64)
    cls = np.empty(positions.size, dtype=np.int64)
    rank = np.empty(positions.size, dtype=np.int64)
    _ranks(np.ascontiguousarray(base).reshape(-1), np.ascontiguousarray(positions, np.int64), rule.s1, rule.m1,
           rule.s2, rule.m2, rule.w1, counts, cls, rank)  # fmt: skip
    return counts, cls, rank


def conditional_position_bits(base: np.ndarray, positions: np.ndarray, d: DType) -> float:
    """sum over classes of log2 C(N_c, k_c): the bound the ``ctx`` coder aims at."""
    counts, cls, _ = classes_and_ranks(base, positions, d)
    k = np.bincount(cls, minlength=counts.size)
    used = np.flatnonzero(k)
    return sum(_log2_binom(int(counts[c]), int(k[c])) for c in used)


def _log2_binom(u: int, n: int) -> float:
    return (math.lgamma(u + 1) - math.lgamma(n + 1) - math.lgamma(u - n + 1)) / math.log(2)


def _counts_before(
    pool: ThreadPoolExecutor, bits: np.ndarray, bounds: np.ndarray, rule: tuple[int, ...], before: np.ndarray
) -> None:
    """``before[j, c]``: class c's elements before chunk j (``bounds``), counted chunk by chunk on ``pool``."""
    list(
        pool.map(lambda j: count_classes(bits, bounds[j], bounds[j + 1], *rule, before[j + 1]), range(len(before) - 1))
    )
    np.cumsum(before, axis=0, out=before)


class ContextCoder(PositionCoder):
    """Positions coded per class of the base value (see the module docstring); needs the base to decode."""

    codec_id: ClassVar[str] = "ctx"
    needs_base: ClassVar[bool] = True

    def __init__(
        self,
        *,
        chunk: int = 1 << 20,
        parallel_from: int = 1 << 22,
        workers: int | None = None,
        dense_from: float = _DENSE,
        place_upto: float = _PLACE_UPTO,
    ) -> None:
        """``chunk``: elements per chunk of the decoding pass (a base of at least ``parallel_from`` elements is
        decoded in chunks on ``workers`` threads; default: every core, from 4 cores). A pass whose share of
        changed elements reaches ``dense_from`` runs branch-free. With the base's class index, up to
        ``place_upto`` changes per index block are placed block by block instead of by a pass. The stream and
        the positions are the same either way."""
        self.chunk = max(1, chunk)
        self.parallel_from = parallel_from
        self.workers = workers
        self.dense_from = dense_from
        self.place_upto = place_upto

    def accepts(self, positions: np.ndarray, base: Any = None) -> bool:
        return isinstance(base, BaseBits) and positions.size > 0 and class_rule(base.dtype).n_classes > 1

    def encode(self, positions: np.ndarray, base: Any = None) -> tuple[Params, bytes]:
        if not isinstance(base, BaseBits):
            raise ValueError("the ctx coder needs the base tensor")
        rule = class_rule(base.dtype)
        cls, rank = self._classes_and_ranks(np.ascontiguousarray(base.bits).reshape(-1), positions, rule)
        per_class = np.bincount(cls, minlength=rule.n_classes)
        used = np.flatnonzero(per_class)
        k_of = per_class[used]
        starts = np.cumsum(k_of) - k_of
        gaps = np.empty(cls.size, dtype=np.uint64)
        _group_gaps(cls, rank, (np.cumsum(per_class) - per_class).astype(np.int64), gaps)
        rice_k = np.array([best_rice_k(gaps[s : s + k]) for s, k in zip(starts, k_of, strict=True)], dtype=np.int64)
        cbits = max(1, rule.n_classes.bit_length())
        nbits = max(1, int(k_of.max() - 1).bit_length())
        size = used.size * (2 * cbits + 1 + nbits + 2 * _K_BITS + 3)  # at most, with the gamma codes
        size += sum(rice_bits(gaps[s : s + k], int(rk)) for s, k, rk in zip(starts, k_of, rice_k, strict=True))
        out = np.empty((size + 7) // 8, dtype=np.uint8)
        n_bytes = _pack(used.astype(np.int64), k_of.astype(np.int64), rice_k, gaps, nbits, out)
        return {"classes": int(used.size), "nbits": nbits}, out[:n_bytes].tobytes()

    def decode(self, params: Params, blob: bytes, n: int, numel: int, base: Any = None) -> np.ndarray:
        if not isinstance(base, BaseBits):
            raise CorruptPatchError("a ctx position stream needs its base tensor to decode")
        rule = class_rule(base.dtype)
        n_used = get_int(params, "classes", range(1, rule.n_classes + 1))
        nbits = get_int(params, "nbits", range(1, 64))
        if n <= 0 or n > 8 * len(blob):  # every position costs at least one bit
            raise CorruptPatchError(f"ctx stream of {len(blob)} bytes cannot hold {n} positions")
        bits = np.ascontiguousarray(base.bits).reshape(-1)
        if bits.size != numel:
            raise CorruptPatchError(f"ctx stream: the base holds {bits.size} elements, the section {numel}")
        data = np.frombuffer(blob, dtype=np.uint8)
        first = np.full(rule.n_classes, -1, dtype=np.int64)
        end = np.zeros(rule.n_classes, dtype=np.int64)
        ranks = np.empty(n, dtype=np.int64)
        status = _decode_ranks(data, n_used, nbits, rule.n_classes, numel, first, end, ranks)
        out = np.empty(n, dtype=np.int64)
        if status == OK:
            status = self._positions(bits, rule, first, end, ranks, out, self._tree(base, bits, n))
        if status != OK:
            raise CorruptPatchError("ctx position stream is truncated, corrupt, or not coded against this base")
        return out

    def _tree(self, base: BaseBits, bits: np.ndarray, n: int) -> ClassTree | None:
        """The base's class index where it may pay: few changes per (smallest) block, or a chunked decode (built
        then, if the receiver's index does not hold it yet, and kept current by its commits)."""
        if base.index is None:
            return None
        if n * MIN_BLOCK > self.place_upto * bits.size and not self._chunked(bits.size):
            return None
        return base.index.tree(base.name, bits, base.dtype, base.fp)

    def _chunked(self, numel: int) -> bool:
        return self._workers() >= 2 and -(-numel // self.chunk) >= 2 and numel >= self.parallel_from

    def _workers(self) -> int:
        # The counting pass adds about half a pass of work, and stage already spreads a patch's sections over
        # the cores: by default, chunks only where there are at least 4 (on 2 busy cores they measured slower).
        cores = os.cpu_count() or 1
        return self.workers or (cores if cores >= 4 else 1)

    def _classes_and_ranks(self, bits: np.ndarray, positions: np.ndarray, rule: ClassRule) -> tuple[np.ndarray, ...]:
        """Each position's class and rank in it: one pass, or for a large base the decoder's chunks (counts,
        then each chunk's ranks from the counts before it)."""
        r = (rule.s1, rule.m1, rule.s2, rule.m2, rule.w1)
        positions = np.ascontiguousarray(positions, np.int64)
        cls = np.empty(positions.size, dtype=np.int64)
        rank = np.empty(positions.size, dtype=np.int64)
        workers = self._workers()
        n_chunks = min(-(-bits.size // self.chunk), 4 * workers)
        if workers < 2 or n_chunks < 2 or bits.size < self.parallel_from:
            _ranks(bits, positions, *r, np.zeros(rule.n_classes, dtype=np.int64), cls, rank)
            return cls, rank
        bounds = np.linspace(0, bits.size, n_chunks + 1).astype(np.int64)
        cuts = np.searchsorted(positions, bounds)
        before = np.zeros((n_chunks, rule.n_classes), dtype=np.int64)

        def ranks(j: int) -> None:
            lo, hi, a, b = bounds[j], bounds[j + 1], cuts[j], cuts[j + 1]
            _ranks(bits[lo:hi], positions[a:b] - lo, *r, before[j].copy(), cls[a:b], rank[a:b])

        with ThreadPoolExecutor(min(workers, n_chunks), thread_name_prefix="flipsync-ctx") as pool:
            _counts_before(pool, bits, bounds, r, before)
            list(pool.map(ranks, range(n_chunks)))
        return cls, rank

    def _positions(
        self,
        bits: np.ndarray,
        rule: ClassRule,
        first: np.ndarray,
        end: np.ndarray,
        ranks: np.ndarray,
        out: np.ndarray,
        index: ClassTree | None,
    ) -> int:
        """Ranks to positions. With the base's class index (``index``: block, tree) and few changes per block,
        each change's block is found and read, and nothing else; otherwise one pass over the base on this
        thread, or, for a large base, chunks on a pool (their class counts from the index where there is one,
        else counted first)."""
        r = (rule.s1, rule.m1, rule.s2, rule.m2, rule.w1)
        if index is not None and out.size * index.block <= self.place_upto * bits.size:
            status = int(_place(bits, index.block, index.tree, index.slot, *r, first, end, ranks, out))
            out.sort()
            return status
        workers = self._workers()
        after, home = _countdowns(first, end, ranks)
        n_chunks = min(-(-bits.size // max(self.chunk, index.block if index else 1)), 4 * workers)
        if workers < 2 or n_chunks < 2 or bits.size < self.parallel_from:
            before = np.zeros(rule.n_classes, dtype=np.int64)
            dense = out.size >= self.dense_from * bits.size
            return int(_emit_from(bits, 0, bits.size, *r, first, end, ranks, home, after, before, out, dense))
        # Each chunk's class counts (what depends on the base alone), then each chunk's own pass: a chunk knows
        # from the counts before it which ranks it holds, and where in ``out`` its positions go.
        before = np.zeros((n_chunks, rule.n_classes), dtype=np.int64)
        if index is not None:
            cut = np.linspace(0, index.tree.shape[1], n_chunks + 1).astype(np.int64)
            bounds = np.minimum(cut * index.block, bits.size)
            tree_rows(index.tree, index.slot, cut[:-1], before)
        else:
            bounds = np.linspace(0, bits.size, n_chunks + 1).astype(np.int64)
        with ThreadPoolExecutor(min(workers, n_chunks), thread_name_prefix="flipsync-ctx") as pool:
            if index is None:
                _counts_before(pool, bits, bounds, r, before)
            offs = np.empty(n_chunks + 1, dtype=np.int64)
            _offsets(before, first, end, ranks, offs[:-1])
            offs[-1] = out.size  # a rank past its class's size in this base: the last chunk cannot emit it

            def emit(j: int) -> int:
                lo, hi = int(offs[j]), int(offs[j + 1])
                if lo == hi:
                    return OK
                a, b = bounds[j], bounds[j + 1]
                dense = hi - lo >= self.dense_from * (b - a)
                return int(_emit_from(bits, a, b, *r, first, end, ranks, home, after, before[j], out[lo:hi], dense))

            statuses = list(pool.map(emit, range(n_chunks)))
        return OK if all(st == OK for st in statuses) else CORRUPT
