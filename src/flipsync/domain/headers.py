"""The vocabulary of a patch: what it says about itself, independent of how its bytes are stored. Pure;
``from_packed`` validates every field (headers arrive over the network). See docs/codec.md ("The patch file")."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from flipsync.errors import CorruptPatchError

# One section's fields, in the order of its header row. A stream whose params are only its codec id is written
# as that id, and ``n`` may be null where the container holds it elsewhere (0 here until the container fills it).
ROW = ("name", "dtype", "shape", "n", "mode", "pos", "val", "tag")
MAX_SECTIONS = 1 << 20
MAX_DIMS = 8
MAX_NAME = 1024
ValueMode = Literal["step", "raw", "mixed"]
VALUE_MODES: tuple[str, ...] = ("step", "raw", "mixed")
DTYPE_NAMES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "I64", "I32", "I16", "I8", "U8", "BOOL")


@dataclass(frozen=True)
class ViewRef:
    """One end of a patch: the board version (if any) and the view fingerprint (hex)."""

    view: str
    version: int | None = None


@dataclass(frozen=True)
class SectionHeader:
    """One changed tensor; ``mode`` (step / raw / mixed): docs/codec.md. ``pos`` / ``val`` / ``tag``: each stream's
    codec id and parameters, its length in ``bytes``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    n: int
    mode: ValueMode
    pos: dict[str, Any]
    val: dict[str, Any]
    tag: dict[str, Any] | None = None  # mixed mode: codec of the per-value kind flags (0 step, 1 raw)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class PatchHeader:
    base: ViewRef
    target: ViewRef
    sections: tuple[SectionHeader, ...]
    served_format: str | None = None
    meta: dict[str, str] = field(default_factory=dict)
    # The changed tensors' target content digests, combined (codec.fingerprint.combine_digests); None where the
    # encoder did not hash them (a shard of a tensor, a squash).
    digest: str | None = None

    @property
    def n_changed(self) -> int:
        return sum(s.n for s in self.sections)

    @property
    def idempotent(self) -> bool:
        """True when every value is a raw overwrite, so applying twice is harmless."""
        return all(s.mode == "raw" for s in self.sections)

    def refs_bytes(self) -> bytes:
        """The fixed fields in binary (hex would cost twice the bytes and compresses poorly): a flags byte, the
        view fingerprints and digest as raw bytes after their length in hex digits, the versions (LEB128) if any."""
        present = (self.base.version is not None, self.target.version is not None, self.digest is not None)
        out = bytearray([sum(1 << i for i, p in enumerate(present) if p)])
        for text in (self.base.view, self.target.view, *([self.digest] if self.digest is not None else [])):
            out += bytes([len(text)]) + bytes.fromhex(text + "0" * (len(text) % 2))
        for version in (self.base.version, self.target.version):
            if version is not None:
                out += varint(version)
        return bytes(out)

    def to_packed(self) -> str:
        """The rest as JSON: served format, meta and one row per section (params that are only a codec id as
        that id; ``n`` null where it is 0, the container derives it)."""
        doc: dict[str, Any] = {"sections": [_packed_row(s) for s in self.sections]}
        if self.served_format is not None:
            doc["served_format"] = self.served_format
        if self.meta:
            doc["meta"] = self.meta
        return json.dumps(doc, separators=(",", ":"))

    @staticmethod
    def from_packed(refs: bytes | memoryview, text: str) -> PatchHeader:
        """A header from its fixed fields (``refs_bytes``) and rows (``to_packed``), every field validated."""
        try:
            doc = json.loads(text)
        except (json.JSONDecodeError, RecursionError, UnicodeDecodeError) as e:
            raise CorruptPatchError(f"patch header is not valid JSON: {e}") from None
        doc = _obj(doc, "the header")
        if {"base", "target", "digest"} & doc.keys():
            raise _fail("a header holds its ends and digest in binary, not in its rows")
        base, target, digest = _refs(bytes(refs))
        if doc.keys() - {"sections", "served_format", "meta"}:
            raise _fail(f"unknown fields {sorted(doc.keys() - {'sections', 'served_format', 'meta'})}")
        sections_v = doc.get("sections")
        if not isinstance(sections_v, list) or len(sections_v) > MAX_SECTIONS:
            raise _fail("sections must be a list")
        sections = tuple(_section(s, i) for i, s in enumerate(sections_v))
        names = [s.name for s in sections]
        if len(set(names)) != len(names):
            raise _fail("a tensor appears in more than one section")
        meta = _obj(doc.get("meta", {}), "meta")
        if not all(isinstance(k, str) and isinstance(x, str) for k, x in meta.items()):
            raise _fail("meta must map strings to strings")
        served_format = _str(doc.get("served_format"), "served_format", optional=True)
        return PatchHeader(base, target, sections, served_format, meta, digest)

    def describe(self) -> dict[str, Any]:
        """The header as one JSON-able document, for people (``flipsync inspect --header``)."""
        doc = asdict(self)
        doc["sections"] = [{k: v for k, v in s.items() if v is not None} for s in doc["sections"]]
        return doc


def varint(value: int) -> bytes:
    """An unsigned integer as LEB128: seven bits a byte, low first, the high bit set on all but the last."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def read_varint(buf: bytes | memoryview, at: int, what: str) -> tuple[int, int]:
    """(value, offset after it) of a LEB128 integer of at most 9 bytes (63 bits) at ``buf[at]``; the shortest
    form only, so that every value has one encoding."""
    value = 0
    for i in range(9):
        if at + i >= len(buf):
            raise _fail(f"{what} is truncated")
        byte = buf[at + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if byte == 0 and i:
                raise _fail(f"{what} is not in its shortest form")
            return value, at + i + 1
    raise _fail(f"{what} is longer than 9 bytes")


def _bare(params: dict[str, Any] | None) -> Any:
    return params["codec"] if params is not None and params.keys() == {"codec"} else params


def _packed_row(s: SectionHeader) -> list[Any]:
    row = [s.name, s.dtype, list(s.shape), s.n or None, s.mode, _bare(s.pos), _bare(s.val)]
    return row + ([_bare(s.tag)] if s.tag is not None else [])


def _refs(buf: bytes) -> tuple[ViewRef, ViewRef, str | None]:
    """Inverse of ``PatchHeader.refs_bytes``; every byte must be accounted for."""
    if not buf or buf[0] >> 3:
        raise _fail("its fixed fields are missing or carry unknown flags")
    flags, at, texts = buf[0], 1, []
    for _ in range(3 if flags & 4 else 2):
        digits = buf[at] if at < len(buf) else 0
        size = (digits + 1) // 2
        if not digits or at + 1 + size > len(buf):
            raise _fail("its fixed fields are truncated or hold an empty fingerprint")
        text = buf[at + 1 : at + 1 + size].hex()
        if len(text) != digits and text[-1] != "0":
            raise _fail("a fingerprint's padding digit is not 0")
        texts.append(text[:digits])
        at += 1 + size
    versions = []
    for bit in (1, 2):
        if flags & bit:
            version, at = read_varint(buf, at, "a version")
            versions.append(_int(version, "a version"))
        else:
            versions.append(None)
    if at != len(buf):
        raise _fail(f"its fixed fields hold {len(buf) - at} unexplained bytes")
    digest = texts[2] if flags & 4 else None
    if digest is not None and len(digest) % 2:  # content digests are combined as bytes
        raise _fail("its digest must be hex of whole bytes (an even number of digits)")
    return ViewRef(texts[0], versions[0]), ViewRef(texts[1], versions[1]), digest


# ----------------------------------------------------------------------------------------- validation
def _fail(what: str) -> CorruptPatchError:
    return CorruptPatchError(f"patch header: {what}")


def _obj(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _fail(f"{what} must be an object")
    return v


def _str(v: Any, what: str, *, optional: bool = False, limit: int = MAX_NAME) -> Any:
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > limit:
        raise _fail(f"{what} must be a string of at most {limit} characters")
    return v


def _int(v: Any, what: str, *, lo: int = 0, hi: int = 1 << 62) -> Any:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _fail(f"{what} must be an integer in [{lo}, {hi}]")
    return v


def _codec_params(v: Any, what: str) -> dict[str, Any]:
    if isinstance(v, str):  # a bare codec id
        v = {"codec": _str(v, what, limit=64)}
    d = _obj(v, what)
    if len(d) > 16 or not all(isinstance(k, str) and isinstance(x, str | int) for k, x in d.items()):
        raise _fail(f"{what} must map names to strings or integers")
    return d


def _section(v: Any, i: int) -> SectionHeader:
    what = f"section {i}"
    # a row: the fields of ROW in order, the last (tag) only for mixed sections
    if not isinstance(v, list) or not len(ROW) - 1 <= len(v) <= len(ROW):
        raise _fail(f"{what} must be a list of {len(ROW) - 1} or {len(ROW)} fields")
    d = dict(zip(ROW, v, strict=False))
    shape_v = d.get("shape")
    if not isinstance(shape_v, list) or len(shape_v) > MAX_DIMS:
        raise _fail(f"{what}.shape must be a list of at most {MAX_DIMS} sizes")
    shape = tuple(_int(x, f"{what}.shape") for x in shape_v)
    numel = math.prod(shape)
    if numel > 1 << 48:
        raise _fail(f"{what} declares {numel} elements, more than any tensor flipsync handles")
    dtype = d.get("dtype")
    if dtype not in DTYPE_NAMES:
        raise _fail(f"{what}.dtype {dtype!r} is not one of {DTYPE_NAMES}")
    mode = d.get("mode")
    if mode not in VALUE_MODES:
        raise _fail(f"{what}.mode {mode!r} is not one of {VALUE_MODES}")
    if (mode == "mixed") != (d.get("tag") is not None):
        raise _fail(f"{what} must carry kind flags (tag) exactly when its mode is mixed")
    return SectionHeader(
        name=_str(d.get("name"), f"{what}.name"),
        dtype=dtype,
        shape=shape,
        n=0 if d.get("n") is None else _int(d.get("n"), f"{what}.n", lo=1, hi=max(1, numel)),
        mode=mode,
        pos=_codec_params(d.get("pos"), f"{what}.pos"),
        val=_codec_params(d.get("val"), f"{what}.val"),
        tag=_codec_params(d["tag"], f"{what}.tag") if d.get("tag") is not None else None,
    )
