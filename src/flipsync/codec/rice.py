"""The Rice position coder: the gaps between changed positions, Golomb-Rice coded (MSB-first) with the best k
(within ~1% of log2 C(numel, n) for scattered changes)."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from flipsync.codec.bitpack import flush_bits, pack_codes, put_bytes, put_rice
from flipsync.codec.coders import OVERFLOW, TRUNCATED, Params, PositionCoder, get_int
from flipsync.codec.jit import clz64, kernel
from flipsync.errors import CorruptPatchError

MAX_RICE_K = 62


@kernel
def rice_bits(gaps: np.ndarray, k: int) -> int:
    total = 0
    for g in gaps:
        total += (g >> np.uint64(k)) + np.uint64(k + 1)
    return total


@kernel
def rice_decode_runs(
    data: np.ndarray, start_bit: int, ks: np.ndarray, counts: np.ndarray, out: np.ndarray, numel: int
) -> int:
    """Decode runs of Rice-coded gaps from one bit stream through a 64-bit bit buffer: run u is ``counts[u]``
    codes with parameter ``ks[u]``, written to ``out`` one after another. With ``numel >= 0`` each run's gaps
    become positions (from -1 in every run), one at or past ``numel`` an OVERFLOW; else the raw gaps are stored.
    Returns the bits read, or TRUNCATED / OVERFLOW. Invariant: ``buf`` holds ``nbuf`` unread bits MSB-aligned."""
    nbytes = data.shape[0]
    bp = start_bit >> 3
    buf = np.uint64(0)
    nbuf = 0
    limit = np.uint64(numel) if numel >= 0 else np.uint64(0)
    i = 0
    if start_bit & 7:  # enter mid-byte: the byte's unread low bits first
        if bp >= nbytes:
            return TRUNCATED
        nbuf = 8 - (start_bit & 7)
        buf = (np.uint64(data[bp]) << np.uint64(56 + (start_bit & 7))) & np.uint64(0xFFFFFFFFFFFFFFFF)
        bp += 1
    for u in range(ks.shape[0]):
        k = ks[u]
        pos = -1
        for _ in range(counts[u]):
            q = 0
            while True:  # unary part
                while nbuf <= 56 and bp < nbytes:
                    buf |= np.uint64(data[bp]) << np.uint64(56 - nbuf)
                    nbuf += 8
                    bp += 1
                if buf == 0:  # all buffered bits are zeros (or none are left)
                    if nbuf == 0:
                        return TRUNCATED
                    q += nbuf
                    nbuf = 0
                    continue
                z = int(clz64(buf))  # type: ignore[call-arg]  # numba passes typingctx itself
                q += z
                buf = (buf << np.uint64(z)) << np.uint64(1)  # two shifts: a shift by 64 is undefined
                nbuf -= z + 1
                break
            if q > (0x7FFFFFFFFFFFFFFF >> k):
                return OVERFLOW
            low = np.uint64(0)
            need = k
            while need > 0:  # at most 56 bits per refill; k may be up to 62
                while nbuf <= 56 and bp < nbytes:
                    buf |= np.uint64(data[bp]) << np.uint64(56 - nbuf)
                    nbuf += 8
                    bp += 1
                take = min(need, nbuf, 32)
                if take == 0:
                    return TRUNCATED
                low = (low << np.uint64(take)) | (buf >> np.uint64(64 - take))
                buf <<= np.uint64(take)
                nbuf -= take
                need -= take
            gap = (np.uint64(q) << np.uint64(k)) | low
            if numel >= 0:
                if gap >= limit or np.uint64(pos + 1) + gap >= limit:
                    return OVERFLOW
                pos += int(gap) + 1
                out[i] = pos
            else:
                out[i] = gap
            i += 1
    return bp * 8 - nbuf - start_bit


@kernel
def _quotient_sums(positions: np.ndarray, k0: int, out: np.ndarray) -> bool:
    """``out[i]`` += sum over the gaps of sorted unique ``positions`` of ``gap >> (k0 + i)``, for up to three i;
    False if the positions are not sorted, unique and non-negative. Written to vectorize (the order check OR-ed
    up rather than an early exit): ~0.3 ns per position instead of ~3."""
    n = positions.shape[0]
    if n == 0:
        return True
    s0, s1, s2 = np.uint64(k0), np.uint64(k0 + 1), np.uint64(min(k0 + 2, 63))
    first = positions[0]
    bad = first < 0
    g = np.uint64(first)
    a, b, c = g >> s0, g >> s1, g >> s2
    for i in range(1, n):
        x = positions[i]
        d = x - positions[i - 1] - 1
        bad |= (d < 0) | (x < 0)  # non-negative positions: d cannot wrap around
        g = np.uint64(d)
        a += g >> s0
        b += g >> s1
        c += g >> s2
    if bad:
        return False
    sums = (a, b, c)
    for i in range(out.shape[0]):
        out[i] += sums[i]
    return True


def _candidates(mean: float) -> range:
    """The Rice parameters worth trying for gaps of this mean: around the guess from it."""
    guess = max(0, int(np.log2(mean * 0.69 + 1.0)))
    return range(max(0, guess - 1), min(MAX_RICE_K, guess + 2))


@kernel
def _cheapest_k(gaps: np.ndarray, k0: int, k1: int) -> tuple[int, int]:
    """(k, bits) of the first cheapest Rice parameter in [k0, k1) (at most three), in one pass over the gaps."""
    s0, s1, s2 = np.uint64(k0), np.uint64(min(k0 + 1, 63)), np.uint64(min(k0 + 2, 63))
    a = b = c = np.uint64(0)
    for g in gaps:
        v = np.uint64(g)
        a += v >> s0
        b += v >> s1
        c += v >> s2
    sums = (a, b, c)
    n = gaps.shape[0]
    best_k, best = k0, int(a) + n * (k0 + 1)
    for k in range(k0 + 1, k1):
        bits = int(sums[k - k0]) + n * (k + 1)
        if bits < best:
            best_k, best = k, bits
    return best_k, best


def best_rice_k(gaps: np.ndarray) -> tuple[int, int]:
    """(k, bits) of the Rice parameter that codes ``gaps`` in the fewest bits (searched around the mean's guess)."""
    candidates = _candidates(float(gaps.mean()) if gaps.size else 0.0)
    k, bits = _cheapest_k(gaps, candidates.start, candidates.stop)
    return int(k), int(bits)


def rice_encode(gaps: np.ndarray) -> tuple[Params, bytes]:
    """Golomb-Rice code of non-negative gaps with the cheapest parameter k."""
    g = np.ascontiguousarray(gaps, dtype=np.uint64)
    k, bits = best_rice_k(g)
    out = np.empty((bits + 7) // 8, dtype=np.uint8)
    used = pack_codes(g, k, True, out)
    return {"k": k}, out[:used].tobytes()


def _rice_plan(p: np.ndarray) -> tuple[int, int]:
    """(k, bits) of the Rice code of the gaps of sorted unique int64 positions ``p``."""
    n = p.size
    mean = (int(p[-1]) + 1 - n) / n if n else 0.0  # the gaps sum to last + 1 - n
    candidates = _candidates(mean)
    sums = np.zeros(len(candidates), dtype=np.uint64)
    if not _quotient_sums(p, candidates.start, sums):
        raise ValueError("positions must be sorted and unique")
    bits = [int(sums[k - candidates.start]) + n * (k + 1) for k in candidates]
    best = bits.index(min(bits))  # the first cheapest
    return candidates[best], bits[best]


@kernel
def _pack_rice_gaps(positions: np.ndarray, k: int, out: np.ndarray) -> int:
    """``pack_codes``' Rice code of the gaps of sorted ``positions``, for ``out`` with 4 bytes to spare: 32 bits
    are stored after every short code, complete or not, advancing only when they are (no branch on the
    unpredictable moment a word fills up)."""
    acc = np.uint64(0)
    nacc = 0
    j = 0
    kk = np.uint64(k)
    lead = np.uint64(1) << kk  # the unary part's closing one, just above the k low bits
    low = lead - np.uint64(1)
    short = np.uint64(32 - k) if k < 32 else np.uint64(0)  # quotients below this make codes of <= 32 bits
    prev = np.int64(-1)
    for x in positions:
        v = np.uint64(x - prev - 1)
        prev = np.int64(x)
        q = v >> kk
        if q < short:
            width = int(q) + 1 + k
            acc = (acc << np.uint64(width)) | lead | (v & low)
            nacc += width
            full = nacc >= 32
            word = acc >> np.uint64(nacc - 32 if full else 0)
            out[j] = np.uint8((word >> np.uint64(24)) & np.uint64(0xFF))
            out[j + 1] = np.uint8((word >> np.uint64(16)) & np.uint64(0xFF))
            out[j + 2] = np.uint8((word >> np.uint64(8)) & np.uint64(0xFF))
            out[j + 3] = np.uint8(word & np.uint64(0xFF))
            j += 4 * full
            nacc -= 32 * full
        else:  # nacc < 32 here, as put_rice needs
            j, acc, nacc = put_rice(out, j, acc, nacc, v, k)
    j, nacc = put_bytes(out, j, acc, nacc)
    return flush_bits(out, j, acc, nacc)


def rice_decode(params: Params, blob: bytes, n: int, numel: int | None = None) -> np.ndarray:
    """The n gaps (uint64); with ``numel``, straight to sorted positions below it (int64) in one compiled pass."""
    k = get_int(params, "k", range(MAX_RICE_K + 1))
    if n > 8 * len(blob):  # every value takes at least one bit
        raise CorruptPatchError(f"rice stream of {len(blob)} bytes cannot hold {n} values")
    out = np.empty(n, dtype=np.uint64 if numel is None else np.int64)
    ks, counts = np.array([k], np.int64), np.array([n], np.int64)
    used = rice_decode_runs(np.frombuffer(blob, dtype=np.uint8), 0, ks, counts, out, -1 if numel is None else numel)
    if used == OVERFLOW and numel is not None:
        raise CorruptPatchError(f"positions run past the end of a tensor of {numel} elements")
    if used < 0:
        raise CorruptPatchError("rice stream is truncated or corrupt")
    return out


class RiceCoder(PositionCoder):
    codec_id: ClassVar[str] = "rice"

    def encode(self, positions: np.ndarray, base: Any = None) -> tuple[Params, bytes]:
        """``rice_encode`` of the gaps of sorted unique positions, the same bytes, without building the gaps."""
        p = np.ascontiguousarray(positions, dtype=np.int64)
        k, bits = _rice_plan(p)
        out = np.empty((bits + 7) // 8 + 4, dtype=np.uint8)
        used = int(_pack_rice_gaps(p, k, out))
        return {"k": k}, out[:used].tobytes()

    def estimate(self, positions: np.ndarray, base: Any = None) -> int:
        return (_rice_plan(np.ascontiguousarray(positions, dtype=np.int64))[1] + 7) // 8  # exact

    def decode(self, params: Params, blob: bytes, n: int, numel: int, base: Any = None) -> np.ndarray:
        return rice_decode(params, blob, n, numel)
