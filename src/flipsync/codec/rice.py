"""The Rice position coder: changed positions as gaps, each a Golomb-Rice code with the best parameter k.

Within ~1% of the entropy bound log2 C(numel, n) for scattered changes. Bits are MSB-first (see
``bitpack``); the decoder (numba) reads untrusted bytes through a 64-bit bit buffer, bounds-checks every
read and turns gaps into positions in the same pass, refusing any at or past the tensor's end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import numba
import numpy as np

from flipsync.codec.bitpack import clz64, pack_codes
from flipsync.codec.coders import OK, OVERFLOW, TRUNCATED, Params, PositionCoder, get_int
from flipsync.errors import CorruptPatchError

MAX_RICE_K = 62


@numba.njit(nogil=True, cache=True)
def rice_bits(gaps: np.ndarray, k: int) -> int:
    total = 0
    for g in gaps:
        total += (g >> np.uint64(k)) + np.uint64(k + 1)
    return total


def rice_pack(gaps: np.ndarray, k: int, out: np.ndarray) -> int:
    """Each gap as its quotient in unary (q zeros, then a one) followed by its k low bits."""
    return int(pack_codes(gaps, k, True, out))


@numba.njit(nogil=True, cache=True)
def rice_decode_runs(
    data: np.ndarray, start_bit: int, ks: np.ndarray, counts: np.ndarray, out: np.ndarray, numel: int
) -> int:
    """Decode runs of Rice-coded gaps from one bit stream through a 64-bit bit buffer (one leading-zero count
    per quotient): run u is ``counts[u]`` codes with parameter ``ks[u]``, written to ``out`` one after another.

    With ``numel >= 0`` each run's gaps are turned into positions on the fly (running sum of gap + 1, starting
    at -1 in every run) and one at or past ``numel`` is an OVERFLOW; with ``numel < 0`` the raw gaps are stored.
    Returns the number of bits read (from ``start_bit``), or TRUNCATED / OVERFLOW (a quotient too large).
    Invariant: ``buf`` holds ``nbuf`` unread bits MSB-aligned and zeros below them.
    """
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


def _rice_decode(data: np.ndarray, k: int, out: np.ndarray, numel: int) -> int:
    used = rice_decode_runs(data, 0, np.array([k], np.int64), np.array([out.shape[0]], np.int64), out, numel)
    return OK if used >= 0 else int(used)


def rice_unpack(data: np.ndarray, k: int, out: np.ndarray) -> int:
    """Decode len(out) gaps (uint64); returns OK, TRUNCATED or OVERFLOW (quotient too large for 64 bits)."""
    return int(_rice_decode(data, k, out, -1))


def rice_unpack_positions(data: np.ndarray, k: int, out: np.ndarray, numel: int) -> int:
    """Decode len(out) gaps straight into sorted positions (int64) below ``numel``, in one pass.

    Returns OK, TRUNCATED, or OVERFLOW (a quotient too large, or a position at or past ``numel``).
    """
    return int(_rice_decode(data, k, out, numel))


@numba.njit(nogil=True, cache=True)
def _quotient_sums(positions: np.ndarray, k0: int, out: np.ndarray) -> bool:
    """``out[i]`` = sum over the gaps of sorted unique ``positions`` of ``gap >> (k0 + i)``, in one pass and
    without a gap array; False if the positions are not sorted and unique."""
    prev = np.int64(-1)
    for x in positions:
        if x <= prev:
            return False
        g = np.uint64(x - prev - 1)
        prev = np.int64(x)
        for i in range(out.shape[0]):
            out[i] += g >> np.uint64(k0 + i)
    return True


def _candidates(mean: float) -> range:
    """The Rice parameters worth trying for gaps of this mean: around the guess from it."""
    guess = max(0, int(np.log2(mean * 0.69 + 1.0)))
    return range(max(0, guess - 1), min(MAX_RICE_K, guess + 2))


def _best_k(candidates: range, bits_for: Callable[[int], int]) -> tuple[int, int]:
    """(k, bits) of the cheapest of the candidate Rice parameters."""
    return min(((k, bits_for(k)) for k in candidates), key=lambda kb: kb[1])


def best_rice_k(gaps: np.ndarray) -> int:
    """The Rice parameter that codes ``gaps`` in the fewest bits (searched around the mean's guess)."""
    mean = float(gaps.mean()) if gaps.size else 0.0
    return _best_k(_candidates(mean), lambda k: rice_bits(gaps, k))[0]


def rice_encode(gaps: np.ndarray) -> tuple[Params, bytes]:
    """Golomb-Rice code of non-negative gaps with the cheapest parameter k."""
    g = np.ascontiguousarray(gaps, dtype=np.uint64)
    k = best_rice_k(g)
    out = np.empty((rice_bits(g, k) + 7) // 8, dtype=np.uint8)
    used = rice_pack(g, k, out)
    return {"k": k}, out[:used].tobytes()


def rice_encode_positions(positions: np.ndarray) -> tuple[Params, bytes]:
    """``rice_encode`` of the gaps of sorted unique positions, the same bytes, without building the gaps."""
    p = np.ascontiguousarray(positions, dtype=np.int64)
    n = p.size
    mean = (int(p[-1]) + 1 - n) / n if n else 0.0  # the gaps sum to last + 1 - n
    candidates = _candidates(mean)
    sums = np.zeros(len(candidates), dtype=np.uint64)
    if not _quotient_sums(p, candidates.start, sums):
        raise ValueError("positions must be sorted and unique")
    k, bits = _best_k(candidates, lambda k: int(sums[k - candidates.start]) + n * (k + 1))
    out = np.empty((bits + 7) // 8, dtype=np.uint8)
    used = int(pack_codes(p, k, True, out, True))
    return {"k": k}, out[:used].tobytes()


def rice_decode(params: Params, blob: bytes, n: int, numel: int | None = None) -> np.ndarray:
    """The n gaps (uint64); with ``numel``, straight to sorted positions below it (int64) in one compiled pass."""
    k = get_int(params, "k", range(MAX_RICE_K + 1))
    if n > 8 * len(blob):  # every value takes at least one bit
        raise CorruptPatchError(f"rice stream of {len(blob)} bytes cannot hold {n} values")
    data = np.frombuffer(blob, dtype=np.uint8)
    if numel is None:
        out = np.empty(n, dtype=np.uint64)
        status = rice_unpack(data, k, out)
    else:
        out = np.empty(n, dtype=np.int64)
        status = rice_unpack_positions(data, k, out, numel)
        if status == OVERFLOW:
            raise CorruptPatchError(f"positions run past the end of a tensor of {numel} elements")
    if status != OK:
        raise CorruptPatchError("rice stream is truncated or corrupt")
    return out


class RiceCoder(PositionCoder):
    """Positions as Rice-coded gaps; decoded straight to positions (the gaps never exist as an array)."""

    codec_id: ClassVar[str] = "rice"

    def encode(self, positions: np.ndarray, base: Any = None) -> tuple[Params, bytes]:
        return rice_encode_positions(positions)

    def decode(self, params: Params, blob: bytes, n: int, numel: int, base: Any = None) -> np.ndarray:
        return rice_decode(params, blob, n, numel)
