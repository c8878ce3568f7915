"""Bit-level kernels (numba): Golomb-Rice and fixed-width packing of unsigned integers.

Bits are written MSB-first. The unpackers read untrusted bytes, so every read is bounds-checked and a
malformed stream returns a negative status instead of reading past the buffer.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

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


@intrinsic
def _clz64(typingctx, x):
    """Count leading zeros of a nonzero uint64 (one instruction; numba has no builtin for it)."""
    sig = types.uint64(types.uint64)

    def codegen(context, builder, signature, args):
        return builder.ctlz(args[0], ir.Constant(ir.IntType(1), 0))

    return sig, codegen


@numba.njit(nogil=True, cache=True)
def _rice_decode(data: np.ndarray, k: int, out: np.ndarray, numel: int) -> int:
    """Decode len(out) Rice-coded gaps through a 64-bit bit buffer (one leading-zero count per quotient).

    With ``numel >= 0`` the gaps are turned into positions on the fly (running sum of gap + 1, starting at
    -1) and a position at or past ``numel`` is an OVERFLOW; with ``numel < 0`` the raw gaps are stored.
    Invariant: ``buf`` holds ``nbuf`` unread bits MSB-aligned and zeros below them.
    """
    nbytes = data.shape[0]
    bp = 0
    buf = np.uint64(0)
    nbuf = 0
    pos = -1
    limit = np.uint64(numel) if numel >= 0 else np.uint64(0)
    for i in range(out.shape[0]):
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
            z = int(_clz64(buf))  # type: ignore[call-arg]  # numba passes typingctx itself
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
    return OK


def rice_unpack(data: np.ndarray, k: int, out: np.ndarray) -> int:
    """Decode len(out) gaps (uint64); returns OK, TRUNCATED or OVERFLOW (quotient too large for 64 bits)."""
    return int(_rice_decode(data, k, out, -1))


def rice_unpack_positions(data: np.ndarray, k: int, out: np.ndarray, numel: int) -> int:
    """Decode len(out) gaps straight into sorted positions (int64) below ``numel``, in one pass.

    Returns OK, TRUNCATED, or OVERFLOW (a quotient too large, or a position at or past ``numel``).
    """
    return int(_rice_decode(data, k, out, numel))


@numba.njit(nogil=True, cache=True)
def unzigzag_into(z: np.ndarray, out: np.ndarray) -> None:
    """out[i] = the int64 (as uint64) whose zigzag code is z[i]; one pass (bits.unzigzag's kernel)."""
    one = np.uint64(1)
    for i in range(z.shape[0]):
        v = np.uint64(z[i])
        out[i] = (v >> one) ^ (np.uint64(0) - (v & one))


@numba.njit(inline="always")
def _order_key(u: np.uint64, half: np.uint64, top: np.uint64, kind: int) -> np.uint64:
    if kind == 0:  # sign-magnitude float: negative patterns reverse
        return top - u if u & half else u + half
    if kind == 1:  # two's complement
        return u ^ half
    return u


@numba.njit(nogil=True, cache=True)
def key_steps_into(old: np.ndarray, new: np.ndarray, bits: int, kind: int, out: np.ndarray) -> None:
    """out[i] = key(new[i]) - key(old[i]) mod 2**64, for patterns of width ``bits`` (kind 0 float, 1 int,
    2 uint): the order-key step of `bits.to_key` in one pass, without its int64 temporaries."""
    half = np.uint64(1) << np.uint64(bits - 1)
    top = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - bits)
    for i in range(old.shape[0]):
        out[i] = _order_key(np.uint64(new[i]), half, top, kind) - _order_key(np.uint64(old[i]), half, top, kind)


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


# ------------------------------------------------------------------------------------------------- rANS
# An encoder and decoder pair, compiled here: 64-bit states, 32-bit words, lower bound L = 2**31,
# frequencies summing to 2**prec (prec <= 16), so every value costs at most one word. The encoder works
# backwards from a known start state; the decoder reads the final states first and must end at exactly the
# start states with every word consumed, which catches most corruption before the fingerprint check does.
ANS_LOW = 1 << 31
CORRUPT = -3


@numba.njit(nogil=True, cache=True)
def ans_quantize(counts: np.ndarray, prec: int) -> np.ndarray:
    """Frequencies summing to 2**prec, in integer arithmetic (encoder and decoder must agree bit for bit).

    Every used symbol gets one slot, the rest are shared in proportion to the counts (floor), and what the
    floors leave over goes to the most frequent symbol (the first of equals). Needs counts.sum() < 2**47
    and at most 2**prec used symbols; compiled because small sections pay it per section.
    """
    m = counts.shape[0]
    freq = np.zeros(m, dtype=np.uint32)
    used = 0
    total = np.uint64(0)
    top = 0
    for s in range(m):
        if counts[s] > 0:
            used += 1
            total += counts[s]
            if counts[s] > counts[top]:
                top = s
    spare = np.uint64((1 << prec) - used)
    given = 0
    for s in range(m):
        if counts[s] > 0:
            freq[s] = np.uint32(np.uint64(1) + (counts[s] * spare) // total)
            given += int(freq[s])
    freq[top] += np.uint32((1 << prec) - given)
    return freq


@numba.njit(inline="always")
def _cumulative(freq: np.ndarray) -> np.ndarray:
    cum = np.empty(freq.shape[0], dtype=np.uint64)
    c = np.uint64(0)
    for s in range(freq.shape[0]):
        cum[s] = c
        c += np.uint64(freq[s])
    return cum


@numba.njit(nogil=True, cache=True)
def ans_pack(symbols: np.ndarray, freq: np.ndarray, prec: int, lanes: int, out: np.ndarray) -> int:
    """Encode ``symbols`` (indices into freq/cum) into the tail of ``out`` (uint32, len(symbols) + 2 * lanes
    words at least); returns the index of the first word used: the stream is ``out[start:]``.

    Value i goes through state i % lanes (interleaved rANS: the decoder's lanes form independent
    dependency chains); all lanes share one word stream, and the final states lead it, lane 0 first.
    """
    cum = _cumulative(freq)
    # One lane starts from state 0: its first ~31 bits of information fill the state instead of the
    # stream, which saves a word on small sections. Interleaved lanes must start at ANS_LOW, or a lane
    # still below it would take a word meant for another lane.
    x = np.full(lanes, np.uint64(ANS_LOW if lanes > 1 else 0), dtype=np.uint64)
    j = out.shape[0]
    bound = np.uint64((ANS_LOW >> prec) << 32)
    for i in range(symbols.shape[0] - 1, -1, -1):
        lane = i % lanes
        s = symbols[i]
        f = np.uint64(freq[s])
        v = x[lane]
        if v >= bound * f:
            j -= 1
            out[j] = np.uint32(v & np.uint64(0xFFFFFFFF))
            v >>= np.uint64(32)
        x[lane] = ((v // f) << np.uint64(prec)) + (v % f) + np.uint64(cum[s])
    if lanes == 1 and j == out.shape[0]:  # no stream words: the state alone, in as few words as it needs
        if x[0] >= np.uint64(1 << 32):
            out[j - 1] = np.uint32(x[0] & np.uint64(0xFFFFFFFF))
            out[j - 2] = np.uint32(x[0] >> np.uint64(32))
            return j - 2
        if x[0] > 0:
            out[j - 1] = np.uint32(x[0])
            return j - 1
        return j
    for lane in range(lanes - 1, -1, -1):
        out[j - 1] = np.uint32(x[lane] & np.uint64(0xFFFFFFFF))
        out[j - 2] = np.uint32(x[lane] >> np.uint64(32))
        j -= 2
    return j


@numba.njit(nogil=True, cache=True)
def ans_unpack(words: np.ndarray, freq: np.ndarray, prec: int, lanes: int, out: np.ndarray) -> int:
    """Decode len(out) symbols; OK, TRUNCATED (ran out of words) or CORRUPT (a lane did not end at the
    encoder's start state, or words are left over). ``lanes`` is 1 or 4; ``freq`` sums to 2**prec.

    One table entry per slot packs the symbol, its frequency and the slot's offset in the symbol's range,
    so a step is one load, one multiply and one add; four lanes keep four such chains in flight. The
    steps are written out by hand: a helper returning a tuple made numba's loop 15x slower.
    """
    nw = words.shape[0]
    if (lanes == 4 and nw < 8) or (lanes != 1 and lanes != 4):
        return TRUNCATED
    cum = _cumulative(freq)
    if freq.shape[0] == 0 or cum[-1] + np.uint64(freq[-1]) != np.uint64(1 << prec):
        return CORRUPT  # the table below must cover the slots exactly
    table = np.empty(1 << prec, dtype=np.uint64)
    for s in range(freq.shape[0]):
        for j in range(freq[s]):
            table[cum[s] + j] = (np.uint64(freq[s]) << np.uint64(32)) | (np.uint64(j) << np.uint64(16)) | np.uint64(s)
    # Zero words past the end: a round of reads may run over by up to 4 before ``r`` is checked.
    padded = np.zeros(nw + 4, dtype=np.uint32)
    padded[:nw] = words
    mask = np.uint64((1 << prec) - 1)
    p = np.uint64(prec)
    low = np.uint64(ANS_LOW)
    s32, s16, m16 = np.uint64(32), np.uint64(16), np.uint64(0xFFFF)
    n = out.shape[0]
    x = np.empty(lanes, dtype=np.uint64)
    for lane in range(lanes):
        x[lane] = (np.uint64(padded[2 * lane]) << s32) | np.uint64(padded[2 * lane + 1])
    r = 2 * lanes
    end = low
    if lanes == 1:  # see ans_pack: a lone state of 0, 1 or 2 words; it started from 0
        end = np.uint64(0)
        if nw < 2:
            x[0] = np.uint64(padded[0]) if nw == 1 else np.uint64(0)
            r = nw
    i = 0
    if lanes == 4:
        x0, x1, x2, x3 = x[0], x[1], x[2], x[3]
        while i + 4 <= n:
            e = table[x0 & mask]
            x0 = (e >> s32) * (x0 >> p) + ((e >> s16) & m16)
            if x0 < low:
                x0 = (x0 << s32) | np.uint64(padded[r])
                r += 1
            out[i] = e & m16
            e = table[x1 & mask]
            x1 = (e >> s32) * (x1 >> p) + ((e >> s16) & m16)
            if x1 < low:
                x1 = (x1 << s32) | np.uint64(padded[r])
                r += 1
            out[i + 1] = e & m16
            e = table[x2 & mask]
            x2 = (e >> s32) * (x2 >> p) + ((e >> s16) & m16)
            if x2 < low:
                x2 = (x2 << s32) | np.uint64(padded[r])
                r += 1
            out[i + 2] = e & m16
            e = table[x3 & mask]
            x3 = (e >> s32) * (x3 >> p) + ((e >> s16) & m16)
            if x3 < low:
                x3 = (x3 << s32) | np.uint64(padded[r])
                r += 1
            out[i + 3] = e & m16
            if r > nw:  # this round read pad words: the stream is short
                return TRUNCATED
            i += 4
        x[0], x[1], x[2], x[3] = x0, x1, x2, x3
    else:
        x0 = x[0]
        while i < n:
            e = table[x0 & mask]
            x0 = (e >> s32) * (x0 >> p) + ((e >> s16) & m16)
            if x0 < low and r < nw:  # below ANS_LOW with no words left: the encoder's first values
                x0 = (x0 << s32) | np.uint64(padded[r])
                r += 1
            out[i] = e & m16
            i += 1
        x[0] = x0
    while i < n:  # the last n % 4 values of four lanes (value i belongs to lane i % 4)
        lane = i % lanes
        v = x[lane]
        e = table[v & mask]
        v = (e >> s32) * (v >> p) + ((e >> s16) & m16)
        if v < low:
            v = (v << s32) | np.uint64(padded[r])
            r += 1
        x[lane] = v
        out[i] = e & m16
        if r > nw:
            return TRUNCATED
        i += 1
    if r != nw:
        return CORRUPT
    for lane in range(lanes):
        if x[lane] != end:
            return CORRUPT
    return OK
