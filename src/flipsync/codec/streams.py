"""Entropy coders for the two streams of a tensor section: changed positions and their values.

Each encoder returns ``(params, blob)``: a small JSON-able dict and the coded bytes. Every decoder is
defensive: it is fed bytes from the network, so it checks every length and range before it allocates or
indexes, and raises :class:`CorruptPatchError` for anything inconsistent.

Positions (sorted, unique int64 flat indices) are coded as gaps:
- ``rice``: Golomb-Rice with the best parameter k; within ~1% of the entropy bound for scattered changes.
- ``zstd``: gaps as the narrowest unsigned ints, byte-shuffled, zstd; cheaper when changes cluster in runs.
Values (unsigned symbols: zigzagged steps or raw bit patterns) are coded as:
- ``bits``: fixed-width bit packing; no tables, so it wins for a handful of values.
- ``ans``: an order-0 rANS coder (our own compiled one, ``bitpack.ans_*``) over symbols below a cut-off
  with the frequency table stored; larger symbols escape to a zstd side stream. Reaches the empirical
  entropy of the steps; long streams interleave four states so that decoding takes ~2-3 ns per value.
- ``zstd``: narrowest unsigned ints, byte-shuffled, zstd.
The encoder keeps whichever candidate is smallest.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import zstandard

from flipsync.codec import bitpack
from flipsync.errors import CorruptPatchError

ZSTD_LEVEL = 3
ANS_MAX_ALPHABET = 256  # symbols >= this escape to the side stream
_MAX_RICE_K = 62
_ZSTD_MAX_RATIO = 1 << 15  # zstd cannot expand input by more than this (RLE blocks of 128 KiB)

Params = dict[str, Any]


# ----------------------------------------------------------------------------------------------- helpers
def _narrow(values: np.ndarray) -> np.ndarray:
    """Unsigned values in the narrowest little-endian unsigned dtype that holds them."""
    top = int(values.max()) if values.size else 0
    for dt in ("<u1", "<u2", "<u4"):
        if top < 1 << (8 * np.dtype(dt).itemsize):
            return values.astype(dt)
    return values.astype("<u8")


def _shuffled_zstd(values: np.ndarray) -> tuple[Params, bytes]:
    """Byte-shuffle (all low bytes, then all next bytes, ...) then zstd: the planes compress separately."""
    v = _narrow(values)
    width = v.dtype.itemsize
    planes = v.view(np.uint8).reshape(-1, width).T.copy()
    blob = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(planes.tobytes())
    return {"width": width}, blob


def _unshuffled_zstd(params: Params, blob: bytes, n: int) -> np.ndarray:
    width = _get_int(params, "width", {1, 2, 4, 8})
    raw = _zstd_exact(blob, n * width)
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(width, n)
    return planes.T.copy().view(f"<u{width}").reshape(n).astype(np.uint64)


def _zstd_exact(blob: bytes, size: int) -> bytes:
    """Decompress exactly ``size`` bytes; refuse frames that declare or produce anything else.

    The expected size comes from a header an attacker may craft, so it is checked against what the
    input could possibly expand to before any buffer is allocated.
    """
    if size == 0:
        return b""
    if size > len(blob) * _ZSTD_MAX_RATIO + (1 << 20):
        raise CorruptPatchError(f"a zstd stream of {len(blob)} bytes cannot hold {size} bytes")
    try:
        declared = zstandard.frame_content_size(blob)
    except zstandard.ZstdError as e:
        raise CorruptPatchError(f"a zstd stream is corrupt: {e}") from None
    if declared != size:
        raise CorruptPatchError(f"a zstd stream declares {declared} bytes, expected {size}")
    try:
        out = zstandard.ZstdDecompressor().decompress(blob, max_output_size=size)
    except zstandard.ZstdError as e:
        raise CorruptPatchError(f"a zstd stream is corrupt: {e}") from None
    if len(out) != size:
        raise CorruptPatchError(f"a zstd stream holds {len(out)} bytes, expected {size}")
    return out


def _get_int(params: Params, key: str, allowed: set[int] | range) -> int:
    v = params.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v not in allowed:
        raise CorruptPatchError(f"codec parameter {key}={v!r} is out of range")
    return v


# --------------------------------------------------------------------------------------------- positions
def _best_rice_k(gaps: np.ndarray) -> int:
    mean = float(gaps.mean()) if gaps.size else 0.0
    guess = max(0, int(np.log2(mean * 0.69 + 1.0)))
    candidates = range(max(0, guess - 1), min(_MAX_RICE_K, guess + 2))
    return min(candidates, key=lambda k: bitpack.rice_bits(gaps, k))


def rice_encode(gaps: np.ndarray) -> tuple[Params, bytes]:
    """Golomb-Rice code of non-negative gaps with the cheapest parameter k."""
    g = np.ascontiguousarray(gaps, dtype=np.uint64)
    k = _best_rice_k(g)
    out = np.empty((bitpack.rice_bits(g, k) + 7) // 8, dtype=np.uint8)
    used = bitpack.rice_pack(g, k, out)
    return {"k": k}, out[:used].tobytes()


def rice_decode(params: Params, blob: bytes, n: int, numel: int | None = None) -> np.ndarray:
    """The n gaps (uint64); with ``numel``, straight to sorted positions below it (int64) in one compiled pass."""
    k = _get_int(params, "k", range(_MAX_RICE_K + 1))
    if n > 8 * len(blob):  # every value takes at least one bit
        raise CorruptPatchError(f"rice stream of {len(blob)} bytes cannot hold {n} values")
    data = np.frombuffer(blob, dtype=np.uint8)
    if numel is None:
        out = np.empty(n, dtype=np.uint64)
        status = bitpack.rice_unpack(data, k, out)
    else:
        out = np.empty(n, dtype=np.int64)
        status = bitpack.rice_unpack_positions(data, k, out, numel)
        if status == bitpack.OVERFLOW:
            raise CorruptPatchError(f"positions run past the end of a tensor of {numel} elements")
    if status != bitpack.OK:
        raise CorruptPatchError("rice stream is truncated or corrupt")
    return out


def fixed_encode(values: np.ndarray) -> tuple[Params, bytes]:
    """Every value in the same number of bits: no tables, so the best choice for a handful of values."""
    v = np.ascontiguousarray(values, dtype=np.uint64)
    width = max(1, int(v.max()).bit_length()) if v.size else 1
    out = np.empty((v.size * width + 7) // 8, dtype=np.uint8)
    used = bitpack.fixed_pack(v, width, out)
    return {"bits": width}, out[:used].tobytes()


def fixed_decode(params: Params, blob: bytes, n: int) -> np.ndarray:
    width = _get_int(params, "bits", range(1, 65))
    if n * width > 8 * len(blob):  # before allocating: n comes from a header that may be crafted
        raise CorruptPatchError(f"fixed-width stream of {len(blob)} bytes cannot hold {n} values of {width} bits")
    out = np.empty(n, dtype=np.uint64)
    if bitpack.fixed_unpack(np.frombuffer(blob, dtype=np.uint8), width, out) != bitpack.OK:
        raise CorruptPatchError("fixed-width stream is truncated")
    return out


def encode_positions(positions: np.ndarray) -> tuple[Params, bytes]:
    gaps = np.diff(positions, prepend=-1) - 1
    if gaps.size and gaps.min() < 0:
        raise ValueError("positions must be sorted and unique")
    gaps = gaps.astype(np.uint64)
    candidates: list[tuple[Params, bytes]] = []
    p, b = rice_encode(gaps)
    candidates.append(({"codec": "rice", **p}, b))
    p, b = _shuffled_zstd(gaps)
    candidates.append(({"codec": "zstd", **p}, b))
    return min(candidates, key=lambda c: len(c[1]))


def decode_positions(params: Params, blob: bytes, n: int, numel: int) -> np.ndarray:
    """Sorted unique positions, each below ``numel``."""
    codec = params.get("codec")
    if codec == "rice":
        return rice_decode(params, blob, n, numel)  # the gaps never exist as a separate array
    if codec == "zstd":
        gaps = _unshuffled_zstd(params, blob, n)
    else:
        raise CorruptPatchError(f"unknown position codec {codec!r}")
    if n == 0:
        return np.empty(0, dtype=np.int64)
    # Check the sum before the int64 cumsum so that crafted gaps cannot wrap around.
    if int(gaps.max()) >= numel or float(gaps.astype(np.float64).sum()) + n > numel * 1.0001 + 1:
        raise CorruptPatchError(f"positions run past the end of a tensor of {numel} elements")
    positions = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if positions[-1] >= numel:
        raise CorruptPatchError(f"positions run past the end of a tensor of {numel} elements")
    return positions


# ------------------------------------------------------------------------------------------------ values
_ANS_HEADER = struct.Struct("<HBBHHI")  # used symbols, rice k, count bits, table bytes x2, rANS bytes


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
    counts = np.zeros(n_counts, dtype=np.uint64)
    # Stored as count - 1; a crafted 2**64 - 1 wraps to 0, which the callers' checks refuse.
    counts[symbols] = fixed_decode({"bits": cbits}, blob[off : off + cnt_len], used) + np.uint64(1)
    return counts, off + cnt_len


_ANS_MAX_PREC = 16  # frequency precision: a 64 Ki-slot decode table at most
_ANS_MIN_PREC = 10  # 2**10 slots hold the largest alphabet (257) with room to spare
_ANS_LANES_FROM = 1 << 14  # 4 interleaved states from here: ~24 more bytes (<0.1% of a section), 3x faster


def _ans_shape(n: int) -> tuple[int, int]:
    """(precision, lanes) for n values, implied by n so that the header need not carry them: slots in
    proportion to the values (the decode table costs O(2**prec) per section), four lanes for long streams."""
    return min(_ANS_MAX_PREC, max(_ANS_MIN_PREC, n.bit_length() + 1)), 4 if n >= _ANS_LANES_FROM else 1


def ans_encode(symbols: np.ndarray) -> tuple[Params, bytes]:
    """rANS (our own compiled coder, see bitpack) over symbols < alphabet; larger ones escape to zstd.

    Layout: header, sparse frequency table (Rice-coded symbol gaps, fixed-width exact counts: a section with a
    few hundred changes pays tens of bytes for it), 32-bit words, escapes. The decoder rebuilds the quantized
    frequencies from the counts (``bitpack.ans_quantize``).
    """
    n = int(symbols.size)
    top = int(symbols.max()) if n else 0
    alphabet = min(top + 1, ANS_MAX_ALPHABET)
    escaped = symbols >= alphabet
    coded = np.where(escaped, alphabet, symbols).astype(np.int32)
    counts = np.bincount(coded, minlength=alphabet + 1).astype(np.uint64)
    if not escaped.any():
        counts = counts[:alphabet]
    prec, lanes = _ans_shape(n)
    out = np.empty(n + 2 * lanes, dtype=np.uint32)
    start = bitpack.ans_pack(coded, bitpack.ans_quantize(counts, prec), prec, lanes, out)
    words = out[start:].astype("<u4").tobytes()
    used = np.flatnonzero(counts)
    sym_params, sym_blob = rice_encode(np.diff(used, prepend=-1) - 1)
    cnt_params, cnt_blob = fixed_encode(counts[used] - np.uint64(1))
    header = _ANS_HEADER.pack(used.size, sym_params["k"], cnt_params["bits"], len(sym_blob), len(cnt_blob), len(words))
    n_esc = int(escaped.sum())
    # A compressor per call costs ~20 us: most sections have no escapes, and then width 1 codes nothing.
    esc_params, esc_blob = _shuffled_zstd(symbols[escaped] - np.uint64(alphabet)) if n_esc else ({"width": 1}, b"")
    params = {"alphabet": len(counts), "escapes": n_esc, "esc_width": esc_params["width"]}
    return params, header + sym_blob + cnt_blob + words + esc_blob


def ans_decode(params: Params, blob: bytes, n: int) -> np.ndarray:
    n_counts = _get_int(params, "alphabet", range(1, ANS_MAX_ALPHABET + 2))
    n_esc = _get_int(params, "escapes", range(n + 1))
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
    status = bitpack.ans_unpack(words, bitpack.ans_quantize(counts, prec), prec, lanes, symbols)
    if status != bitpack.OK:
        raise CorruptPatchError("ans stream is truncated or corrupt")
    esc_sym = n_counts - 1
    n_esc_seen = int(counts[esc_sym]) if n_esc else 0
    if n_esc_seen != n_esc:
        raise CorruptPatchError("ans stream escape count disagrees with the section header")
    if n_esc:
        escaped = symbols == np.uint64(esc_sym)
        if int(escaped.sum()) != n_esc:
            raise CorruptPatchError("ans stream escape count disagrees with the section header")
        extra = _unshuffled_zstd({"width": params.get("esc_width")}, blob[off + words_len :], n_esc)
        symbols[escaped] = extra + np.uint64(esc_sym)
    return symbols


def encode_symbols(symbols: np.ndarray) -> tuple[Params, bytes]:
    """The smallest coding of unsigned symbols among rANS, fixed width and shuffled zstd."""
    candidates: list[tuple[Params, bytes]] = []
    p, b = _shuffled_zstd(symbols)
    candidates.append(({"codec": "zstd", **p}, b))
    p, b = fixed_encode(symbols)
    candidates.append(({"codec": "bits", **p}, b))
    if symbols.size:
        p, b = ans_encode(symbols)
        candidates.append(({"codec": "ans", **p}, b))
    return min(candidates, key=lambda c: len(c[1]))


_SYMBOL_DECODERS: dict[str, Callable[[Params, bytes, int], np.ndarray]] = {
    "zstd": _unshuffled_zstd,
    "ans": ans_decode,
    "bits": fixed_decode,
}


def decode_symbols(params: Params, blob: bytes, n: int) -> np.ndarray:
    decoder = _SYMBOL_DECODERS.get(params.get("codec"))  # type: ignore[arg-type]
    if decoder is None:
        raise CorruptPatchError(f"unknown value codec {params.get('codec')!r}")
    return decoder(params, blob, n)
