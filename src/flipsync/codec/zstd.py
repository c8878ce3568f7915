"""The ``zstd`` coder: byte-shuffled narrow values, then zstd (cheaper than Rice when changes cluster in runs;
the rANS coder's escapes). The decoder bounds what a crafted frame may expand to."""

from __future__ import annotations

from typing import Any, ClassVar

import numba
import numpy as np
import zstandard

from flipsync.codec.coders import Params, PositionCoder, SymbolCoder, get_int, position_gaps
from flipsync.codec.jit import clz64, kernel
from flipsync.errors import CorruptPatchError

ZSTD_LEVEL = 3
ZSTD_MAX_RATIO = 1 << 15  # zstd cannot expand input by more than this (RLE blocks of 128 KiB)


def shuffled_zstd(values: np.ndarray) -> tuple[Params, bytes]:
    """The values in their narrowest unsigned width, byte-shuffled (the planes compress separately), then zstd."""
    v = values.astype(np.min_scalar_type(int(values.max()) if values.size else 0).newbyteorder("<"))
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
    """Decompress exactly ``size`` bytes; refuse frames that declare or produce anything else. ``size`` comes
    from a header an attacker may craft: it is checked against what the input could expand to first."""
    if size == 0:
        return b""
    if size > len(blob) * ZSTD_MAX_RATIO + (1 << 20):
        raise CorruptPatchError(f"a zstd stream of {len(blob)} bytes cannot hold {size} bytes")
    try:
        declared = zstandard.frame_content_size(blob)
        if declared != size:
            raise CorruptPatchError(f"a zstd stream declares {declared} bytes, expected {size}")
        out = zstandard.ZstdDecompressor().decompress(blob, max_output_size=size)
    except zstandard.ZstdError as e:
        raise CorruptPatchError(f"a zstd stream is corrupt: {e}") from None
    if len(out) != size:
        raise CorruptPatchError(f"a zstd stream holds {len(out)} bytes, expected {size}")
    return out


# The size estimate compresses about 1/SAMPLE_SHARE of the values, in runs of SAMPLE_RUN spread evenly, and
# scales the result by the sample's share of the values' summed bit lengths (a sample that caught more or fewer
# of the large values than its share still scales right). On Adam-stepped BF16, FP8 and FP4 views the estimates
# came within a few percent of the true sizes, mostly a little above.
SAMPLE_RUN = 4096
SAMPLE_SHARE = 8
SAMPLE_FROM = 4 * SAMPLE_RUN  # = coders.ESTIMATE_FROM
SAMPLE_MIN_BYTES = 256
# What a compression pays whatever its input's length (headers, entropy tables): not scaled up. Samples of a few
# thousand Adam steps' gaps paid ~80-190 bytes more than their share of the whole; 64 takes most of that out.
_FIXED_BYTES = 64


@numba.njit(inline="always")
def _weight(v: np.uint64) -> int:
    """About the bits zstd spends on a value: its bit length, plus one (a zero still costs a little)."""
    return 65 - int(clz64(v))  # type: ignore[call-arg]  # clz64(0) is 64


@kernel
def _sample_planes(values: np.ndarray, gaps_of: bool) -> tuple[np.ndarray, float]:
    """The sample's byte planes (of gaps within runs of sorted positions, with ``gaps_of``) and its share of the
    values' summed ``_weight``: one compiled pass instead of a dozen numpy temporaries (most of the time)."""
    n = values.shape[0]
    runs = max(1, n // (SAMPLE_RUN * SAMPLE_SHARE))
    stride = n // runs
    m = runs * SAMPLE_RUN
    sample = np.empty(m, dtype=np.uint64)
    top = np.uint64(0)
    part = 0
    for r in range(runs):
        at = r * stride
        for i in range(SAMPLE_RUN):
            v = np.uint64(values[at + i + 1] - values[at + i] - 1) if gaps_of else np.uint64(values[at + i])
            sample[r * SAMPLE_RUN + i] = v
            top = max(top, v)
            part += _weight(v)
    whole = 0
    prev = np.int64(-1)
    for x in values:
        if gaps_of:
            whole += _weight(np.uint64(x - prev - 1))
            prev = np.int64(x)
        else:
            whole += _weight(np.uint64(x))
    width = 1
    while width < 8 and top >> np.uint64(8 * width):
        width = 2 * width
    planes = np.empty(m * width, dtype=np.uint8)
    for b in range(width):
        shift = np.uint64(8 * b)
        for i in range(m):
            planes[b * m + i] = np.uint8((sample[i] >> shift) & np.uint64(0xFF))
    return planes, part / whole


def shuffled_zstd_estimate(values: np.ndarray, gaps_of: bool = False) -> int | None:
    """About ``len(shuffled_zstd(values)[1])`` (``gaps_of``: of sorted positions' gaps) from a sample, or None."""
    n = int(values.shape[0])
    if n < SAMPLE_FROM:
        return None
    # The sample's own width: where the whole needs a wider one, its extra plane is all but empty and costs
    # little, so the estimate errs low (the safe side: the registry then codes the candidate).
    planes, share = _sample_planes(np.ascontiguousarray(values), gaps_of)
    size = len(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(planes.tobytes()))
    # A sample that compresses to almost nothing (zeros, one long run) says little about the whole, whose
    # fixed costs then dominate: no estimate (and such data compresses fast).
    return round((size - _FIXED_BYTES) / share) + _FIXED_BYTES if size >= SAMPLE_MIN_BYTES else None


class ZstdCoder(SymbolCoder):
    codec_id: ClassVar[str] = "zstd"

    def encode(self, symbols: np.ndarray, base: Any = None) -> tuple[Params, bytes]:
        return shuffled_zstd(symbols)

    def estimate(self, symbols: np.ndarray, base: Any = None) -> int | None:
        return shuffled_zstd_estimate(symbols)

    def decode(self, params: Params, blob: bytes, n: int) -> np.ndarray:
        return unshuffled_zstd(params, blob, n)


class ZstdGapsCoder(PositionCoder):
    codec_id: ClassVar[str] = "zstd"

    def encode(self, positions: np.ndarray, base: Any = None) -> tuple[Params, bytes]:
        return shuffled_zstd(position_gaps(positions))

    def estimate(self, positions: np.ndarray, base: Any = None) -> int | None:
        return shuffled_zstd_estimate(np.asarray(positions, dtype=np.int64), gaps_of=True)

    def decode(self, params: Params, blob: bytes, n: int, numel: int, base: Any = None) -> np.ndarray:
        """The positions of untrusted gaps, refusing any at or past ``numel``."""
        gaps = unshuffled_zstd(params, blob, n)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        # Check the sum before the int64 cumsum so that crafted gaps cannot wrap around.
        if int(gaps.max()) >= numel or float(gaps.astype(np.float64).sum()) + n > numel * 1.0001 + 1:
            raise CorruptPatchError(f"positions run past the end of a tensor of {numel} elements")
        positions = np.cumsum(gaps.astype(np.int64) + 1) - 1
        if positions[-1] >= numel:
            raise CorruptPatchError(f"positions run past the end of a tensor of {numel} elements")
        return positions
