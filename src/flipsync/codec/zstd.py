"""The ``zstd`` coder: unsigned values in the narrowest little-endian width, byte-shuffled (all low bytes,
then all next bytes, ...), then zstd. Cheaper than Rice when changes cluster in runs, and the side stream
of the rANS coder's escapes. The decoder bounds what a crafted frame may expand to before it allocates.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import zstandard

from flipsync.codec.coders import Params, PositionCoder, SymbolCoder, get_int, position_gaps, positions_from_gaps
from flipsync.errors import CorruptPatchError

ZSTD_LEVEL = 3
ZSTD_MAX_RATIO = 1 << 15  # zstd cannot expand input by more than this (RLE blocks of 128 KiB)


def narrow(values: np.ndarray) -> np.ndarray:
    """Unsigned values in the narrowest little-endian unsigned dtype that holds them."""
    top = int(values.max()) if values.size else 0
    for dt in ("<u1", "<u2", "<u4"):
        if top < 1 << (8 * np.dtype(dt).itemsize):
            return values.astype(dt)
    return values.astype("<u8")


def shuffled_zstd(values: np.ndarray) -> tuple[Params, bytes]:
    """Byte-shuffle then zstd: the byte planes compress separately."""
    v = narrow(values)
    width = v.dtype.itemsize
    planes = v.view(np.uint8).reshape(-1, width).T.copy()
    blob = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(planes.tobytes())
    return {"width": width}, blob


def unshuffled_zstd(params: Params, blob: bytes, n: int) -> np.ndarray:
    """The n values (uint64) of a :func:`shuffled_zstd` stream."""
    width = get_int(params, "width", {1, 2, 4, 8})
    raw = zstd_exact(blob, n * width)
    planes = np.frombuffer(raw, dtype=np.uint8).reshape(width, n)
    return planes.T.copy().view(f"<u{width}").reshape(n).astype(np.uint64)


def zstd_exact(blob: bytes, size: int) -> bytes:
    """Decompress exactly ``size`` bytes; refuse frames that declare or produce anything else.

    The expected size comes from a header an attacker may craft, so it is checked against what the
    input could possibly expand to before any buffer is allocated.
    """
    if size == 0:
        return b""
    if size > len(blob) * ZSTD_MAX_RATIO + (1 << 20):
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


class ZstdCoder(SymbolCoder):
    """Symbols byte-shuffled and zstd-compressed."""

    codec_id: ClassVar[str] = "zstd"

    def encode(self, symbols: np.ndarray, base: Any = None) -> tuple[Params, bytes]:
        return shuffled_zstd(symbols)

    def decode(self, params: Params, blob: bytes, n: int) -> np.ndarray:
        return unshuffled_zstd(params, blob, n)


class ZstdGapsCoder(PositionCoder):
    """Position gaps byte-shuffled and zstd-compressed: cheap for runs of changes."""

    codec_id: ClassVar[str] = "zstd"

    def encode(self, positions: np.ndarray, base: Any = None) -> tuple[Params, bytes]:
        return shuffled_zstd(position_gaps(positions))

    def decode(self, params: Params, blob: bytes, n: int, numel: int, base: Any = None) -> np.ndarray:
        return positions_from_gaps(unshuffled_zstd(params, blob, n), numel)
