"""The patch file (docs/codec.md, "The patch file"): a safetensors file of uint8 tensors, one per section of at
least ``OWN_TENSOR_BYTES``, then ``HEADER_TENSOR`` with the header and the small sections (a table entry per tiny
tensor would outweigh its changes), their values and positions grouped."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import zstandard

from flipsync.codec.bitpack import FixedWidthCoder, pack_codes
from flipsync.codec.coders import position_gaps
from flipsync.codec.rice import MAX_RICE_K, best_rice_k, rice_bits, rice_decode_runs, rice_encode
from flipsync.codec.section import decode_positions, decode_symbols, encode_symbols, split_streams
from flipsync.domain.headers import PatchHeader, SectionHeader, read_varint, varint
from flipsync.errors import CorruptPatchError, PatchError

CONTAINER_KEY = "flipsync_patch"  # the safetensors metadata entry that names the container format
CONTAINER_FORMAT = "4"  # the one format this code reads and writes
MAX_HEADER_BYTES = 64 << 20
OWN_TENSOR_BYTES = 4096
HEADER_TENSOR = "flipsync.header"
RESERVED_NAMES = ("__metadata__", HEADER_TENSOR)
GROUP = "group"  # a stream's codec id where its values or positions are in the grouped stream
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


class PatchFileWriter:
    """Lays out a patch file while its sections are still being coded: the file is ``head + every blob ``add``
    returned, in order + tail`` (small sections are held for the tail). `Patch.to_bytes` writes the same bytes."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._entries: dict[str, tuple[int, int]] = {}
        self._small: list[tuple[str, bytes | memoryview]] = []
        self._offset = 0

    def add(self, name: str, blob: bytes | memoryview, small: bool | None = None) -> bytes | memoryview | None:
        """Place one section (in header order); its bytes when they go into the data area now, else None.
        ``small``: whether it goes into the header tensor (a patch read from a file keeps its layout), else by size."""
        self._names.append(name)
        if len(blob) < OWN_TENSOR_BYTES if small is None else small:
            self._small.append((name, blob))
            return None
        self._entries[name] = (self._offset, self._offset + len(blob))
        self._offset += len(blob)
        return blob

    def finish(self, header: PatchHeader) -> tuple[bytes, bytes]:
        """(head, tail) of the file whose sections, in ``header``'s order, are the ones added."""
        if [s.name for s in header.sections] != self._names:
            raise PatchError("the patch header does not list the sections that were laid out, in their order")
        entries = dict(self._entries)
        header, small_blobs, values = _group_values(header, self._small)
        tail = _pack_tail(header, values, [n for n, _ in self._small], small_blobs)
        entries[HEADER_TENSOR] = (self._offset, self._offset + len(tail))
        doc: dict[str, object] = {"__metadata__": {CONTAINER_KEY: CONTAINER_FORMAT}}
        for name, (a, b) in entries.items():
            doc[name] = {"dtype": "U8", "shape": [b - a], "data_offsets": [a, b]}
        text = json.dumps(doc, separators=(",", ":")).encode()
        text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        return struct.pack("<Q", len(text)) + text, tail


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


def _groupable(s: SectionHeader) -> bool:
    return s.mode == "step" and s.tag is None and s.pos.get("codec") in GROUP_POSITION_CODERS


_PREAMBLE = struct.Struct("<H")  # grouped values: length of the JSON params of their stream, then both


def _group_values(
    header: PatchHeader, small: list[tuple[str, bytes | memoryview]]
) -> tuple[PatchHeader, list[bytes | memoryview], bytes]:
    """The value steps of the small step sections as one stream (one frequency table instead of one per
    tensor) where that is smaller: (header with their value codec ``GROUP``, small sections' bytes, grouped values)."""
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
        symbols.append(decode_symbols(s.val, parts["val"], s.n))
    params, stream = encode_symbols(np.concatenate(symbols))
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
    """Give every grouped section its own (fixed-width) value stream again, or raise CorruptPatchError."""
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
    symbols = decode_symbols(params, bytes(values[end:]), n)
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


def _group_positions(
    header: PatchHeader, names: list[str], small: list[bytes | memoryview]
) -> tuple[PatchHeader, list[bytes | memoryview], bytes] | None:
    """The positions of the small Rice sections whose gaps cost no more under a shared k as one Rice stream over
    their index spaces end to end; None if fewer than two or not smaller, else (header with members' n 0 and
    position codec ``GROUP``, small sections' bytes less members' positions, k byte + LEB128 count + gaps)."""
    by_name = {s.name: s for s in header.sections}
    picked, found, own = [], [], []
    for i, name in enumerate(names):
        s = by_name[name]
        # Rice positions only: they decode without the base, and the reader gives each member a Rice stream
        # back, so that a patch read back groups its values the same way too (which depends on the positions' coder).
        if s.pos.get("codec") != "rice":
            continue
        try:
            size = _stream_bytes(s.pos, s.name)
            found.append(decode_positions(s.pos, bytes(small[i][:size]), s.n, s.numel))
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
        k = best_rice_k(np.concatenate([gaps[j] for j in members]))[0]
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
    """Give every grouped section the Rice stream and n the encoder had given it (so that it groups again the same
    way); memory is bounded by the stream's bits before anything is decoded. CorruptPatchError otherwise."""
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
    ks = [best_rice_k(gaps[lo:hi])[0] for lo, hi in zip(los.tolist(), his.tolist(), strict=True)]
    # Rice bits of c gaps with parameter k: c (k + 1) + the sum of gap >> k, at most (sum of gaps) >> k, which
    # k (near log2 of the mean) keeps below ~6c: bounded by the decoded count, never by a declared tensor size
    sums = np.add.reduceat(gaps, los).tolist()
    sizes = [(c * (k + 1) + (g >> k) + 7) // 8 for c, k, g in zip(counts.tolist(), ks, sums, strict=True)]
    code_out = np.empty(sum(sizes), dtype=np.uint8)
    out, sections, member, at = dict(blobs), [], 0, 0
    for s in header.sections:
        if s.pos.get("codec") == GROUP:
            lo, hi, k = int(los[member]), int(his[member]), ks[member]
            used = pack_codes(gaps[lo:hi], k, True, code_out[at : at + sizes[member]])
            s = replace(s, n=hi - lo, pos={"codec": "rice", "k": k, "bytes": used})
            out[s.name] = code_out[at : at + used].tobytes() + bytes(blobs[s.name])
            at, member = at + sizes[member], member + 1
        sections.append(s)
    return replace(header, sections=tuple(sections)), out


def _pack_tail(header: PatchHeader, values: bytes, names: list[str], small: list[bytes | memoryview]) -> bytes:
    """The header tensor: fixed fields, rows, grouped values and positions (each after its length), small sections."""
    positions = b""
    grouped = _group_positions(header, names, small)
    if grouped is not None:
        header, small, positions = grouped
    refs = header.refs_bytes()
    packed = zstandard.ZstdCompressor(level=19).compress(header.to_packed().encode())
    parts = (refs, packed, values, positions)
    return b"".join([*(b for part in parts for b in (varint(len(part)), part)), *small])


def split_tail(
    blob: memoryview | bytes,
) -> tuple[memoryview, memoryview, memoryview | None, memoryview | None, memoryview]:
    """A header tensor's (fixed fields, rows, grouped values or None, grouped positions or None, small sections)."""
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
    """Bytes of a patch file that are no coded stream (table, metadata, header, lengths, grouped parameters)."""
    buf = memoryview(data)
    _, tensors = _parse_safetensors(buf)
    size = 8 + struct.unpack_from("<Q", buf)[0]
    tail = tensors.get(HEADER_TENSOR)
    if tail is None:
        raise CorruptPatchError(f"patch lacks its header tensor {HEADER_TENSOR!r}")
    _, _, values, positions, small = split_tail(tail)
    size += len(tail) - len(small)  # less the coded streams of the grouped values and positions:
    if values is not None and len(values) >= _PREAMBLE.size:
        size -= len(values) - _PREAMBLE.size - _PREAMBLE.unpack_from(values)[0]
    if positions is not None:
        size -= len(positions) - _positions_preamble(positions)[2]
    return size


def _locate_sections(
    header: PatchHeader, tensors: Mapping[str, memoryview], small: memoryview
) -> dict[str, memoryview]:
    """Each section's bytes: its own tensor, or the next slice of the small sections in the header tensor."""
    unlisted = sorted(set(tensors) - {s.name for s in header.sections})
    if unlisted:
        raise CorruptPatchError(
            f"patch holds tensors its header does not list ({unlisted[:3]}): a damaged or crafted file; fetch it again"
        )
    cursor = 0
    blobs = {}
    for s in header.sections:
        if s.name in tensors:
            blobs[s.name] = tensors[s.name]
            continue
        size = sum(_stream_bytes(p, s.name) for p in (s.pos, s.val, s.tag) if p is not None and p.get("codec") != GROUP)
        if cursor + size > len(small):
            raise CorruptPatchError(f"patch is missing the coded streams of tensor {s.name!r}")
        blobs[s.name] = small[cursor : cursor + size]
        cursor += size
    if cursor != len(small):
        raise CorruptPatchError("the header tensor holds small-section bytes no section claims")
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
    if CONTAINER_KEY not in meta:
        raise CorruptPatchError(f"this safetensors file is not a flipsync patch (no {CONTAINER_KEY!r} metadata)")
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
    # The streams must tile the data area: bytes no stream claims mean the file is not the container it says.
    cursor = 0
    for start, end in sorted(spans):
        if start > cursor:
            raise CorruptPatchError(
                f"patch is corrupt: bytes {cursor}-{start} of its data area belong to no stream (a damaged or "
                "crafted file); fetch it again"
            )
        cursor = max(cursor, end)
    if len(data) > cursor:
        raise CorruptPatchError(
            f"patch file has {len(data) - cursor:,} extra bytes past the end of its container: a truncated or "
            "spliced upload (e.g. another object's or a stale attempt's bytes appended); refused, fetch it again "
            "or publish it again"
        )
    return meta, blobs


def read_container(data: memoryview) -> tuple[PatchHeader, dict[str, bytes | memoryview], frozenset[str]]:
    """(header, every section's coded streams, the small sections) of a patch file, or a CorruptPatchError."""
    meta, tensors = _parse_safetensors(data)
    found = meta.get(CONTAINER_KEY)
    if found != CONTAINER_FORMAT:
        raise CorruptPatchError(
            f"unsupported patch container {found!r}: this flipsync reads container {CONTAINER_FORMAT!r} only "
            "(patches of earlier development releases must be published again)"
        )
    if HEADER_TENSOR not in tensors:
        raise CorruptPatchError(f"patch lacks its header tensor {HEADER_TENSOR!r}")
    refs, packed, values, positions, small = split_tail(tensors.pop(HEADER_TENSOR))
    header = PatchHeader.from_packed(refs, _inflate(packed))
    blobs: dict[str, bytes | memoryview] = dict(_locate_sections(header, tensors, small))
    small_names = frozenset(s.name for s in header.sections if s.name not in tensors)
    if positions is not None or any(s.pos.get("codec") == GROUP or not s.n for s in header.sections):
        header, blobs = _ungroup_positions(header, blobs, positions)
    if values is not None or any(s.val.get("codec") == GROUP for s in header.sections):
        header, blobs = _ungroup_values(header, blobs, values)
    return header, blobs, small_names
