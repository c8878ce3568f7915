"""One changed tensor: its decoded change (``TensorChange``), its section (positions, values, kind flags) and the
coders its streams may use (the encoder keeps the smallest)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flipsync.codec.bitpack import FixedWidthCoder
from flipsync.codec.bits import DType, bits_numpy, dtype_named, from_key, to_key, unzigzag, zigzag
from flipsync.codec.class_index import BaseBits
from flipsync.codec.coders import CoderRegistry, Params, PositionCoder, SymbolCoder
from flipsync.codec.context import ContextCoder
from flipsync.codec.rans import RansCoder
from flipsync.codec.rice import RiceCoder
from flipsync.codec.zstd import ZstdCoder, ZstdGapsCoder
from flipsync.domain.headers import SectionHeader
from flipsync.errors import BaseMismatchError, CorruptPatchError, PatchError

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


def needs_base(section: SectionHeader) -> bool:
    """Whether the section's positions decode only with its base tensor at hand (``ctx``)."""
    return section.pos.get("codec") in BASE_POSITION_CODERS


@dataclass
class TensorChange:
    """The changed elements of one tensor, decoded: ``values`` are int64 order-key steps, or the new key where
    ``raw`` (None: no value is raw)."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    positions: np.ndarray
    values: np.ndarray
    raw: np.ndarray | None

    @property
    def n(self) -> int:
        return int(self.positions.size)

    @property
    def mode(self) -> str:
        if self.raw is None or not self.raw.any():
            return "step"
        return "raw" if self.raw.all() else "mixed"

    def new_keys(self, old_keys: np.ndarray) -> np.ndarray:
        return old_keys + self.values if self.raw is None else np.where(self.raw, self.values, old_keys + self.values)


Base = torch.Tensor | np.ndarray | BaseBits  # a section's base: the tensor, its bits, or its bits with counts


def base_bits(base: Base | None, d: DType) -> BaseBits | None:
    """The base tensor as the context coder sees it (its unsigned bit patterns, flat, on the host)."""
    if base is None:
        return None
    if isinstance(base, BaseBits):
        if base.dtype != d:
            raise BaseMismatchError(f"the base tensor is {base.dtype.name}, the patch {d.name}")
        return base
    # a device tensor's bits are copied to the host (O(size)): the coders read them there
    bits = base if isinstance(base, np.ndarray) else bits_numpy(base.detach().contiguous().cpu())
    if bits.dtype.itemsize * 8 != d.bits:
        raise BaseMismatchError(f"the base tensor has {bits.dtype.itemsize * 8}-bit elements, the patch {d.name}")
    return BaseBits(np.ascontiguousarray(bits).reshape(-1).view(d.uint_numpy), d)


def encode_change(change: TensorChange, base: torch.Tensor | np.ndarray | None = None) -> tuple[SectionHeader, bytes]:
    """One section header and its streams, concatenated; each stream's params record its length. With
    ``base`` (the tensor the change applies to, or its bits), the positions may also be coded against it."""
    # An all-raw section is an idempotent overwrite that may be applied without its base: never ctx.
    held = base_bits(base, change.dtype) if change.mode != "raw" else None
    pos_params, pos_blob = encode_positions(change.positions, held)
    symbols = zigzag(change.values)  # steps zigzag to small unsigned numbers; raw values are their bit patterns
    if change.raw is not None:
        symbols = np.where(change.raw, from_key(change.values, change.dtype).astype(np.uint64), symbols)
    val_params, val_blob = encode_symbols(symbols)
    pos_params["bytes"], val_params["bytes"] = len(pos_blob), len(val_blob)
    blob = pos_blob + val_blob
    mode = change.mode
    tag_params = None
    if mode == "mixed":
        assert change.raw is not None
        tag_params, tag_blob = encode_symbols(change.raw.astype(np.uint64))
        tag_params["bytes"] = len(tag_blob)
        blob += tag_blob
    fields = (change.name, change.dtype.name, change.shape, change.n, mode, pos_params, val_params, tag_params)
    return SectionHeader(*fields), blob  # type: ignore[arg-type]


def split_streams(section: SectionHeader, blob: bytes | memoryview) -> dict[str, bytes]:
    """Cut a section's blob into its streams, checking the lengths the header gives."""
    out, offset = {}, 0
    for key, params in (("pos", section.pos), ("val", section.val), ("tag", section.tag)):
        if params is None:
            continue
        size = params.get("bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(blob):
            raise CorruptPatchError(f"section {section.name!r}: stream {key} runs past the section's bytes")
        out[key] = bytes(blob[offset : offset + size])
        offset += size
    if offset != len(blob):
        raise CorruptPatchError(f"section {section.name!r} holds {len(blob) - offset} unexplained bytes")
    return out


def decode_streams(
    section: SectionHeader, blob: bytes | memoryview, base: Base | None = None
) -> tuple[DType, np.ndarray, np.ndarray, np.ndarray | None]:
    """A section's dtype, positions, symbols (zigzagged steps or raw patterns) and, for a mixed section, its
    kind flags; every failure is a :class:`CorruptPatchError`. ``base``: needed for ``ctx`` positions."""
    try:
        d = dtype_named(section.dtype)
    except PatchError as e:
        raise CorruptPatchError(str(e)) from None
    blobs = split_streams(section, blob)
    n = section.n
    ctx = needs_base(section)
    positions = decode_positions(section.pos, blobs["pos"], n, section.numel, base_bits(base, d) if ctx else None)
    symbols = decode_symbols(section.val, blobs["val"], n)
    flags: np.ndarray | None = None
    if section.mode == "mixed":
        if section.tag is None:
            raise CorruptPatchError(f"section {section.name!r} is mixed but has no kind flags")
        tags = decode_symbols(section.tag, blobs["tag"], n)
        if tags.size and int(tags.max()) > 1:
            raise CorruptPatchError(f"section {section.name!r} has kind flags other than 0 and 1")
        flags = tags.astype(bool)
    return d, positions, symbols, flags


def decode_change(section: SectionHeader, blob: bytes | memoryview, base: Base | None = None) -> TensorChange:
    """Decode one section (``base``: see :func:`decode_streams`); every failure is a :class:`CorruptPatchError`."""
    d, positions, symbols, raw = decode_streams(section, blob, base)
    if section.mode == "raw":
        raw = np.ones(section.n, dtype=bool)
    values = unzigzag(symbols)
    if raw is not None:
        if d.bits < 64 and raw.any() and int(symbols[raw].max()) >> d.bits:
            raise CorruptPatchError(f"section {section.name!r} has raw values wider than {d.name}")
        values = np.where(raw, to_key(symbols.astype(d.uint_numpy), d), values)
    return TensorChange(section.name, d, section.shape, positions, values, raw)
