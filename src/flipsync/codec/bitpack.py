"""MSB-first bit packing (numba): the coders' bit writer, and the fixed-width value coder ``bits``. Unpackers
read untrusted bytes: a malformed stream returns a negative status, never reads past the buffer."""

from __future__ import annotations

from typing import Any, ClassVar

import numba
import numpy as np

from flipsync.codec.coders import CORRUPT, OK, TRUNCATED, Params, SymbolCoder, get_int
from flipsync.codec.jit import clz64, kernel
from flipsync.errors import CorruptPatchError


@numba.njit(inline="always")
def put_bits(
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
def bit_at(data: np.ndarray, p: int) -> int:
    return (data[p >> 3] >> (7 - (p & 7))) & 1


@numba.njit(inline="always")
def read_bits(data: np.ndarray, p: int, width: int) -> np.uint64:
    """The ``width`` bits from bit ``p`` (the caller bounds-checks)."""
    v = np.uint64(0)
    for t in range(width):
        v = (v << np.uint64(1)) | np.uint64(bit_at(data, p + t))
    return v


@numba.njit(inline="always")
def flush_bits(out: np.ndarray, j: int, acc: np.uint64, nacc: int) -> int:
    """Write the last partial byte (zero-padded); returns the number of bytes used."""
    if nacc > 0:
        out[j] = np.uint8((acc << np.uint64(8 - nacc)) & np.uint64(0xFF))
        j += 1
    return j


@numba.njit(inline="always")
def put_rice(out: np.ndarray, j: int, acc: np.uint64, nacc: int, g: np.uint64, k: int) -> tuple[int, np.uint64, int]:
    """Append one Rice code: the quotient in unary (q zeros, then a one), then the k low bits."""
    q = g >> np.uint64(k)
    while q >= np.uint64(32):  # long zero runs, 32 at a time
        j, acc, nacc = put_bits(out, j, acc, nacc, np.uint64(0), 32)
        q -= np.uint64(32)
    j, acc, nacc = put_bits(out, j, acc, nacc, np.uint64(1), int(q) + 1)
    return put_bits(out, j, acc, nacc, g, k)  # put_bits keeps only the k low bits


@numba.njit(inline="always")
def put_bytes(out: np.ndarray, j: int, acc: np.uint64, nacc: int) -> tuple[int, int]:
    while nacc >= 8:
        nacc -= 8
        out[j] = np.uint8((acc >> np.uint64(nacc)) & np.uint64(0xFF))
        j += 1
    return j, nacc


@kernel
def pack_codes(values: np.ndarray, param: int, rice: bool, out: np.ndarray) -> int:
    """Each value as a Rice code with parameter ``param`` (``rice``), or in ``param`` bits (1..64); returns the
    number of bytes used. A code of at most 56 bits goes into the 64-bit accumulator whole, flushed 32 bits at
    a time; longer ones take ``put_bits``' general path."""
    acc = np.uint64(0)
    nacc = 0
    j = 0
    k = np.uint64(param)
    low = (np.uint64(1) << k) - np.uint64(1) if param < 64 else np.uint64(0xFFFFFFFFFFFFFFFF)
    for x in values:
        v = np.uint64(x)
        if rice:
            q = v >> k
            width = int(q) + 1 + param if q < np.uint64(56) else 64
            code = (np.uint64(1) << k) | (v & low)
        else:
            width = param
            code = v & low
        if width > 56:
            if rice:
                j, acc, nacc = put_rice(out, j, acc, nacc, v, param)
            else:
                j, acc, nacc = put_bits(out, j, acc, nacc, v, param)
            continue
        if nacc + width > 64:
            j, nacc = put_bytes(out, j, acc, nacc)
        acc = (acc << np.uint64(width)) | code
        nacc += width
        if nacc >= 32:  # flush the 32 bits above the low nacc - 32
            nacc -= 32
            word = acc >> np.uint64(nacc)
            out[j] = np.uint8((word >> np.uint64(24)) & np.uint64(0xFF))
            out[j + 1] = np.uint8((word >> np.uint64(16)) & np.uint64(0xFF))
            out[j + 2] = np.uint8((word >> np.uint64(8)) & np.uint64(0xFF))
            out[j + 3] = np.uint8(word & np.uint64(0xFF))
            j += 4
    j, nacc = put_bytes(out, j, acc, nacc)
    return flush_bits(out, j, acc, nacc)


@kernel
def exp_golomb_bits(values: np.ndarray, k: int) -> int:
    """Bits of the order-``k`` Exp-Golomb codes of ``values`` (each below 2**62)."""
    total = 0
    for v in values:
        total += 2 * (64 - int(clz64(v + (np.uint64(1) << np.uint64(k))))) - 1 - k  # type: ignore[call-arg]
    return total


@kernel
def pack_exp_golomb(values: np.ndarray, k: int, out: np.ndarray) -> int:
    """Order-``k`` Exp-Golomb codes (x = v + 2**k after b - 1 - k zeros, v < 2**62); returns the bytes used."""
    acc = np.uint64(0)
    nacc = 0
    j = 0
    for v in values:
        x = v + (np.uint64(1) << np.uint64(k))
        b = 64 - int(clz64(x))  # type: ignore[call-arg]
        j, acc, nacc = put_bits(out, j, acc, nacc, np.uint64(0), b - 1 - k)
        j, acc, nacc = put_bits(out, j, acc, nacc, x, b)
    return flush_bits(out, j, acc, nacc)


@kernel
def unpack_exp_golomb(data: np.ndarray, k: int, out: np.ndarray) -> int:
    """Decode len(out) order-``k`` Exp-Golomb codes; TRUNCATED, or CORRUPT for a code over 63 bits."""
    p = 0
    total = data.shape[0] * 8
    for i in range(out.shape[0]):
        z = 0
        while True:
            if p >= total:
                return TRUNCATED
            if bit_at(data, p):
                break
            z += 1
            p += 1
        if z + k > 62:
            return CORRUPT
        width = z + k + 1
        if p + width > total:
            return TRUNCATED
        out[i] = read_bits(data, p, width) - (np.uint64(1) << np.uint64(k))
        p += width
    return OK


@kernel
def fixed_unpack(data: np.ndarray, width: int, out: np.ndarray) -> int:
    if out.shape[0] * width > data.shape[0] * 8:
        return TRUNCATED
    for i in range(out.shape[0]):
        out[i] = read_bits(data, i * width, width)
    return OK


def _width(symbols: np.ndarray) -> int:
    return max(1, int(symbols.max()).bit_length()) if symbols.size else 1


class FixedWidthCoder(SymbolCoder):
    """Every value in the same number of bits: no tables, so the best choice for a handful of values."""

    codec_id: ClassVar[str] = "bits"

    def encode(self, symbols: np.ndarray, base: Any = None) -> tuple[Params, bytes]:
        v = np.ascontiguousarray(symbols, dtype=np.uint64)
        width = _width(v)
        out = np.empty((v.size * width + 7) // 8, dtype=np.uint8)
        used = pack_codes(v, width, False, out)
        return {"bits": width}, out[:used].tobytes()

    def estimate(self, symbols: np.ndarray, base: Any = None) -> int:
        return (symbols.size * _width(symbols) + 7) // 8  # exact

    def decode(self, params: Params, blob: bytes, n: int) -> np.ndarray:
        width = get_int(params, "bits", range(1, 65))
        if n * width > 8 * len(blob):  # before allocating: n comes from a header that may be crafted
            raise CorruptPatchError(f"fixed-width stream of {len(blob)} bytes cannot hold {n} values of {width} bits")
        out = np.empty(n, dtype=np.uint64)
        if fixed_unpack(np.frombuffer(blob, dtype=np.uint8), width, out) != OK:
            raise CorruptPatchError("fixed-width stream is truncated")
        return out
