"""The coders a section's two streams may use, and the encoder's choice among them.

Positions (sorted, unique int64 flat indices) are coded as gaps:
- ``rice`` (:mod:`~flipsync.codec.rice`): Golomb-Rice with the best parameter k; within ~1% of the entropy
  bound for scattered changes.
- ``zstd`` (:mod:`~flipsync.codec.zstd`): gaps as the narrowest unsigned ints, byte-shuffled, zstd; cheaper
  when changes cluster in runs.
Values (unsigned symbols: zigzagged steps or raw bit patterns) and the kind flags of mixed sections:
- ``zstd``: narrowest unsigned ints, byte-shuffled, zstd.
- ``bits`` (:mod:`~flipsync.codec.bitpack`): fixed-width bit packing; no tables, so it wins for a handful of values.
- ``ans`` (:mod:`~flipsync.codec.rans`): order-0 rANS with the frequency table stored and zstd escapes.
The encoder keeps whichever candidate is smallest (ties go to the first listed).
"""

from __future__ import annotations

import numpy as np

from flipsync.codec.bitpack import FixedWidthCoder
from flipsync.codec.coders import CoderRegistry, Params, PositionCoder, SymbolCoder
from flipsync.codec.rans import RansCoder
from flipsync.codec.rice import RiceCoder
from flipsync.codec.zstd import ZstdCoder, ZstdGapsCoder

POSITION_CODERS: CoderRegistry[PositionCoder] = CoderRegistry("position", RiceCoder(), ZstdGapsCoder())
SYMBOL_CODERS: CoderRegistry[SymbolCoder] = CoderRegistry("value", ZstdCoder(), FixedWidthCoder(), RansCoder())


def encode_positions(positions: np.ndarray) -> tuple[Params, bytes]:
    """The smallest coding of sorted unique positions."""
    return POSITION_CODERS.encode(positions)


def decode_positions(params: Params, blob: bytes, n: int, numel: int) -> np.ndarray:
    """Sorted unique positions, each below ``numel``."""
    return POSITION_CODERS.coder(params).decode(params, blob, n, numel)


def encode_symbols(symbols: np.ndarray) -> tuple[Params, bytes]:
    """The smallest coding of unsigned symbols among zstd, fixed width and rANS."""
    return SYMBOL_CODERS.encode(symbols)


def decode_symbols(params: Params, blob: bytes, n: int) -> np.ndarray:
    return SYMBOL_CODERS.coder(params).decode(params, blob, n)
