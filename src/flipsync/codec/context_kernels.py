"""The numba kernels that `flipsync.codec.context.ContextCoder` drives: ranks and packing, reading, and the
decoder's passes from ranks to positions."""

from __future__ import annotations

import numba
import numpy as np

from flipsync.codec.bitpack import bit_at, flush_bits, put_bits, put_rice, read_bits
from flipsync.codec.class_index import tree_prefix
from flipsync.codec.coders import CORRUPT, OK, TRUNCATED
from flipsync.codec.jit import kernel, prefetch_read
from flipsync.codec.rice import rice_decode_runs


@kernel
def class_ranks(
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


@kernel
def group_gaps(cls: np.ndarray, rank: np.ndarray, slot: np.ndarray, gaps: np.ndarray) -> None:
    """Each change's rank gap to the previous change of its class, grouped by class (runs from ``slot[c]``)."""
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


@kernel
def pack_stream(
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
def _gamma(data: np.ndarray, p: int, total: int) -> tuple[int, int]:
    """(value, next bit) of the Elias gamma code at bit p; value -1 if it is malformed or runs past the end."""
    zeros = 0
    while p + zeros < total and bit_at(data, p + zeros) == 0:
        zeros += 1
    if zeros > 40 or p + 2 * zeros + 1 > total:
        return np.int64(-1), p
    return np.int64(read_bits(data, p + zeros, zeros + 1)), p + 2 * zeros + 1


@kernel
def decode_ranks(
    data: np.ndarray, n_used: int, nbits: int, n_classes: int, numel: int, first: np.ndarray, end: np.ndarray,
    ranks: np.ndarray,
) -> int:  # fmt: skip
    """Read the table and the rank gaps: class c's ranks into ``ranks[first[c]:end[c]]`` (unused: first -1)."""
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
        k_c = int(read_bits(data, p, nbits)) + 1
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


@kernel
def countdowns(first: np.ndarray, end: np.ndarray, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ranks as countdowns: ``after[home[c] + t]`` is how many elements of class c to skip after its t-th
    change (``_FAR`` after its last, and one more slot at the end: a pointer past the last still reads one)."""
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


@kernel
def _start(first, end, ranks, home, before, left, ptr):  # type: ignore[no-untyped-def]
    """Each class's countdown and pointer at a point of the base after ``before[c]`` elements of class c."""
    for c in range(first.shape[0]):
        left[c] = _FAR
        ptr[c] = 0
        if first[c] >= 0:
            q = first[c] + np.searchsorted(ranks[first[c] : end[c]], before[c])
            ptr[c] = home[c] + (q - first[c])
            if q < end[c]:
                left[c] = ranks[q] - before[c]


@kernel
def _emit(base, lo, hi, s1, m1, s2, m2, w1, left, ptr, after, out):  # type: ignore[no-untyped-def]
    """The pass over ``base[lo:hi]``: count each element down in its class and emit those whose countdown was
    at zero, up to the last. The second field is tested for only where the rule has one (hoisted: a one-field
    pass runs about twice as fast)."""
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


@kernel
def _emit_dense(base, lo, hi, s1, m1, s2, m2, w1, left, ptr, after, out):  # type: ignore[no-untyped-def]
    """``_emit`` without a branch per change (for dense changes): every element is written at the cursor."""
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


@kernel
def emit_from(base, lo, hi, s1, m1, s2, m2, w1, first, end, ranks, home, after, before, out, dense):  # type: ignore[no-untyped-def]
    """One pass over ``base[lo:hi]`` (``before``: each class's count before ``lo``) into its share ``out``;
    CORRUPT if it does not find them all (ranks past a class's size in this base)."""
    n_classes = first.shape[0]
    left = np.empty(n_classes, dtype=np.int64)
    ptr = np.empty(n_classes, dtype=np.int64)
    _start(first, end, ranks, home, before, left, ptr)
    if dense:
        emitted = _emit_dense(base, lo, hi, s1, m1, s2, m2, w1, left, ptr, after, out)
    else:
        emitted = _emit(base, lo, hi, s1, m1, s2, m2, w1, left, ptr, after, out)
    return OK if emitted == out.shape[0] else CORRUPT


_RUN = 64  # elements ``place_ranks`` counts at a time before it scans them
_AHEAD = 8  # how many changes ahead ``place_ranks`` prefetches the block of


@kernel
def place_ranks(base, block, tree, slot, s1, m1, s2, m2, w1, first, end, ranks, out):  # type: ignore[no-untyped-def]
    """Ranks to positions without a pass over the base: every rank's block by a Fenwick search, then in each
    block with changes, elements counted ``_RUN`` at a time (vectorizes) up to the run holding a change, which
    is scanned. Positions come out grouped by class (the caller sorts them); CORRUPT for a rank past its class."""
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


@kernel
def chunk_offsets(before: np.ndarray, first: np.ndarray, end: np.ndarray, ranks: np.ndarray, offs: np.ndarray) -> None:
    """``offs[j]``: how many changes lie before chunk j, given ``before[j, c]``, class c's elements before it."""
    for j in range(before.shape[0]):
        o = 0
        for c in range(first.shape[0]):
            if first[c] >= 0:
                o += np.searchsorted(ranks[first[c] : end[c]], before[j, c])
        offs[j] = o
