"""Patch files: decoded tensor changes and their safetensors container.

A patch file is a plain safetensors file:

- ``__metadata__["flipsync_patch"]`` is the container version. Version 4 (what this code writes): the uint8
  tensor ``HEADER_TENSOR`` after the large sections holds the :class:`~flipsync.domain.headers.PatchHeader`'s
  fixed fields in binary (``refs_bytes``: the version's ends and one digest) and its rows (``to_packed``, one
  per section, no per-section fingerprints or digests) zstd-compressed, the grouped values and the grouped
  positions of small sections, then the small sections themselves (``_pack_tail4``). Version 3 (still read,
  and written back): the compact header (``to_compact``, fixed fields in hex, every section's count and
  stream parameters), the grouped values and the small sections (``pack_tail``). Versions 1 and 2 (still read, and
  written back when a patch read from one is saved): ``__metadata__["flipsync_header"]`` holds the JSON header
  with per-section fingerprints and digests, zstd-compressed and base64-encoded. At 0.015% changed the
  version 2 header cost ~72 bytes per changed tensor, as much as the tensor's coded changes.
- A changed tensor whose coded streams reach ``OWN_TENSOR_BYTES`` is a uint8 tensor of the same name holding
  its streams back to back (positions, values, kind flags; lengths in the header), so any safetensors reader
  lists the large changes and a store can range-read one. Smaller sections are concatenated, in header order,
  into one tensor (``HEADER_TENSOR``; ``SMALL_SECTIONS`` in versions 1 and 2): a table entry per tiny tensor
  would outweigh its changes.

"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import zstandard

from flipsync.codec import streams
from flipsync.codec.bitpack import FixedWidthCoder
from flipsync.codec.bits import DType, bits_numpy, dtype_named, from_key, to_key, unzigzag, zigzag
from flipsync.codec.coders import position_gaps
from flipsync.codec.context import BaseBits
from flipsync.codec.fingerprint import combine_digests, fp_hex
from flipsync.codec.rice import (
    MAX_RICE_K,
    best_rice_k,
    rice_bits,
    rice_decode_runs,
    rice_encode,
    rice_pack,
)
from flipsync.domain.headers import PatchHeader, SectionHeader, ViewRef, read_varint, varint
from flipsync.errors import BaseMismatchError, CorruptPatchError, PatchError

MAX_HEADER_BYTES = 64 << 20
# What one decoded change holds in memory: an int64 position, an int64 value and a raw flag.
DECODED_BYTES_PER_CHANGE = 17
# Default cap on what decoding whole patches without their tensors (flipsync squash) may allocate. A header may
# declare up to 2**48 changes per tensor and the coded streams expand ~32,000x (zstd) or more (ans), so a
# small crafted file could otherwise ask for terabytes; apply bounds them by the real tensors instead.
DEFAULT_MAX_DECODED_BYTES = 8 << 30
CONTAINER_VERSION = "4"  # what this code writes: binary fixed fields, grouped positions of small sections
V3_CONTAINER = "3"  # the compact header (still read; written back by to_bytes)
V2_CONTAINER = "2"  # JSON header in the metadata, with a ctx section (still read; written back by to_bytes)
V1_CONTAINER = "1"  # the same without version 2 coders
LEGACY_CONTAINERS = (V1_CONTAINER, V2_CONTAINER)
COMPACT_CONTAINERS = (V3_CONTAINER, CONTAINER_VERSION)  # one header tensor (pack_tail) instead of metadata
READABLE_CONTAINERS = (*LEGACY_CONTAINERS, *COMPACT_CONTAINERS)
OWN_TENSOR_BYTES = 4096
SMALL_SECTIONS = "flipsync.small_sections"
# Container version 3: one tensor after the large sections holds the compressed compact header, the grouped
# values and the small sections (see pack_tail): one table entry per version instead of three.
HEADER_TENSOR = "flipsync.header"
RESERVED_NAMES = ("__metadata__", SMALL_SECTIONS, HEADER_TENSOR)
GROUP = "group"  # a stream's codec in a version 3/4 file: its values (4: or positions) are in the grouped stream
# Position coders that spend at least one bit per position, so that the positions' bytes bound how many
# values grouped sections may declare before anything is decoded.
GROUP_POSITION_CODERS = frozenset({"rice", "ctx"})
TABLE_ENTRY_BYTES = 64  # about what one more tensor costs in the container's table
# About what a section's header row saves when its positions join the group (its n, k and stream length,
# compressed), by which the encoder decides whom to group. An estimate, not the compressed rows' real sizes:
# those depend on the other rows' values, and a patch read back (its grouped values in a simpler code) must
# group the same sections again.
GROUPED_ROW_SAVING = 4
_FIXED = FixedWidthCoder()


@dataclass
class TensorChange:
    """The changed elements of one tensor, decoded.

    ``values`` are int64 order keys: a step (new key minus old key) where ``raw`` is False, the new key
    where ``raw`` is True. ``raw`` is None when no value is raw.
    """

    name: str
    dtype: DType
    shape: tuple[int, ...]
    positions: np.ndarray
    values: np.ndarray
    raw: np.ndarray | None
    base_fp: int | None  # None: decoded from a compact header, which leaves them to the view fingerprints
    target_fp: int | None
    target_digest: str | None = None

    @property
    def n(self) -> int:
        return int(self.positions.size)

    @property
    def mode(self) -> str:
        if self.raw is None or not self.raw.any():
            return "step"
        return "raw" if self.raw.all() else "mixed"

    def new_keys(self, old_keys: np.ndarray) -> np.ndarray:
        if self.raw is None:
            return old_keys + self.values
        return np.where(self.raw, self.values, old_keys + self.values)


def _symbols(change: TensorChange) -> np.ndarray:
    """Steps zigzag to small unsigned numbers; raw values are stored as their bit patterns."""
    if change.raw is None:
        return zigzag(change.values)
    raw_bits = from_key(change.values, change.dtype).astype(np.uint64)
    return np.where(change.raw, raw_bits, zigzag(change.values))


STREAMS = ("pos", "val", "tag")


Base = torch.Tensor | np.ndarray | BaseBits  # a section's base: the tensor, its bits, or its bits with counts


def base_bits(base: Base | None, d: DType) -> BaseBits | None:
    """The base tensor as the context coder sees it (its unsigned bit patterns, flat, on the host)."""
    if base is None:
        return None
    if isinstance(base, BaseBits):
        if base.dtype != d:
            raise BaseMismatchError(f"the base tensor is {base.dtype.name}, the patch {d.name}")
        return base
    bits = base if isinstance(base, np.ndarray) else bits_numpy(base.detach().contiguous())
    if bits.dtype.itemsize * 8 != d.bits:
        raise BaseMismatchError(f"the base tensor has {bits.dtype.itemsize * 8}-bit elements, the patch {d.name}")
    return BaseBits(np.ascontiguousarray(bits).reshape(-1).view(d.uint_numpy), d)


def encode_change(change: TensorChange, base: torch.Tensor | np.ndarray | None = None) -> tuple[SectionHeader, bytes]:
    """One section header and its streams, concatenated; each stream's params record its length.

    With ``base`` (the tensor the change applies to, or its bits), the positions may also be coded against it
    (the ``ctx`` coder), when that is smaller; such a section then decodes only with the base at hand. Raw
    (overwrite) sections never are: they must apply to whatever the receiver holds.
    """
    # An all-raw section is an idempotent overwrite that may be applied without its base: never ctx.
    held = base_bits(base, change.dtype) if change.mode != "raw" else None
    pos_params, pos_blob = streams.encode_positions(change.positions, held)
    val_params, val_blob = streams.encode_symbols(_symbols(change))
    pos_params["bytes"], val_params["bytes"] = len(pos_blob), len(val_blob)
    blob = pos_blob + val_blob
    mode = change.mode
    tag_params = None
    if mode == "mixed":
        assert change.raw is not None
        tag_params, tag_blob = streams.encode_symbols(change.raw.astype(np.uint64))
        tag_params["bytes"] = len(tag_blob)
        blob += tag_blob
    header = SectionHeader(
        name=change.name,
        dtype=change.dtype.name,
        shape=change.shape,
        n=change.n,
        mode=mode,  # type: ignore[arg-type]
        pos=pos_params,
        val=val_params,
        base_fp=None if change.base_fp is None else fp_hex(change.base_fp),
        target_fp=None if change.target_fp is None else fp_hex(change.target_fp),
        target_digest=change.target_digest,
        tag=tag_params,
    )
    return header, blob


def split_streams(section: SectionHeader, blob: bytes | memoryview) -> dict[str, bytes]:
    """Cut a section's blob into its streams, checking the lengths the header gives."""
    params = {"pos": section.pos, "val": section.val, "tag": section.tag}
    out, offset = {}, 0
    for key in STREAMS:
        if params[key] is None:
            continue
        size = params[key].get("bytes")  # type: ignore[union-attr]
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
    kind flags (None otherwise), before any value pass; every failure is a :class:`CorruptPatchError`.
    ``base``: the tensor the section applies to, needed (and then read once) when its positions are ``ctx``-coded.
    """
    try:
        d = dtype_named(section.dtype)
    except PatchError as e:
        raise CorruptPatchError(str(e)) from None
    blobs = split_streams(section, blob)
    n = section.n
    ctx = streams.POSITION_CODERS.coder(section.pos).needs_base
    positions = streams.decode_positions(
        section.pos, blobs["pos"], n, section.numel, base_bits(base, d) if ctx else None
    )
    symbols = streams.decode_symbols(section.val, blobs["val"], n)
    flags: np.ndarray | None = None
    if section.mode == "mixed":
        if section.tag is None:
            raise CorruptPatchError(f"section {section.name!r} is mixed but has no kind flags")
        tags = streams.decode_symbols(section.tag, blobs["tag"], n)
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
    return TensorChange(
        name=section.name,
        dtype=d,
        shape=section.shape,
        positions=positions,
        values=values,
        raw=raw,
        base_fp=None if section.base_fp is None else int(section.base_fp, 16),
        target_fp=None if section.target_fp is None else int(section.target_fp, 16),
        target_digest=section.target_digest,
    )


class PatchBuilder:
    """Encodes changes as they come, so only the coded bytes are kept, never every decoded change."""

    def __init__(self) -> None:
        self._sections: list[SectionHeader] = []
        self._blobs: dict[str, bytes] = {}

    def add(self, change: TensorChange, base: torch.Tensor | np.ndarray | None = None) -> None:
        if change.n:
            self.add_encoded(*encode_change(change, base))

    def add_encoded(self, section: SectionHeader, blob: bytes) -> None:
        """A section ``encode_change`` already coded (e.g. on another thread, its fingerprints filled in later)."""
        if section.name in self._blobs or section.name in RESERVED_NAMES:
            raise PatchError(f"tensor name {section.name!r} is used twice or reserved")
        self._blobs[section.name] = blob
        self._sections.append(section)

    def build(
        self,
        *,
        base: ViewRef,
        target: ViewRef,
        served_format: str | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> Patch:
        header = PatchHeader(base, target, tuple(self._sections), served_format, dict(meta or {}))
        return Patch(header, self._blobs)


class PatchFileWriter:
    """Lays out a patch file while its sections are still being coded.

    A section large enough for its own tensor goes into the data area as soon as it is added (``add`` returns
    its bytes, to be written or uploaded at once); small ones are held and go last, as the one small-sections
    tensor. The container header, which names every tensor's offsets, is written last but goes first: the
    file is ``head + every returned blob, in order + tail``. `Patch.to_bytes` uses the same layout, so a file
    streamed out this way is byte for byte the one it would write (and the same header gives the same bytes).
    """

    def __init__(self) -> None:
        self._names: list[str] = []
        self._entries: dict[str, tuple[int, int]] = {}
        self._small: list[tuple[str, bytes | memoryview]] = []
        self._offset = 0

    def add(self, name: str, blob: bytes | memoryview, small: bool | None = None) -> bytes | memoryview | None:
        """Place one section (in header order); its bytes when they go into the data area now, else None.
        ``small``: whether it goes into the shared tensor, when known (a patch read from a file keeps its
        layout), else by its size."""
        self._names.append(name)
        if len(blob) < OWN_TENSOR_BYTES if small is None else small:
            self._small.append((name, blob))
            return None
        self._entries[name] = (self._offset, self._offset + len(blob))
        self._offset += len(blob)
        return blob

    def finish(
        self, header: PatchHeader, *, legacy: bool = False, container: str = CONTAINER_VERSION
    ) -> tuple[bytes, bytes]:
        """(head, tail) of the file whose sections, in ``header``'s order, are the ones added.

        ``legacy``: write container version 1 or 2 (JSON header in the metadata, per-section fingerprints
        and digests, which every section must then carry) instead of ``container`` (version 4, or 3).
        """
        if not legacy and container not in COMPACT_CONTAINERS:
            raise PatchError(f"cannot write patch container {container!r} (only {COMPACT_CONTAINERS} or legacy)")
        if [s.name for s in header.sections] != self._names:
            raise PatchError("the patch header does not list the sections that were laid out, in their order")
        entries = dict(self._entries)
        small = b"".join(b for _, b in self._small)
        if legacy:
            if any(s.base_fp is None or s.target_fp is None for s in header.sections):
                raise PatchError(
                    "this patch has no per-section fingerprints (it was read from a compact, version 3 file): "
                    "it can only be written as version 3"
                )
            packed = zstandard.ZstdCompressor(level=19).compress(header.to_json().encode())
            meta = {"flipsync_patch": container_version(header), "flipsync_header": base64.b64encode(packed).decode()}
            tail = small
        else:
            if header.digest is None:
                header = replace(header, digest=sections_digest(header.sections))
            header, small_blobs, values = _group_values(header, self._small)
            if container == V3_CONTAINER:
                packed = zstandard.ZstdCompressor(level=19).compress(header.to_compact().encode())
                tail = pack_tail(packed, values, b"".join(small_blobs))
            else:
                tail = _pack_tail4(header, values, [n for n, _ in self._small], small_blobs)
            entries[HEADER_TENSOR] = (self._offset, self._offset + len(tail))
            meta = {"flipsync_patch": container}
            small = b""  # inside the header tensor
        if small:
            entries[SMALL_SECTIONS] = (self._offset, self._offset + len(small))
        doc: dict[str, object] = {"__metadata__": meta}
        for name, (a, b) in entries.items():
            doc[name] = {"dtype": "U8", "shape": [b - a], "data_offsets": [a, b]}
        text = json.dumps(doc, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        return struct.pack("<Q", len(text)) + text, tail


class Patch:
    """A patch: its header plus the coded section streams, decoded on demand."""

    def __init__(
        self,
        header: PatchHeader,
        blobs: Mapping[str, bytes | memoryview],
        container: str | None = None,
        small: frozenset[str] | None = None,
        raw: memoryview | None = None,
    ) -> None:
        self.header = header
        self._blobs = blobs
        self._sections = {s.name: s for s in header.sections}
        # The container version it was read from; to_bytes writes a patch of an older version back in its own.
        self.container = container
        # The sections it read from the shared small-sections tensor: written back there, although a grouped
        # stream, given back to its section in a simpler code, may have grown past OWN_TENSOR_BYTES.
        self._small = small
        # The file it was read from: written back as it is (a newer encoder may code a regrouped stream in
        # other bytes, and the file is the patch its signature and the board's records name).
        self._raw = raw

    # -------------------------------------------------------------------------------- construction
    @classmethod
    def from_changes(
        cls,
        changes: Iterable[TensorChange],
        *,
        base: ViewRef,
        target: ViewRef,
        served_format: str | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> Patch:
        builder = PatchBuilder()
        for change in changes:
            builder.add(change)
        return builder.build(base=base, target=target, served_format=served_format, meta=meta)

    @classmethod
    def merge_disjoint(
        cls, patches: Iterable[Patch], *, base: ViewRef, target: ViewRef, served_format: str | None = None
    ) -> Patch:
        """Shards of one version (e.g. one per trainer rank) side by side: their sections are moved, not
        decoded. Every tensor may appear in one shard only; the caller names the ends of the whole."""
        sections: list[SectionHeader] = []
        blobs: dict[str, bytes | memoryview] = {}
        digests: list[str | None] = []
        for p in patches:
            for s in p.sections:
                if s.name in blobs:
                    raise PatchError(f"tensor {s.name!r} appears in more than one shard")
                sections.append(s)
                blobs[s.name] = p._blobs[s.name]
            digests.append(p.header.digest or sections_digest(p.sections))
        # Disjoint shards: the XOR of their combined digests is the digest of the union (combine_digests).
        digest = None if None in digests else f"{_xor_hex(d for d in digests if d is not None):032x}"
        return cls(PatchHeader(base, target, tuple(sections), served_format, digest=digest), blobs)

    # ------------------------------------------------------------------------------------- access
    @property
    def sections(self) -> tuple[SectionHeader, ...]:
        return self.header.sections

    def __len__(self) -> int:
        return len(self.header.sections)

    def section_bytes(self, name: str) -> int:
        return len(self._blobs.get(name, b""))

    def change(self, name: str, base: Base | None = None) -> TensorChange:
        """One tensor's change; ``base`` (the tensor it applies to) is needed for ``ctx``-coded positions."""
        return decode_change(self._sections[name], self.section_blob(name), base)

    def section_blob(self, name: str) -> bytes | memoryview:
        """The coded streams of one section, back to back (see :func:`split_streams`)."""
        if name not in self._blobs:
            raise CorruptPatchError(f"patch lacks the coded streams of tensor {name!r}")
        return self._blobs[name]

    def changes(self, base: Mapping[str, torch.Tensor] | None = None) -> Iterator[TensorChange]:
        """Every tensor's change, in header order; ``base``: the view the patch applies to (see ``change``)."""
        for section in self.header.sections:
            tensor = None
            if base is not None and _needs_base(section):
                if section.name not in base:
                    raise BaseMismatchError(f"the patch changes tensor {section.name!r}, which the base does not hold")
                tensor = base[section.name]
            yield self.change(section.name, tensor)

    @property
    def needs_base(self) -> bool:
        """Whether some section decodes only with its base tensor (version 2 ``ctx`` positions)."""
        return any(_needs_base(s) for s in self.header.sections)

    def section_needs_base(self, name: str) -> bool:
        return _needs_base(self._sections[name])

    def with_refs(self, *, base: ViewRef | None = None, target: ViewRef | None = None) -> Patch:
        """The same patch with its ends renamed (e.g. stamped with board version numbers)."""
        header = replace(self.header, base=base or self.header.base, target=target or self.header.target)
        return Patch(header, self._blobs, self.container, self._small)

    # ---------------------------------------------------------------------------------- container
    def to_bytes(self, *, legacy: bool | None = None, container: str | None = None) -> bytes:
        """The patch file; ``legacy``: a version 1/2 container (see ``PatchFileWriter.finish``), else
        ``container`` ("4" or "3"); by default version 4, or for a patch read from a file, that file."""
        if legacy is None and container is None and self._raw is not None:
            return bytes(self._raw)
        if legacy is None:
            legacy = container is None and self.container in LEGACY_CONTAINERS
        if container is None:
            container = V3_CONTAINER if self.container == V3_CONTAINER else CONTAINER_VERSION
        writer = PatchFileWriter()
        small = self._small
        data = [
            writer.add(s.name, self._blobs[s.name], None if small is None else s.name in small)
            for s in self.header.sections
        ]
        head, tail = writer.finish(self.header, legacy=legacy, container=container)
        return b"".join([head, *(d for d in data if d is not None), tail])

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Patch:
        meta, tensors = _parse_safetensors(memoryview(data))
        version = meta.get("flipsync_patch")
        if version not in READABLE_CONTAINERS:
            raise CorruptPatchError(
                f"unsupported patch container {version!r} (this flipsync reads {READABLE_CONTAINERS})"
            )
        if version in COMPACT_CONTAINERS:
            if HEADER_TENSOR not in tensors or SMALL_SECTIONS in tensors:
                raise CorruptPatchError(
                    f"patch container {version} must hold its header tensor {HEADER_TENSOR!r}, and its small "
                    "sections only there"
                )
            positions = None
            if version == V3_CONTAINER:
                packed, values, tensors[SMALL_SECTIONS] = split_tail(tensors.pop(HEADER_TENSOR))
                header = PatchHeader.from_compact(_inflate(packed))
            else:
                refs, packed, values, positions, tensors[SMALL_SECTIONS] = _split_tail4(tensors.pop(HEADER_TENSOR))
                header = PatchHeader.from_packed(refs, _inflate(packed))
            blobs: dict[str, bytes | memoryview] = dict(_locate_sections(header, tensors))
            small = frozenset(s.name for s in header.sections if s.name not in tensors)
            if positions is not None or any(s.pos.get("codec") == GROUP or not s.n for s in header.sections):
                header, blobs = _ungroup_positions(header, blobs, positions)
            if values is not None or any(s.val.get("codec") == GROUP for s in header.sections):
                header, blobs = _ungroup_values(header, blobs, values)
            return cls(header, blobs, version, small, memoryview(data))
        else:
            if "flipsync_header" not in meta:
                raise CorruptPatchError(f"patch container {version} lacks its 'flipsync_header' metadata")
            header = PatchHeader.from_json(_inflate_header(meta["flipsync_header"]))
        return cls(header, _locate_sections(header, tensors), version, raw=memoryview(data))

    @classmethod
    def load(cls, path: str | Path) -> Patch:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise PatchError(f"cannot read patch {path}: {e.strerror}") from None
        return cls.from_bytes(data)

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self._blobs.values())

    @property
    def decoded_nbytes(self) -> int:
        """What decoding every section allocates, from the header's declared counts (nothing is decoded)."""
        return self.header.n_changed * DECODED_BYTES_PER_CHANGE


def _needs_base(section: SectionHeader) -> bool:
    return section.pos.get("codec") in streams.V2_POSITION_CODERS


def container_version(header: PatchHeader) -> str:
    """The legacy container of a header: "2" when a section uses a version 2 coder, else "1" (a version 1
    reader then refuses it cleanly, and a patch that needs none of them stays byte for byte what it wrote)."""
    return V2_CONTAINER if any(_needs_base(s) for s in header.sections) else V1_CONTAINER


def sections_digest(sections: Iterable[SectionHeader]) -> str | None:
    """The combined target digest of these sections (``combine_digests``), None unless every one has its own."""
    named = [(s.name, s.target_digest) for s in sections]
    if any(d is None for _, d in named):
        return None
    return combine_digests(named)  # type: ignore[arg-type]


def _xor_hex(digests: Iterable[str]) -> int:
    acc = 0
    for d in digests:
        acc ^= int(d, 16)
    return acc


def check_decoded_size(patches: Iterable[Patch], max_bytes: int = DEFAULT_MAX_DECODED_BYTES) -> None:
    """Refuse, before anything is decoded, patches whose declared changes would take more than ``max_bytes``."""
    patches = list(patches)
    total = sum(p.decoded_nbytes for p in patches)
    if total > max_bytes:
        n = sum(p.header.n_changed for p in patches)
        raise CorruptPatchError(
            f"the patch{'es' if len(patches) > 1 else ''} declare{'' if len(patches) > 1 else 's'} {n:,} changed "
            f"values, {total / (1 << 30):,.1f} GiB once decoded, more than the limit of "
            f"{max_bytes / (1 << 30):g} GiB: a crafted or corrupt patch, or a chain too large for this limit "
            "(if the patches are genuine, raise it: flipsync squash --max-decoded-gib N, or max_decoded_bytes)"
        )


def _inflate_header(text: str) -> str:
    try:
        packed = base64.b64decode(text, validate=True)
    except ValueError as e:
        raise CorruptPatchError(f"patch header cannot be decoded: {e}") from None
    return _inflate(packed)


def _inflate(packed: bytes | memoryview) -> str:
    """A zstd frame that must declare its size, at most MAX_HEADER_BYTES: bounded memory on any input."""
    try:
        packed = bytes(packed)
        size = zstandard.frame_content_size(packed)
        if not 0 <= size <= MAX_HEADER_BYTES:
            raise CorruptPatchError(f"patch header declares {size} bytes (at most {MAX_HEADER_BYTES})")
        return zstandard.ZstdDecompressor().decompress(packed, max_output_size=MAX_HEADER_BYTES).decode()
    except (ValueError, zstandard.ZstdError, UnicodeDecodeError) as e:
        raise CorruptPatchError(f"patch header cannot be decoded: {e}") from None


def _section_size(section: SectionHeader) -> int:
    # grouped values (version 3) are not in the section's bytes
    sizes = [
        p.get("bytes") for p in (section.pos, section.val, section.tag) if p is not None and p.get("codec") != GROUP
    ]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in sizes):
        raise CorruptPatchError(f"section {section.name!r} has invalid stream lengths")
    return sum(sizes)  # type: ignore[arg-type]


def _groupable(s: SectionHeader) -> bool:
    return s.mode == "step" and s.tag is None and s.pos.get("codec") in GROUP_POSITION_CODERS


_PREAMBLE = struct.Struct("<H")  # grouped values: length of the JSON params of their stream, then both
_LENGTH = struct.Struct("<I")


def pack_tail(header: bytes, values: bytes, small: bytes) -> bytes:
    """The version 3 header tensor: the compressed header and the grouped values, each after its length
    (u32), then the small sections."""
    return _LENGTH.pack(len(header)) + header + _LENGTH.pack(len(values)) + values + small


def split_tail(blob: memoryview | bytes) -> tuple[memoryview, memoryview | None, memoryview]:
    """(compressed header, grouped values or None, small sections) of a version 3 header tensor."""
    view = memoryview(blob)
    parts = []
    for what in ("header", "grouped values"):
        if len(view) < _LENGTH.size or _LENGTH.size + _LENGTH.unpack_from(view)[0] > len(view):
            raise CorruptPatchError(f"the patch's header tensor is truncated (its {what})")
        end = _LENGTH.size + _LENGTH.unpack_from(view)[0]
        parts.append(view[_LENGTH.size : end])
        view = view[end:]
    return parts[0], parts[1] if len(parts[1]) else None, view


def _group_values(
    header: PatchHeader, small: list[tuple[str, bytes | memoryview]]
) -> tuple[PatchHeader, list[bytes | memoryview], bytes]:
    """Container version 3: the value steps of the small step sections coded as one stream (one frequency
    table per version instead of one per tensor), when that is smaller; their sections then hold only their
    positions. Returns the header (grouped sections' value codec ``GROUP``), the small sections' bytes in
    order, and the grouped values' bytes (empty: nothing grouped)."""
    by_name = {s.name: s for s in header.sections}
    picked = [
        i for i, (name, _) in enumerate(small) if _groupable(by_name[name]) and by_name[name].val.get("codec") != GROUP
    ]
    if len(picked) < 2:
        return header, [b for _, b in small], b""
    positions: dict[int, bytes] = {}
    symbols = []
    for i in picked:
        name, blob = small[i]
        s = by_name[name]
        parts = split_streams(s, blob)
        positions[i] = parts["pos"]
        symbols.append(streams.decode_symbols(s.val, parts["val"], s.n))
    params, stream = streams.encode_symbols(np.concatenate(symbols))
    text = json.dumps(params, separators=(",", ":")).encode()
    values = _PREAMBLE.pack(len(text)) + text + stream
    if len(values) + TABLE_ENTRY_BYTES >= sum(len(small[i][1]) - len(positions[i]) for i in picked):
        return header, [b for _, b in small], b""
    grouped = {small[i][0] for i in picked}
    sections = tuple(replace(s, val={"codec": GROUP}) if s.name in grouped else s for s in header.sections)
    return replace(header, sections=sections), [positions.get(i, b) for i, (_, b) in enumerate(small)], values


def _ungroup_values(
    header: PatchHeader, blobs: dict[str, memoryview], values: memoryview | None
) -> tuple[PatchHeader, dict[str, bytes | memoryview]]:
    """Give every grouped section its own value stream again (fixed width: exact, no search), so that the
    rest of the codec sees ordinary sections; every inconsistency is a CorruptPatchError."""
    grouped = [s for s in header.sections if s.val.get("codec") == GROUP]
    if values is None or not grouped:
        raise CorruptPatchError("patch has grouped value steps without their grouped values, or the reverse")
    if not all(_groupable(s) for s in grouped):
        raise CorruptPatchError("only step sections with rice or ctx positions may group their values")
    n = sum(s.n for s in grouped)
    # at least one bit per position: the declared counts are bounded before anything is decoded
    if n > 8 * sum(len(blobs[s.name]) for s in grouped):
        raise CorruptPatchError(f"grouped sections declare {n} values, more than their positions' bytes can hold")
    if len(values) < _PREAMBLE.size or _PREAMBLE.size + _PREAMBLE.unpack_from(values)[0] > len(values):
        raise CorruptPatchError("the patch's grouped values are truncated")
    end = _PREAMBLE.size + _PREAMBLE.unpack_from(values)[0]
    try:
        params = json.loads(bytes(values[_PREAMBLE.size : end]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CorruptPatchError(f"the grouped values' parameters are not valid JSON: {e}") from None
    if not isinstance(params, dict) or not all(isinstance(v, str | int) for v in params.values()):
        raise CorruptPatchError("the grouped values' parameters must map names to strings or integers")
    symbols = streams.decode_symbols(params, bytes(values[end:]), n)
    out: dict[str, bytes | memoryview] = dict(blobs)
    sections, at = [], 0
    for s in header.sections:
        if s.val.get("codec") == GROUP:
            val_params, val_blob = _FIXED.encode(symbols[at : at + s.n])
            at += s.n
            s = replace(s, val={"codec": _FIXED.codec_id, **val_params, "bytes": len(val_blob)})
            out[s.name] = bytes(blobs[s.name]) + val_blob
        sections.append(s)
    return replace(header, sections=tuple(sections)), out


def _position_groupable(s: SectionHeader) -> bool:
    """Rice positions: they decode without the base, and the reader gives each member a Rice stream back, so
    that a patch read back groups its values the same way too (which depends on the positions' coder)."""
    return s.pos.get("codec") == "rice"


def _group_positions(
    header: PatchHeader, names: list[str], small: list[bytes | memoryview]
) -> tuple[PatchHeader, list[bytes | memoryview], bytes] | None:
    """Container version 4: the positions of small sections as one Rice stream over their index spaces laid end
    to end (in header order), instead of one stream per section, each byte-padded and with its own n, k and
    length in the header. Members are the small sections with Rice positions whose gaps cost, under
    the group's k, no more than their own stream and row; None when fewer than two qualify or the group would
    not be smaller. Returns the header
    (members' n 0 and position codec ``GROUP``), the small sections' bytes without members' positions, and the
    grouped stream: k (a byte), the number of positions (LEB128), the Rice code of their gaps."""
    by_name = {s.name: s for s in header.sections}
    picked, found, own = [], [], []
    for i, name in enumerate(names):
        s = by_name[name]
        if not _position_groupable(s):
            continue
        try:
            size = _stream_bytes(s.pos, s.name)
            found.append(streams.decode_positions(s.pos, bytes(small[i][:size]), s.n, s.numel))
        except CorruptPatchError:  # the writer writes what it is given (e.g. a crafted test patch) as it is
            continue
        picked.append(i)
        own.append(size)
    if len(picked) < 2:
        return None
    sections = [by_name[names[i]] for i in picked]
    if sum(s.numel for s in sections) >= 1 << 62:
        return None
    gaps = [position_gaps(p) for p in found]
    members = list(range(len(picked)))
    for _ in range(4):  # drop members whose gaps the shared k codes worse than their own stream did
        k = best_rice_k(np.concatenate([gaps[j] for j in members]))
        keep = [j for j in members if rice_bits(gaps[j], k) <= 8 * (own[j] + GROUPED_ROW_SAVING)]
        if len(keep) < 2:
            return None
        if len(keep) == len(members):
            break
        members = keep
    offsets = np.cumsum([0] + [sections[j].numel for j in members])
    joined = np.concatenate([found[j] + int(offsets[m]) for m, j in enumerate(members)])
    params, code = rice_encode(position_gaps(joined))
    stream = bytes([params["k"]]) + varint(joined.size) + code
    if len(varint(len(stream))) + len(stream) >= sum(own[j] + GROUPED_ROW_SAVING for j in members):
        return None
    grouped = {sections[j].name for j in members}
    out_sections = tuple(replace(s, n=0, pos={"codec": GROUP}) if s.name in grouped else s for s in header.sections)
    blobs = list(small)
    for j in members:
        blobs[picked[j]] = small[picked[j]][own[j] :]
    return replace(header, sections=out_sections), blobs, stream


def _stream_bytes(params: dict[str, object], name: str) -> int:
    size = params.get("bytes")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise CorruptPatchError(f"section {name!r} has invalid stream lengths")
    return size


def _positions_preamble(stream: bytes | memoryview) -> tuple[int, int, int]:
    """(k, number of positions, where the code starts) of a grouped positions stream."""
    if not len(stream) or stream[0] > MAX_RICE_K:
        raise CorruptPatchError("the patch's grouped positions are truncated or have an invalid Rice parameter")
    n, at = read_varint(stream, 1, "the number of grouped positions")
    return stream[0], n, at


def _ungroup_positions(
    header: PatchHeader, blobs: dict[str, bytes | memoryview], stream: memoryview | None
) -> tuple[PatchHeader, dict[str, bytes | memoryview]]:
    """Give every section whose positions are grouped its own position stream and its n again, so that the rest
    of the codec sees ordinary sections: the Rice stream the encoder had given it (members are Rice-coded
    sections, and Rice is deterministic), so that writing the patch again groups the same sections the same
    way. Memory is bounded before anything is decoded: the count may not exceed the stream's bits, and the
    members' streams are sized by their decoded gaps, not by the sizes their rows declare. Every
    inconsistency is a CorruptPatchError."""
    grouped = [s for s in header.sections if s.pos.get("codec") == GROUP]
    if stream is None or not grouped:
        raise CorruptPatchError("patch has grouped positions without their stream, or the reverse")
    if any(s.pos != {"codec": GROUP} or s.n for s in grouped):
        raise CorruptPatchError("a section with grouped positions declares their count or parameters itself")
    if any(not s.n for s in header.sections if s.pos.get("codec") != GROUP):
        raise CorruptPatchError("a section whose positions are not grouped does not declare its count")
    k, n, at = _positions_preamble(stream)
    space = sum(s.numel for s in grouped)
    if space >= 1 << 62:
        raise CorruptPatchError(f"grouped sections declare {space} elements, more than any patch holds")
    code = np.frombuffer(stream, dtype=np.uint8)[at:]
    if not len(grouped) <= n <= 8 * code.size:  # at least one bit per position
        raise CorruptPatchError(f"{n} grouped positions cannot be those of {len(grouped)} sections in {code.size} B")
    found = np.empty(n, dtype=np.int64)
    used = rice_decode_runs(code, 0, np.array([k], np.int64), np.array([n], np.int64), found, space)
    if used < 0:
        raise CorruptPatchError("the patch's grouped positions are truncated or run past their sections")
    if (used + 7) // 8 != code.size:
        raise CorruptPatchError("the patch's grouped positions hold bytes no position claims")
    ends = np.cumsum([s.numel for s in grouped], dtype=np.int64)
    his = np.searchsorted(found, ends)
    counts = np.diff(his, prepend=0)
    if counts.min() < 1:
        name = grouped[int(np.argmin(counts))].name
        raise CorruptPatchError(f"section {name!r} has grouped positions, but none in its tensor")
    los = his - counts
    # every member's gaps at once (its first from -1 in its own index space), each coded with its own k
    local = found - np.repeat(ends - [s.numel for s in grouped], counts)
    gaps = np.diff(local, prepend=-1) - 1
    gaps[los] = local[los]
    gaps = gaps.astype(np.uint64)
    ks = [best_rice_k(gaps[lo:hi]) for lo, hi in zip(los.tolist(), his.tolist(), strict=True)]
    # Rice bits of c gaps with parameter k: c (k + 1) + the sum of gap >> k, at most (sum of gaps) >> k, which
    # k (near log2 of the mean) keeps below ~6c: bounded by the decoded count, never by a declared tensor size
    sums = np.add.reduceat(gaps, los).tolist()
    sizes = [(c * (k + 1) + (g >> k) + 7) // 8 for c, k, g in zip(counts.tolist(), ks, sums, strict=True)]
    code_out = np.empty(sum(sizes), dtype=np.uint8)
    out, sections, member, at = dict(blobs), [], 0, 0
    for s in header.sections:
        if s.pos.get("codec") == GROUP:
            lo, hi, k = int(los[member]), int(his[member]), ks[member]
            used = rice_pack(gaps[lo:hi], k, code_out[at : at + sizes[member]])
            s = replace(s, n=hi - lo, pos={"codec": "rice", "k": k, "bytes": used})
            out[s.name] = code_out[at : at + used].tobytes() + bytes(blobs[s.name])
            at, member = at + sizes[member], member + 1
        sections.append(s)
    return replace(header, sections=tuple(sections)), out


def _pack_tail4(header: PatchHeader, values: bytes, names: list[str], small: list[bytes | memoryview]) -> bytes:
    """The version 4 header tensor, each part after its length (LEB128): the header's fixed fields
    (``PatchHeader.refs_bytes``), its compressed rows, the grouped values, the grouped positions (see
    ``_group_positions``); then the small sections."""
    positions = b""
    grouped = _group_positions(header, names, small)
    if grouped is not None:
        header, small, positions = grouped
    refs = header.refs_bytes()
    packed = zstandard.ZstdCompressor(level=19).compress(header.to_packed().encode())
    parts = (refs, packed, values, positions)
    return b"".join([*(b for part in parts for b in (varint(len(part)), part)), *small])


def _split_tail4(
    blob: memoryview | bytes,
) -> tuple[memoryview, memoryview, memoryview | None, memoryview | None, memoryview]:
    """(fixed fields, compressed rows, grouped values or None, grouped positions or None, small sections) of a
    version 4 header tensor."""
    view, at, parts = memoryview(blob), 0, []
    for what in ("fixed fields", "header", "grouped values", "grouped positions"):
        size, at = read_varint(view, at, f"the length of the patch's {what}")
        if at + size > len(view):
            raise CorruptPatchError(f"the patch's header tensor is truncated (its {what})")
        parts.append(view[at : at + size])
        at += size
    refs, packed, values, positions = parts
    return refs, packed, values if len(values) else None, positions if len(positions) else None, view[at:]


def overhead_bytes(data: bytes | memoryview) -> int:
    """Bytes of a patch file that are no coded stream: the container's table and metadata, the compressed
    header (versions 3 and 4), the grouped values' parameters (and in version 4 the fixed fields, the lengths
    and the grouped positions' parameters)."""
    buf = memoryview(data)
    meta, tensors = _parse_safetensors(buf)
    size = 8 + struct.unpack_from("<Q", buf)[0]
    if HEADER_TENSOR in tensors and meta.get("flipsync_patch") == CONTAINER_VERSION:
        tail = tensors[HEADER_TENSOR]
        _, _, values, positions, small = _split_tail4(tail)
        size += len(tail) - len(small)  # less the coded streams of the grouped values and positions:
        if values is not None and len(values) >= _PREAMBLE.size:
            size -= len(values) - _PREAMBLE.size - _PREAMBLE.unpack_from(values)[0]
        if positions is not None:
            size -= len(positions) - _positions_preamble(positions)[2]
    elif HEADER_TENSOR in tensors:
        packed, values, _ = split_tail(tensors[HEADER_TENSOR])
        size += 2 * _LENGTH.size + len(packed)
        if values is not None and len(values) >= _PREAMBLE.size:
            size += _PREAMBLE.size + _PREAMBLE.unpack_from(values)[0]
    return size


def _locate_sections(header: PatchHeader, tensors: Mapping[str, memoryview]) -> dict[str, memoryview]:
    """Each section's bytes: its own tensor, or the next slice of the shared small-sections tensor."""
    small = tensors.get(SMALL_SECTIONS, memoryview(b""))
    cursor = 0
    blobs = {}
    for s in header.sections:
        if s.name in tensors:
            blobs[s.name] = tensors[s.name]
            continue
        size = _section_size(s)
        if cursor + size > len(small):
            raise CorruptPatchError(f"patch is missing the coded streams of tensor {s.name!r}")
        blobs[s.name] = small[cursor : cursor + size]
        cursor += size
    if cursor != len(small):
        raise CorruptPatchError("the small-sections tensor holds bytes no section claims")
    return blobs


def _parse_safetensors(buf: memoryview) -> tuple[dict[str, str], dict[str, memoryview]]:
    """Read a safetensors container of uint8 tensors, checking every length and offset."""
    if len(buf) < 8:
        raise CorruptPatchError("patch is truncated: shorter than a safetensors header")
    (hlen,) = struct.unpack_from("<Q", buf)
    if hlen > MAX_HEADER_BYTES or 8 + hlen > len(buf):
        raise CorruptPatchError(f"patch is truncated or corrupt: header length {hlen} exceeds the file")
    try:
        doc = json.loads(bytes(buf[8 : 8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CorruptPatchError(f"patch container header is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise CorruptPatchError("patch container header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptPatchError("patch container metadata must map names to strings")
    if "flipsync_patch" not in meta and "flipsync_header" not in meta:
        raise CorruptPatchError("this safetensors file is not a flipsync patch (no 'flipsync_patch' metadata)")
    data = buf[8 + hlen :]
    blobs: dict[str, memoryview] = {}
    spans: list[tuple[int, int]] = []
    for name, entry in doc.items():
        if not isinstance(entry, dict) or entry.get("dtype") != "U8":
            raise CorruptPatchError(f"patch stream {name!r} is not a uint8 tensor")
        offsets, shape = entry.get("data_offsets"), entry.get("shape")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= len(data)
            or shape != [offsets[1] - offsets[0]]
        ):
            raise CorruptPatchError(f"patch stream {name!r} has offsets outside the file (truncated?)")
        blobs[name] = data[offsets[0] : offsets[1]]
        spans.append((offsets[0], offsets[1]))
    _check_data_covered(len(data), spans)
    return meta, blobs


def _check_data_covered(size: int, spans: list[tuple[int, int]]) -> None:
    """The streams must tile the data area: bytes no stream claims mean the file is not the container it says."""
    cursor = 0
    for start, end in sorted(spans):
        if start > cursor:
            raise CorruptPatchError(
                f"patch is corrupt: bytes {cursor}-{start} of its data area belong to no stream (a damaged or "
                "crafted file); fetch it again"
            )
        cursor = max(cursor, end)
    if size > cursor:
        raise CorruptPatchError(
            f"patch file has {size - cursor:,} extra bytes past the end of its container: a truncated or "
            "spliced upload (e.g. another object's or a stale attempt's bytes appended); refused, fetch it again "
            "or publish it again"
        )
