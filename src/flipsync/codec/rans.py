"""The ``ans`` value coder: order-0 rANS (numba) with a stored frequency table, larger symbols escaping to a zstd
side stream; long streams interleave four states (decoding ~2-3 ns per value)."""

from __future__ import annotations

import math
import struct
from typing import Any, ClassVar

import numba
import numpy as np

from flipsync.codec.bitpack import FixedWidthCoder, exp_golomb_bits, pack_exp_golomb, unpack_exp_golomb
from flipsync.codec.coders import CORRUPT, OK, TRUNCATED, Params, SymbolCoder, get_int
from flipsync.codec.jit import clz64, kernel, mulhi64
from flipsync.codec.rice import rice_bits, rice_decode, rice_encode
from flipsync.codec.zstd import shuffled_zstd, shuffled_zstd_estimate, unshuffled_zstd
from flipsync.errors import CorruptPatchError

ANS_MAX_ALPHABET = 256  # symbols >= this escape to the side stream
_FIXED = FixedWidthCoder()  # the frequency table's counts


# An encoder and decoder pair, compiled here: 64-bit states, 32-bit words, lower bound L = 2**31,
# frequencies summing to 2**prec (prec <= 16), so every value costs at most one word. The encoder works
# backwards from a known start state; the decoder reads the final states first and must end at exactly the
# start states with every word consumed, which catches most corruption before the fingerprint check does.
ANS_LOW = 1 << 31


@kernel
def ans_quantize(counts: np.ndarray, prec: int) -> np.ndarray:
    """Frequencies summing to 2**prec, in integer arithmetic (encoder and decoder must agree bit for bit): one
    slot per used symbol, the rest in proportion (floor), the remainder to the first most frequent symbol.
    Needs counts.sum() < 2**47 and at most 2**prec used symbols."""
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


@kernel
def ans_reciprocals(freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per symbol, (reciprocal, shift) such that ``x // f == mulhi64(x, rcp) >> shift`` for every x < 2**63 and
    f >= 2 (Alverson: rcp = ceil(2**(63 + s) / f), s = ceil(log2 f)); ``ans_pack`` special-cases f == 1."""
    m = freq.shape[0]
    rcp = np.zeros(m, dtype=np.uint64)
    shift = np.zeros(m, dtype=np.uint64)
    for s in range(m):
        f = np.uint64(freq[s])
        if f < np.uint64(2):
            continue
        b = 0
        while (np.uint64(1) << np.uint64(b)) < f:
            b += 1
        # ceil(2**(63 + b) / f) as two 64-by-64 divisions (the dividend is a power of two), once per symbol
        hi = np.uint64(1) << np.uint64(b + 31)
        t1 = hi // f
        t0 = ((hi % f) << np.uint64(32)) + f - np.uint64(1)
        rcp[s] = (t1 << np.uint64(32)) + t0 // f
        shift[s] = np.uint64(b - 1)
    return rcp, shift


@kernel
def ans_pack(symbols: np.ndarray, freq: np.ndarray, prec: int, lanes: int, out: np.ndarray) -> int:
    """Encode ``symbols`` into the tail of ``out`` (len(symbols) + 2 * lanes words at least); returns the start
    of the stream. Value i goes through state i % lanes; the final states lead the stream, lane 0 first. The
    step x -> (x // f) * 2**prec + x % f + cum is computed as x + cum + q * (2**prec - f) with q from a
    reciprocal multiply: a 64-bit division per value was most of the encoder's time."""
    cum = _cumulative(freq)
    rcp, shift = ans_reciprocals(freq)
    top = np.uint64(freq.shape[0] - 1)
    m = np.uint64(1) << np.uint64(prec)
    # One lane starts from state 0: its first ~31 bits of information fill the state instead of the
    # stream, which saves a word on small sections. Interleaved lanes must start at ANS_LOW, or a lane
    # still below it would take a word meant for another lane.
    x = np.full(lanes, np.uint64(ANS_LOW if lanes > 1 else 0), dtype=np.uint64)
    j = out.shape[0]
    bound = np.uint64((ANS_LOW >> prec) << 32)
    i = symbols.shape[0] - 1
    lane = i % lanes
    # One value at a time: a lone lane, or the last n % 4 values of four lanes (then whole rounds, below).
    while i >= 0 and (lanes != 4 or (i + 1) % 4):
        s = min(np.uint64(symbols[i]), top)
        f = np.uint64(freq[s])
        v = x[lane]
        if v >= bound * f:
            j -= 1
            out[j] = np.uint32(v & np.uint64(0xFFFFFFFF))
            v >>= np.uint64(32)
        if f == np.uint64(1):  # x // 1 = x: no reciprocal below 2**64
            x[lane] = (v << np.uint64(prec)) + cum[s]
        else:
            q = mulhi64(v, rcp[s]) >> shift[s]  # type: ignore[call-arg]  # numba passes typingctx itself
            x[lane] = v + cum[s] + q * (m - f)
        lane = lane - 1 if lane else lanes - 1  # i % lanes without a division per value
        i -= 1
    if lanes == 4:
        # Whole rounds, lanes 3, 2, 1, 0, with the states in scalars and each step written out by hand (as in
        # ans_unpack: an inlined helper returning a tuple was 15x slower): ~25% faster than through x[lane].
        x0, x1, x2, x3 = x[0], x[1], x[2], x[3]
        while i >= 3:
            s = min(np.uint64(symbols[i]), top)
            f = np.uint64(freq[s])
            if x3 >= bound * f:
                j -= 1
                out[j] = np.uint32(x3 & np.uint64(0xFFFFFFFF))
                x3 >>= np.uint64(32)
            if f == np.uint64(1):
                x3 = (x3 << np.uint64(prec)) + cum[s]
            else:
                x3 = x3 + cum[s] + (mulhi64(x3, rcp[s]) >> shift[s]) * (m - f)  # type: ignore[call-arg]
            s = min(np.uint64(symbols[i - 1]), top)
            f = np.uint64(freq[s])
            if x2 >= bound * f:
                j -= 1
                out[j] = np.uint32(x2 & np.uint64(0xFFFFFFFF))
                x2 >>= np.uint64(32)
            if f == np.uint64(1):
                x2 = (x2 << np.uint64(prec)) + cum[s]
            else:
                x2 = x2 + cum[s] + (mulhi64(x2, rcp[s]) >> shift[s]) * (m - f)  # type: ignore[call-arg]
            s = min(np.uint64(symbols[i - 2]), top)
            f = np.uint64(freq[s])
            if x1 >= bound * f:
                j -= 1
                out[j] = np.uint32(x1 & np.uint64(0xFFFFFFFF))
                x1 >>= np.uint64(32)
            if f == np.uint64(1):
                x1 = (x1 << np.uint64(prec)) + cum[s]
            else:
                x1 = x1 + cum[s] + (mulhi64(x1, rcp[s]) >> shift[s]) * (m - f)  # type: ignore[call-arg]
            s = min(np.uint64(symbols[i - 3]), top)
            f = np.uint64(freq[s])
            if x0 >= bound * f:
                j -= 1
                out[j] = np.uint32(x0 & np.uint64(0xFFFFFFFF))
                x0 >>= np.uint64(32)
            if f == np.uint64(1):
                x0 = (x0 << np.uint64(prec)) + cum[s]
            else:
                x0 = x0 + cum[s] + (mulhi64(x0, rcp[s]) >> shift[s]) * (m - f)  # type: ignore[call-arg]
            i -= 4
        x[0], x[1], x[2], x[3] = x0, x1, x2, x3
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


@kernel
def ans_unpack(words: np.ndarray, freq: np.ndarray, prec: int, lanes: int, out: np.ndarray) -> int:
    """Decode len(out) symbols; OK, TRUNCATED (ran out of words) or CORRUPT (a lane did not end at the
    encoder's start state, or words are left over). One table entry per slot packs symbol, frequency and
    offset: a step is one load, one multiply and one add. The steps are written out by hand: a helper
    returning a tuple made numba's loop 15x slower."""
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


_ANS_HEADER = struct.Struct("<HBBHHI")  # used symbols, rice k, counts' coding, table bytes x2, rANS bytes
# The counts' coding byte: 1..64 is a fixed width (every version), EXP_GOLOMB + k order-k Exp-Golomb codes,
# which a few large counts and many small ones (a step distribution's tail) take in far fewer bits.
_EXP_GOLOMB = 0x80
_MAX_EG_K = 15


@kernel
def _cheapest_eg(values: np.ndarray) -> tuple[int, int]:
    """(bits, k) of the first cheapest Exp-Golomb order k <= _MAX_EG_K, in one call (not one per k)."""
    best, best_k = exp_golomb_bits(values, 0), 0
    for k in range(1, _MAX_EG_K + 1):
        bits = exp_golomb_bits(values, k)
        if bits < best:
            best, best_k = bits, k
    return best, best_k


def _ans_table(blob: bytes, n_counts: int) -> tuple[np.ndarray, int]:
    """The frequency table and the offset where the rANS words start."""
    if len(blob) < _ANS_HEADER.size:
        raise CorruptPatchError("ans stream is truncated")
    used, k, cbits, sym_len, cnt_len, words_len = _ANS_HEADER.unpack_from(blob)
    off = _ANS_HEADER.size
    if not 1 <= used <= n_counts or off + sym_len + cnt_len + words_len > len(blob) or words_len % 4:
        raise CorruptPatchError("ans stream header is inconsistent")
    gaps = rice_decode({"k": k}, blob[off : off + sym_len], used)
    symbols = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if gaps.max() >= n_counts or symbols[-1] >= n_counts:
        raise CorruptPatchError("ans frequency table names symbols outside the alphabet")
    off += sym_len
    stored = blob[off : off + cnt_len]
    if cbits < _EXP_GOLOMB:
        found = _FIXED.decode({"bits": cbits}, stored, used)
    else:
        if cbits - _EXP_GOLOMB > _MAX_EG_K or used > 8 * len(stored):  # every code takes at least one bit
            raise CorruptPatchError("ans frequency table's counts are coded in an unknown way, or truncated")
        found = np.empty(used, dtype=np.uint64)
        if unpack_exp_golomb(np.frombuffer(stored, dtype=np.uint8), cbits - _EXP_GOLOMB, found) != OK:
            raise CorruptPatchError("ans frequency table's counts are truncated or corrupt")
    counts = np.zeros(n_counts, dtype=np.uint64)
    # Stored as count - 1; a crafted 2**64 - 1 wraps to 0, which the callers' checks refuse.
    counts[symbols] = found + np.uint64(1)
    return counts, off + cnt_len


_ANS_MAX_PREC = 16  # frequency precision: a 64 Ki-slot decode table at most
_ANS_MIN_PREC = 10  # 2**10 slots hold the largest alphabet (257) with room to spare
_ANS_LANES_FROM = 1 << 14  # 4 interleaved states from here: ~24 more bytes (<0.1% of a section), 3x faster


def _ans_shape(n: int) -> tuple[int, int]:
    """(precision, lanes) for n values, implied by n so that the header need not carry them."""
    return min(_ANS_MAX_PREC, max(_ANS_MIN_PREC, n.bit_length() + 1)), 4 if n >= _ANS_LANES_FROM else 1


# rANS words beyond the information they carry: the final states lead the stream (8 bytes a lane) and hold on
# average ~16 bits above ANS_LOW each; a lone lane starts from 0, so its state holds ~47 bits of information
_ANS_STATE_BYTES = {1: 8 - 47 / 8, 4: 4 * (8 - 16 / 8)}


@kernel
def _ans_sizes(counts: np.ndarray, freq: np.ndarray, prec: int) -> tuple[float, int]:
    """(bits of information of the values under ``freq``, about the table's bytes), in one compiled call."""
    info = 0.0
    for s in range(counts.shape[0]):
        if counts[s]:
            info += float(counts[s]) * (prec - np.log2(float(freq[s])))
    used = np.flatnonzero(counts)
    stored = counts[used] - np.uint64(1)
    top = stored.max() if stored.size else np.uint64(0)
    width = 64 - int(clz64(top)) if top else 1  # type: ignore[call-arg]  # the fixed width's: top's bit length
    cnt_bits = min(used.size * width, _cheapest_eg(stored)[0])
    gaps = np.empty(used.size, dtype=np.uint64)
    prev = -1
    for i in range(used.size):
        gaps[i] = np.uint64(used[i] - prev - 1)
        prev = used[i]
    sym_bits = min([rice_bits(gaps, k) for k in range(9)])
    return info, (sym_bits + 7) // 8 + (cnt_bits + 7) // 8


@kernel
def _capped_counts(symbols: np.ndarray) -> np.ndarray:
    # Four histograms, summed at the end: runs of one symbol (most steps are one of two) would otherwise
    # make every increment wait for the one before it.
    width = ANS_MAX_ALPHABET + 1
    hist = np.zeros(4 * width, dtype=np.uint64)
    cap = np.uint64(ANS_MAX_ALPHABET)
    n = symbols.shape[0]
    one = np.uint64(1)
    i = 0
    while i + 4 <= n:
        hist[min(np.uint64(symbols[i]), cap)] += one
        hist[width + min(np.uint64(symbols[i + 1]), cap)] += one
        hist[2 * width + min(np.uint64(symbols[i + 2]), cap)] += one
        hist[3 * width + min(np.uint64(symbols[i + 3]), cap)] += one
        i += 4
    for j in range(i, n):
        hist[min(np.uint64(symbols[j]), cap)] += one
    return hist[:width] + hist[width : 2 * width] + hist[2 * width : 3 * width] + hist[3 * width :]


@kernel
def _escaped(symbols: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` symbols at or past ANS_MAX_ALPHABET, less it, in order (what the side stream codes)."""
    out = np.empty(count, dtype=np.uint64)
    j = 0
    for v in symbols:
        if np.uint64(v) >= np.uint64(ANS_MAX_ALPHABET):
            out[j] = np.uint64(v) - np.uint64(ANS_MAX_ALPHABET)
            j += 1
    return out


def ans_counts(symbols: np.ndarray) -> np.ndarray:
    """The table's counts: per symbol up to the largest, or with escapes all ``ANS_MAX_ALPHABET`` and theirs."""
    counts = _capped_counts(symbols)
    if counts[ANS_MAX_ALPHABET]:
        return counts
    used = np.flatnonzero(counts)
    return counts[: int(used[-1]) + 1 if used.size else 1]


class RansCoder(SymbolCoder):
    codec_id: ClassVar[str] = "ans"

    def accepts(self, symbols: np.ndarray, base: Any = None) -> bool:
        return symbols.size > 0

    def estimate(self, symbols: np.ndarray, base: Any = None) -> int:
        """About the length of ``encode(symbols)``'s bytes (within a few bytes, plus the escapes' estimate)."""
        n = int(symbols.size)
        counts = ans_counts(symbols)
        prec, lanes = _ans_shape(n)
        info, table = _ans_sizes(counts, ans_quantize(counts, prec), prec)
        words = 4 * max(1, math.ceil((info / 8 + _ANS_STATE_BYTES[lanes]) / 4))
        escapes = 0
        if counts.size > ANS_MAX_ALPHABET and counts[ANS_MAX_ALPHABET]:
            escaped = _escaped(symbols, int(counts[ANS_MAX_ALPHABET]))
            escapes = shuffled_zstd_estimate(escaped) or len(shuffled_zstd(escaped)[1])
        return _ANS_HEADER.size + table + words + escapes

    def encode(self, symbols: np.ndarray, base: Any = None) -> tuple[Params, bytes]:
        """Layout: header, sparse frequency table (Rice-coded symbol gaps, exact counts), 32-bit words, escapes
        (zstd). The decoder rebuilds the quantized frequencies from the counts (``ans_quantize``)."""
        n = int(symbols.size)
        counts = ans_counts(symbols)
        prec, lanes = _ans_shape(n)
        out = np.empty(n + 2 * lanes, dtype=np.uint32)
        start = ans_pack(symbols, ans_quantize(counts, prec), prec, lanes, out)
        words = out[start:].astype("<u4").tobytes()
        used = np.flatnonzero(counts)  # the stored table: the used symbols' gaps, then their counts
        sym_params, sym_blob = rice_encode(np.diff(used, prepend=-1) - 1)
        stored = counts[used] - np.uint64(1)
        cnt_params, cnt_blob = _FIXED.encode(stored)
        cnt_kind = cnt_params["bits"]
        bits, k = (int(x) for x in _cheapest_eg(stored))
        if (bits + 7) // 8 < len(cnt_blob):  # Exp-Golomb where smaller: ties keep the coding every reader knows
            eg = np.empty((bits + 7) // 8, dtype=np.uint8)
            cnt_kind, cnt_blob = _EXP_GOLOMB + k, eg[: pack_exp_golomb(stored, k, eg)].tobytes()
        header = _ANS_HEADER.pack(used.size, sym_params["k"], cnt_kind, len(sym_blob), len(cnt_blob), len(words))
        alphabet = ANS_MAX_ALPHABET
        n_esc = int(counts[alphabet]) if counts.size > alphabet else 0
        # A compressor per call costs ~20 us: most sections have no escapes, and then width 1 codes nothing.
        esc_params, esc_blob = ({"width": 1}, b"")
        if n_esc:
            esc_params, esc_blob = shuffled_zstd(_escaped(symbols, n_esc))
        params = {"alphabet": len(counts), "escapes": n_esc, "esc_width": esc_params["width"]}
        return params, header + sym_blob + cnt_blob + words + esc_blob

    def decode(self, params: Params, blob: bytes, n: int) -> np.ndarray:
        n_counts = get_int(params, "alphabet", range(1, ANS_MAX_ALPHABET + 2))
        n_esc = get_int(params, "escapes", range(n + 1))
        if n == 0 or n >= 1 << 47:
            raise CorruptPatchError("an ans stream codes at least one and fewer than 2**47 values")
        prec, lanes = _ans_shape(n)
        counts, off = _ans_table(blob, n_counts)
        # The table holds exact counts: they must add up to the values, which also bounds them for quantizing.
        if int(counts.max()) > n or int(counts.sum()) != n or int(np.count_nonzero(counts)) > 1 << prec:
            raise CorruptPatchError("ans frequency table does not add up to the number of values")
        words_len = _ANS_HEADER.unpack_from(blob)[5]
        words = np.frombuffer(blob, dtype="<u4", count=words_len // 4, offset=off)
        symbols = np.empty(n, dtype=np.uint64)
        status = ans_unpack(words, ans_quantize(counts, prec), prec, lanes, symbols)
        if status != OK:
            raise CorruptPatchError("ans stream is truncated or corrupt")
        esc_sym = n_counts - 1
        if n_esc:
            escaped = symbols == np.uint64(esc_sym)
            if int(counts[esc_sym]) != n_esc or int(escaped.sum()) != n_esc:
                raise CorruptPatchError("ans stream escape count disagrees with the section header")
            extra = unshuffled_zstd({"width": params.get("esc_width")}, blob[off + words_len :], n_esc)
            symbols[escaped] = extra + np.uint64(esc_sym)
        return symbols
