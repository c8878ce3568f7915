"""The ``ctx`` position coder: per class of the base value (``class_index.class_rule``), the ranks of the changed
elements among the class's elements, about sum over classes of log2 C(N_c, k_c) bits. The stream layout and the
decoder's passes: docs/codec.md ("Positions conditioned on the base")."""

from __future__ import annotations

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


def conditional_position_bits(base: np.ndarray, positions: np.ndarray, d: DType) -> float:
    """sum over classes of log2 C(N_c, k_c): the bound the ``ctx`` coder aims at."""
    rule = class_rule(d)
    counts = np.zeros(rule.n_classes, dtype=np.int64)
    cls, rank = np.empty(positions.size, dtype=np.int64), np.empty(positions.size, dtype=np.int64)
    class_ranks(np.ascontiguousarray(base).reshape(-1), np.ascontiguousarray(positions, np.int64), rule.s1, rule.m1,
           rule.s2, rule.m2, rule.w1, counts, cls, rank)  # fmt: skip
    k = np.bincount(cls, minlength=counts.size)
    used = np.flatnonzero(k)
    lg = math.lgamma
    return sum((lg(counts[c] + 1.0) - lg(k[c] + 1.0) - lg(counts[c] - k[c] + 1.0)) / math.log(2) for c in used)


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
        dense_from: float = 0.12,
        place_upto: float = 1.0,
    ) -> None:
        """``chunk``: elements per chunk of a pass over a base of at least ``parallel_from`` elements, on
        ``workers`` threads (default: every core, from 4); a pass with ``dense_from`` of its elements changed
        runs branch-free (faster from there: measured 1.5-21% changed); up to ``place_upto`` changes per index
        block are placed by the class index (reading only their blocks beats a pass there: measured 1.2)."""
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
        rice_k = np.array([best_rice_k(gaps[s : s + k])[0] for s, k in zip(starts, k_of, strict=True)], dtype=np.int64)
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
            tree = None  # the base's class index where it may pay (few changes per block, or a chunked decode)
            if base.index is not None and (n * MIN_BLOCK <= self.place_upto * numel or self._chunks(numel) != 1):
                tree = base.index.tree(base.name, bits, base.dtype, base.fp)
            status = self._positions(bits, rule, first, end, ranks, out, tree)
        if status != OK:
            raise CorruptPatchError("ctx position stream is truncated, corrupt, or not coded against this base")
        return out

    def _chunks(self, numel: int, block: int = 1) -> int:
        """How many chunks a pass over ``numel`` elements runs in; 1: one pass on this thread."""
        workers = self._workers()
        n = min(-(-numel // max(self.chunk, block)), 4 * workers)
        return n if workers >= 2 and n >= 2 and numel >= self.parallel_from else 1

    def _workers(self) -> int:
        # The counting pass adds about half a pass of work, and stage already spreads a patch's sections over
        # the cores: by default, chunks only where there are at least 4 (on 2 busy cores they measured slower).
        cores = os.cpu_count() or 1
        return self.workers or (cores if cores >= 4 else 1)

    def _classes_and_ranks(self, bits: np.ndarray, positions: np.ndarray, rule: ClassRule) -> tuple[np.ndarray, ...]:
        """Each position's class and rank in it: one pass, or the decoder's chunks for a large base."""
        r = (rule.s1, rule.m1, rule.s2, rule.m2, rule.w1)
        positions = np.ascontiguousarray(positions, np.int64)
        cls = np.empty(positions.size, dtype=np.int64)
        rank = np.empty(positions.size, dtype=np.int64)
        n_chunks = self._chunks(bits.size)
        if n_chunks == 1:
            class_ranks(bits, positions, *r, np.zeros(rule.n_classes, dtype=np.int64), cls, rank)
            return cls, rank
        bounds = np.linspace(0, bits.size, n_chunks + 1).astype(np.int64)
        cuts = np.searchsorted(positions, bounds)
        before = np.zeros((n_chunks, rule.n_classes), dtype=np.int64)

        def ranks(j: int) -> None:
            lo, hi, a, b = bounds[j], bounds[j + 1], cuts[j], cuts[j + 1]
            class_ranks(bits[lo:hi], positions[a:b] - lo, *r, before[j].copy(), cls[a:b], rank[a:b])

        with ThreadPoolExecutor(min(self._workers(), n_chunks), thread_name_prefix="flipsync-ctx") as pool:
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
        """Ranks to positions: by the class index (few changes per block), one pass, or chunks on a pool."""
        r = (rule.s1, rule.m1, rule.s2, rule.m2, rule.w1)
        if index is not None and out.size * index.block <= self.place_upto * bits.size:
            status = int(place_ranks(bits, index.block, index.tree, index.slot, *r, first, end, ranks, out))
            out.sort()
            return status
        after, home = countdowns(first, end, ranks)
        n_chunks = self._chunks(bits.size, index.block if index else 1)
        if n_chunks == 1:
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
        with ThreadPoolExecutor(min(self._workers(), n_chunks), thread_name_prefix="flipsync-ctx") as pool:
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
