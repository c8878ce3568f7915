"""The coders a section's streams (positions, values) may use; the encoder keeps the smallest."""

from __future__ import annotations

import numpy as np

from flipsync.codec.bitpack import FixedWidthCoder
from flipsync.codec.class_index import BaseBits
from flipsync.codec.coders import CoderRegistry, Params, PositionCoder, SymbolCoder
from flipsync.codec.context import ContextCoder
from flipsync.codec.rans import RansCoder
from flipsync.codec.rice import RiceCoder
from flipsync.codec.zstd import ZstdCoder, ZstdGapsCoder
from flipsync.errors import PatchError

# Coders that decode without the base come first, so that a tie keeps a section free of it.
POSITION_CODERS: CoderRegistry[PositionCoder] = CoderRegistry("position", RiceCoder(), ZstdGapsCoder(), ContextCoder())
BASE_POSITION_CODERS = frozenset(c for c in POSITION_CODERS.ids() if POSITION_CODERS.coder({"codec": c}).needs_base)
SYMBOL_CODERS: CoderRegistry[SymbolCoder] = CoderRegistry("value", ZstdCoder(), FixedWidthCoder(), RansCoder())


def encode_positions(positions: np.ndarray, base: BaseBits | None = None) -> tuple[Params, bytes]:
    """The smallest coding of sorted unique positions; with ``base``, coders conditioned on it compete too."""
    return POSITION_CODERS.encode(positions, base)


def decode_positions(params: Params, blob: bytes, n: int, numel: int, base: BaseBits | None = None) -> np.ndarray:
    """Sorted unique positions, each below ``numel``."""
    coder = POSITION_CODERS.coder(params)
    if coder.needs_base and base is None:
        raise PatchError(
            f"these positions are coded against the base tensor ({coder.codec_id!r} coder): decode them with the "
            "base at hand (stage / apply_patch, Patch.change(name, base=...), squash(..., base=...))"
        )
    return coder.decode(params, blob, n, numel, base)


def encode_symbols(symbols: np.ndarray) -> tuple[Params, bytes]:
    """The smallest coding of unsigned symbols among zstd, fixed width and rANS."""
    return SYMBOL_CODERS.encode(symbols)


def decode_symbols(params: Params, blob: bytes, n: int) -> np.ndarray:
    return SYMBOL_CODERS.coder(params).decode(params, blob, n)
