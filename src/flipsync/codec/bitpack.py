"""Bit-level kernels (numba): Golomb-Rice and fixed-width packing of unsigned integers.

Bits are written MSB-first. The unpackers read untrusted bytes, so every read is bounds-checked and a
malformed stream returns a negative status instead of reading past the buffer.
"""

from __future__ import annotations

import numba
import numpy as np

OK, TRUNCATED, OVERFLOW = 0, -1, -2


@numba.njit(nogil=True, cache=True)
def rice_bits(gaps: np.ndarray, k: int) -> int:
    total = 0
    for g in gaps:
        total += (g >> np.uint64(k)) + np.uint64(k + 1)
    return total


@numba.njit(inline="always")
def _put(
    out: np.ndarray, j: int, acc: np.uint64, nacc: int, value: np.uint64, width: int
) -> tuple[int, np.uint64, int]:
    """Append the low ``width`` bits (at most 64) of ``value``; flush whole bytes. Returns (j, acc, nacc)."""
    remaining = width
    while remaining > 0:
        take = min(remaining, 32)
        remaining -= take
        part = (value >> np.uint64(remaining)) & ((np.uint64(1) << np.uint64(take)) - np.uint64(1))
        acc = (acc << np.uint64(take)) | part
        nacc += take
        while nacc >= 8:
            out[j] = np.uint8((acc >> np.uint64(nacc - 8)) & np.uint64(0xFF))
            j += 1
            nacc -= 8
    return j, acc, nacc


@numba.njit(inline="always")
def _flush(out: np.ndarray, j: int, acc: np.uint64, nacc: int) -> int:
    if nacc > 0:
        out[j] = np.uint8((acc << np.uint64(8 - nacc)) & np.uint64(0xFF))
        j += 1
    return j


@numba.njit(nogil=True, cache=True)
def rice_pack(gaps: np.ndarray, k: int, out: np.ndarray) -> int:
    """Each gap as its quotient in unary (q zeros, then a one) followed by its k low bits."""
    acc = np.uint64(0)
    nacc = 0
    j = 0
    for g in gaps:
        q = g >> np.uint64(k)
        while q >= np.uint64(32):  # long zero runs, 32 at a time
            j, acc, nacc = _put(out, j, acc, nacc, np.uint64(0), 32)
            q -= np.uint64(32)
        j, acc, nacc = _put(out, j, acc, nacc, np.uint64(1), int(q) + 1)
        j, acc, nacc = _put(out, j, acc, nacc, g, k)  # _put keeps only the k low bits
    return _flush(out, j, acc, nacc)


@numba.njit(nogil=True, cache=True)
def rice_unpack(data: np.ndarray, k: int, out: np.ndarray) -> int:
    """Decode len(out) gaps; returns OK, TRUNCATED or OVERFLOW (quotient too large for 64 bits)."""
    nbits = data.shape[0] * 8
    p = 0
    for i in range(out.shape[0]):
        q = 0
        while True:  # unary part: skip zero bits, whole zero bytes at a time
            if p >= nbits:
                return TRUNCATED
            if (p & 7) == 0 and data[p >> 3] == 0:
                q += 8
                p += 8
                continue
            bit = (data[p >> 3] >> (7 - (p & 7))) & 1
            p += 1
            if bit:
                break
            q += 1
        if q > (0x7FFFFFFFFFFFFFFF >> k):
            return OVERFLOW
        if p + k > nbits:
            return TRUNCATED
        low = np.uint64(0)
        for _ in range(k):
            low = (low << np.uint64(1)) | np.uint64((data[p >> 3] >> (7 - (p & 7))) & 1)
            p += 1
        out[i] = (np.uint64(q) << np.uint64(k)) | low
    return OK


@numba.njit(nogil=True, cache=True)
def fixed_pack(values: np.ndarray, width: int, out: np.ndarray) -> int:
    """Each value in ``width`` bits (1..64)."""
    acc = np.uint64(0)
    nacc = 0
    j = 0
    for v in values:
        j, acc, nacc = _put(out, j, acc, nacc, v, width)
    return _flush(out, j, acc, nacc)


@numba.njit(nogil=True, cache=True)
def fixed_unpack(data: np.ndarray, width: int, out: np.ndarray) -> int:
    if out.shape[0] * width > data.shape[0] * 8:
        return TRUNCATED
    p = 0
    for i in range(out.shape[0]):
        v = np.uint64(0)
        for _ in range(width):
            v = (v << np.uint64(1)) | np.uint64((data[p >> 3] >> (7 - (p & 7))) & 1)
            p += 1
        out[i] = v
    return OK
