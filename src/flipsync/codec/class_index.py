"""The element classes ``ctx`` conditions on (floats: the exponent bits), and the receiver's class index: per
tensor and class, a Fenwick tree of counts over blocks, so that sparse ``ctx`` sections read only their blocks."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numba
import numpy as np

from flipsync.codec.bits import DType
from flipsync.codec.jit import kernel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClassRule:
    """An element's class from its bit pattern u: ``((u >> s1) & m1) | (((u >> s2) & m2) << w1)``."""

    s1: int
    m1: int
    s2: int = 0
    m2: int = 0

    @property
    def w1(self) -> int:
        return self.m1.bit_length()

    @property
    def n_classes(self) -> int:
        return (self.m1 + 1) * (self.m2 + 1)


# Float formats: the exponent field. U8 holds two packed E2M1 (FP4) codes: both codes' exponent bits.
# E8M0 scales: their high nibble. Integers: one class (ctx then never beats Rice, and is not chosen).
RULES = {
    "F64": ClassRule(52, 0x7FF),
    "F32": ClassRule(23, 0xFF),
    "F16": ClassRule(10, 0x1F),
    "BF16": ClassRule(7, 0xFF),
    "F8_E4M3": ClassRule(3, 0xF),
    "F8_E5M2": ClassRule(2, 0x1F),
    "F8_E8M0": ClassRule(4, 0xF),
    "U8": ClassRule(1, 0x3, 5, 0x3),
}
ONE_CLASS = ClassRule(0, 0)


def class_rule(d: DType) -> ClassRule:
    return RULES.get(d.name, ONE_CLASS)


@kernel
def count_classes(base, lo, hi, s1, m1, s2, m2, w1, counts):  # type: ignore[no-untyped-def]
    """Every class's element count in ``base[lo:hi]`` into ``counts``. Four interleaved histograms, so that
    runs of one class do not wait on the previous store to the same counter."""
    n_classes = counts.shape[0]
    h = np.zeros((4, n_classes), dtype=np.int64)
    two = m2 != 0
    a1, b1, a2, b2, c2 = np.uint64(s1), np.uint64(m1), np.uint64(s2), np.uint64(m2), np.uint64(w1)
    seg = base[lo:hi]
    m = seg.shape[0]
    for i in range(m):
        u = np.uint64(seg[i])
        c = (u >> a1) & b1
        if two:
            c |= ((u >> a2) & b2) << c2
        h[i & 3, c] += 1
    for c in range(n_classes):
        counts[c] = h[0, c] + h[1, c] + h[2, c] + h[3, c]


# The class index: tree[slot[c], i - 1] covers class c's count in blocks (i - lowbit(i), i], 1-based (slot[c] is
# -1 for a class the base lacks).


@kernel
def tree_build(base, block, s1, m1, s2, m2, w1, slot, tree):  # type: ignore[no-untyped-def]
    """Each block's class counts (``count_classes``), then the Fenwick sums."""
    n_blocks = tree.shape[1]
    counts = np.empty(slot.shape[0], dtype=np.int64)
    for b in range(n_blocks):
        count_classes(base, b * block, min((b + 1) * block, base.shape[0]), s1, m1, s2, m2, w1, counts)
        for c in range(slot.shape[0]):
            if slot[c] >= 0:
                tree[slot[c], b] = counts[c]
    for k in range(tree.shape[0]):
        for i in range(1, n_blocks + 1):
            j = i + (i & -i)
            if j <= n_blocks:
                tree[k, j - 1] += tree[k, i - 1]


@kernel
def tree_move(tree, slot, block, positions, old, new, s1, m1, s2, m2, w1):  # type: ignore[no-untyped-def]
    """The base's ``old`` bits became ``new`` at ``positions``. Returns -1, or the first change (not applied)
    whose new class has no tree yet, or -2 if the tree cannot describe the base."""
    n_blocks = tree.shape[1]
    a1, b1, a2, b2, c2 = np.uint64(s1), np.uint64(m1), np.uint64(s2), np.uint64(m2), np.uint64(w1)
    for j in range(positions.shape[0]):
        u, v = np.uint64(old[j]), np.uint64(new[j])
        c_old = ((u >> a1) & b1) | (((u >> a2) & b2) << c2)
        c_new = ((v >> a1) & b1) | (((v >> a2) & b2) << c2)
        if c_old == c_new:
            continue
        k_old, k_new = slot[c_old], slot[c_new]
        if k_old < 0:
            return -2  # an old value of a class the tree never counted: it does not describe the base
        if k_new < 0:
            return j
        i = positions[j] // block + 1
        while i <= n_blocks:
            tree[k_old, i - 1] -= 1
            tree[k_new, i - 1] += 1
            i += i & -i
    return -1


@numba.njit(inline="always")
def tree_prefix(tree, blocks, k):  # type: ignore[no-untyped-def]
    """The elements of the class in tree row k in the first ``blocks`` blocks."""
    s = 0
    i = blocks
    while i > 0:
        s += tree[k, i - 1]
        i -= i & -i
    return s


@kernel
def tree_rows(tree, slot, cut, out):  # type: ignore[no-untyped-def]
    """``out[j, c]``: class c's elements in the first ``cut[j]`` blocks."""
    for j in range(cut.shape[0]):
        for c in range(slot.shape[0]):
            out[j, c] = tree_prefix(tree, cut[j], slot[c]) if slot[c] >= 0 else 0


@dataclass(frozen=True)
class BaseBits:
    """The base tensor's bit patterns (flat, unsigned) and dtype: what ``ctx`` conditions on; optionally the
    receiver's class index that holds it (as tensor ``name`` at fingerprint ``fp``)."""

    bits: np.ndarray
    dtype: DType
    index: ClassIndex | None = None
    name: str = ""
    fp: int = 0


MIN_BLOCK = 512  # elements per index block at least: about what a change's block read costs against a pass


@dataclass
class ClassTree:
    """One tensor's class index: ``tree[slot[c]]`` is class c's Fenwick tree over blocks of ``block`` elements."""

    block: int
    tree: np.ndarray
    slot: np.ndarray


@dataclass
class _Entry:
    fp: int  # the fingerprint of the tensor the tree describes
    dtype: DType
    numel: int
    tree: ClassTree | None  # None: too small to index (remembered, so that it is not counted again)


class ClassIndex:
    """A receiver's class index of the tensors it holds (about 1/8 of their bytes), kept current by commit and
    rollback; each entry is tied to its tensor's fingerprint, and rebuilt, never used, when that does not match."""

    def __init__(self, *, min_blocks: int = 8) -> None:
        """``min_blocks``: index blocks a tensor must span to be indexed (a pass over fewer costs next to nothing)."""
        self._entries: dict[str, _Entry] = {}
        self.min_blocks = min_blocks

    def __contains__(self, name: object) -> bool:
        e = self._entries.get(name)  # type: ignore[call-overload]
        return e is not None and e.tree is not None

    def nbytes(self) -> int:
        return sum(e.tree.tree.nbytes for e in self._entries.values() if e.tree is not None)

    def describes(self, name: str, fp: int) -> bool:
        """Whether the index holds tensor ``name`` as of fingerprint ``fp`` (else its next use rebuilds it)."""
        e = self._entries.get(name)
        return e is not None and e.tree is not None and e.fp == fp

    def base(self, name: str, bits: np.ndarray, d: DType, fp: int) -> BaseBits:
        """``bits`` (the tensor ``name`` as it is now, fingerprint ``fp``) for the decoder, with this index."""
        return BaseBits(np.ascontiguousarray(bits).reshape(-1), d, self, name, fp)

    def tree(self, name: str, bits: np.ndarray, d: DType, fp: int) -> ClassTree | None:
        """The class index of tensor ``name`` (``bits``, fingerprint ``fp``), built if not held; None: too small."""
        bits = np.ascontiguousarray(bits).reshape(-1)
        if bits.size < self.min_blocks * MIN_BLOCK:
            return None
        e = self._entries.get(name)
        if e is not None and e.fp == fp and e.dtype == d and e.numel == bits.size:
            return e.tree
        self._entries.pop(name, None)
        rule = class_rule(d)
        r = (rule.s1, rule.m1, rule.s2, rule.m2, rule.w1)
        counts = np.zeros(rule.n_classes, dtype=np.int64)
        count_classes(bits, 0, bits.size, *r, counts)
        present = counts > 0
        n_present = int(present.sum())
        count = np.int32 if bits.size < 2**31 else np.int64  # blocks such that the index costs at most 1/8 of the base
        need = 8 * n_present * np.dtype(count).itemsize // max(1, d.bits // 8)
        block = max(MIN_BLOCK, 1 << (need - 1).bit_length())
        if bits.size < self.min_blocks * block:
            self._entries[name] = _Entry(fp, d, bits.size, None)
            return None
        slot = np.where(present, np.cumsum(present) - 1, -1).astype(np.int64)
        tree = np.empty((n_present, -(-bits.size // block)), dtype=count)
        tree_build(bits, block, *r, slot, tree)
        found = ClassTree(block, tree, slot)
        self._entries[name] = _Entry(fp, d, bits.size, found)
        log.debug("class index of %s: %d classes x %d blocks of %d (%d bytes)", name, *tree.shape, block, tree.nbytes)
        return found

    def drop(self, name: str) -> None:
        self._entries.pop(name, None)

    def moved(self, name: str, positions: np.ndarray, old: np.ndarray, new: np.ndarray, fp: int, to_fp: int) -> None:
        """Tensor ``name`` (fingerprint ``fp``) now holds ``new`` bits at ``positions`` (fingerprint ``to_fp``)."""
        e = self._entries.get(name)
        if e is None:
            return
        if e.fp != fp:
            del self._entries[name]  # describes another tensor: rebuilt when next needed
            return
        if e.tree is None:  # still too small to index
            e.fp = to_fp
            return
        rule = class_rule(e.dtype)
        r = (rule.s1, rule.m1, rule.s2, rule.m2, rule.w1)
        t = e.tree
        while (j := int(tree_move(t.tree, t.slot, t.block, positions, old, new, *r))) != -1:
            if j < 0:
                del self._entries[name]
                return
            # a value entered a class the tensor lacked: one more (empty) tree for it, then the rest
            u = int(new[j])
            c = ((u >> rule.s1) & rule.m1) | (((u >> rule.s2) & rule.m2) << rule.w1)
            t.slot[c] = t.tree.shape[0]
            t.tree = np.concatenate([t.tree, np.zeros((1, t.tree.shape[1]), dtype=t.tree.dtype)])
            positions, old, new = positions[j:], old[j:], new[j:]
        e.fp = to_fp
