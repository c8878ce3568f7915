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

The passes themselves are numba kernels, in ``codec.context_kernels``.
"""

from __future__ import annotations

import logging
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np

from flipsync.codec.bits import DType
from flipsync.codec.class_index import (
    MIN_BLOCK,
    BaseBits,
    ClassRule,
    ClassTree,
    class_rule,
    count_classes,
    tree_rows,
)
from flipsync.codec.coders import CORRUPT, OK, Params, PositionCoder, get_int
from flipsync.codec.context_kernels import (
    chunk_offsets,
    class_ranks,
    countdowns,
    decode_ranks,
    emit_from,
    group_gaps,
    pack_stream,
    place_ranks,
)
from flipsync.codec.rice import best_rice_k, rice_bits
from flipsync.errors import CorruptPatchError

_K_BITS = 6  # a class's Rice parameter, 0..62
_DENSE = 0.12  # from this share of changed elements the branch-free pass is faster (measured: 1.5-21% changed)
_PLACE_UPTO = 1.0  # changes per index block up to which reading only their blocks beats a pass (measured: 1.2)
log = logging.getLogger(__name__)


def classes_and_ranks(base: np.ndarray, positions: np.ndarray, d: DType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(elements per class, class of each position, rank of each position within its class)."""
    rule = class_rule(d)
    counts = np.zeros(rule.n_classes, dtype=np.int64)
    cls = np.empty(positions.size, dtype=np.int64)
    rank = np.empty(positions.size, dtype=np.int64)
    class_ranks(np.ascontiguousarray(base).reshape(-1), np.ascontiguousarray(positions, np.int64), rule.s1, rule.m1,
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
        group_gaps(cls, rank, (np.cumsum(per_class) - per_class).astype(np.int64), gaps)
        rice_k = np.array([best_rice_k(gaps[s : s + k]) for s, k in zip(starts, k_of, strict=True)], dtype=np.int64)
        cbits = max(1, rule.n_classes.bit_length())
        nbits = max(1, int(k_of.max() - 1).bit_length())
        size = used.size * (2 * cbits + 1 + nbits + 2 * _K_BITS + 3)  # at most, with the gamma codes
        size += sum(rice_bits(gaps[s : s + k], int(rk)) for s, k, rk in zip(starts, k_of, rice_k, strict=True))
        out = np.empty((size + 7) // 8, dtype=np.uint8)
        n_bytes = pack_stream(used.astype(np.int64), k_of.astype(np.int64), rice_k, gaps, nbits, out)
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
        status = decode_ranks(data, n_used, nbits, rule.n_classes, numel, first, end, ranks)
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
            class_ranks(bits, positions, *r, np.zeros(rule.n_classes, dtype=np.int64), cls, rank)
            return cls, rank
        bounds = np.linspace(0, bits.size, n_chunks + 1).astype(np.int64)
        cuts = np.searchsorted(positions, bounds)
        before = np.zeros((n_chunks, rule.n_classes), dtype=np.int64)

        def ranks(j: int) -> None:
            lo, hi, a, b = bounds[j], bounds[j + 1], cuts[j], cuts[j + 1]
            class_ranks(bits[lo:hi], positions[a:b] - lo, *r, before[j].copy(), cls[a:b], rank[a:b])

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
            status = int(place_ranks(bits, index.block, index.tree, index.slot, *r, first, end, ranks, out))
            out.sort()
            return status
        workers = self._workers()
        after, home = countdowns(first, end, ranks)
        n_chunks = min(-(-bits.size // max(self.chunk, index.block if index else 1)), 4 * workers)
        if workers < 2 or n_chunks < 2 or bits.size < self.parallel_from:
            before = np.zeros(rule.n_classes, dtype=np.int64)
            dense = out.size >= self.dense_from * bits.size
            return int(emit_from(bits, 0, bits.size, *r, first, end, ranks, home, after, before, out, dense))
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
            chunk_offsets(before, first, end, ranks, offs[:-1])
            offs[-1] = out.size  # a rank past its class's size in this base: the last chunk cannot emit it

            def emit(j: int) -> int:
                lo, hi = int(offs[j]), int(offs[j + 1])
                if lo == hi:
                    return OK
                a, b = bounds[j], bounds[j + 1]
                dense = hi - lo >= self.dense_from * (b - a)
                return int(emit_from(bits, a, b, *r, first, end, ranks, home, after, before[j], out[lo:hi], dense))

            statuses = list(pool.map(emit, range(n_chunks)))
        return OK if all(st == OK for st in statuses) else CORRUPT
