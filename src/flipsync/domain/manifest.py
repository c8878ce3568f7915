"""The manifest: what one board artifact says about itself, the only thing readers trust. Pure; ``from_json``
validates every field strictly (stores may be corrupted or tampered with). See docs/board.md#manifests."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Self

from flipsync.domain.headers import PatchHeader, ViewRef
from flipsync.errors import CorruptPatchError, IntegrityError

MANIFEST_SCHEMA = 1
MAX_PARTS = 100_000
MAX_PATH = 512
MAX_META_KEYS = 256
SIGNATURE_ALGORITHMS = ("ed25519",)

_HEX = re.compile(r"[0-9a-f]+")
_HASH = re.compile(r"[0-9a-f]{64}")  # BLAKE3-256, lowercase hex
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_FORMAT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
_PATH_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_B64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")


class Kind(StrEnum):
    """What an artifact holds: a full served view, or a patch between two versions."""

    KEYFRAME = "keyframe"  # the full served view at target_version (no base)
    PATCH = "patch"  # one published version: base_version -> target_version
    SPAN = "span"  # a squashed patch spanning several versions, published after the fact


def _fail(msg: str) -> IntegrityError:
    return IntegrityError(f"invalid manifest: {msg}")


def check_name(value: object, what: str, fail: Callable[[str], IntegrityError] = _fail) -> str:
    """Validate a run or publisher name: short, ASCII, safe as one path segment."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise fail(f"{what} must be 1-128 characters of [A-Za-z0-9._-] starting alphanumeric, got {value!r}")
    return value


def check_part_path(value: object) -> str:
    """A part path is relative to the manifest's folder and may not leave it."""
    if not isinstance(value, str) or not value or len(value) > MAX_PATH:
        raise _fail(f"part path must be a non-empty string of at most {MAX_PATH} characters, got {value!r}")
    for seg in value.split("/"):
        if seg in ("", ".", "..") or not _PATH_SEGMENT.fullmatch(seg):
            raise _fail(
                f"part path {value!r} escapes its version folder or has an unsafe segment {seg!r} "
                "(allowed: relative paths of [A-Za-z0-9._-] segments, no '.', '..' or empty segments)"
            )
    if value == "manifest.json":
        raise _fail("a part may not be named manifest.json")
    return value


def _int(value: object, what: str, *, minimum: int = 0) -> int:
    # bool is an int subclass in Python; a JSON true is never a valid count or version.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise _fail(f"{what} must be >= {minimum}, got {value}")
    return value


def _str(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise _fail(f"{what} must be a string, got {type(value).__name__}")
    return value


def _fp(value: object, what: str) -> str:
    s = _str(value, what)
    if not (1 <= len(s) <= 128) or not _HEX.fullmatch(s):
        raise _fail(f"{what} must be 1-128 lowercase hex characters, got {s!r}")
    return s


def check_time(value: object, what: str, fail: Callable[[str], IntegrityError] = _fail) -> str:
    """An ISO 8601 time with a time zone (a manifest's ``created``, a member record's heartbeat)."""
    if not isinstance(value, str):
        raise fail(f"{what} must be an ISO 8601 time string, got {type(value).__name__}")
    try:
        ts = parse_time(value)
    except ValueError:
        raise fail(f"{what} must be an ISO 8601 time, got {value!r}") from None
    if ts.tzinfo is None:
        raise fail(f"{what} must carry a time zone (UTC), got {value!r}")
    return value


def utc_now_iso() -> str:
    """The current time as the manifests write it: ISO 8601, UTC, microseconds, trailing Z."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(created: str) -> datetime:
    """Parse a manifest's ``created`` field (already validated) into an aware datetime."""
    return datetime.fromisoformat(created.replace("Z", "+00:00"))


@dataclass(frozen=True)
class Chunk:
    """One object holding a stretch of a part file's bytes, after the part's first object."""

    path: str
    size: int


@dataclass(frozen=True)
class Part:
    """One file of an artifact, relative to the artifact's folder. A file streamed out while it was written (a
    trainer rank's patch part) is several objects: ``path`` holds its first bytes, ``chunks`` the rest in order;
    ``size`` and ``hash`` are the whole file's."""

    path: str
    size: int
    hash: str  # BLAKE3-256 of the file's bytes, lowercase hex
    chunks: tuple[Chunk, ...] = ()

    def __post_init__(self) -> None:
        check_part_path(self.path)
        _int(self.size, f"size of part {self.path!r}")
        h = _str(self.hash, f"hash of part {self.path!r}")
        if not _HASH.fullmatch(h):
            raise _fail(f"hash of part {self.path!r} must be 64 lowercase hex characters (BLAKE3), got {h!r}")
        if not isinstance(self.chunks, tuple):
            object.__setattr__(self, "chunks", tuple(self.chunks))
        for c in self.chunks:
            if not isinstance(c, Chunk):
                raise _fail(f"chunks of part {self.path!r} must be Chunk objects, got {type(c).__name__}")
            check_part_path(c.path)
            _int(c.size, f"size of chunk {c.path!r}", minimum=1)
        if len(self.chunks) > MAX_PARTS:
            raise _fail(f"part {self.path!r} has {len(self.chunks)} chunks, at most {MAX_PARTS} allowed")
        if self.chunks and sum(c.size for c in self.chunks) >= self.size:
            raise _fail(f"the chunks of part {self.path!r} leave none of its {self.size} bytes to its first object")

    @property
    def objects(self) -> tuple[tuple[str, int], ...]:
        """(path, size) of every object holding this file, in file order."""
        first = self.size - sum(c.size for c in self.chunks)
        return ((self.path, first), *((c.path, c.size) for c in self.chunks))

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path, "size": self.size, "hash": self.hash}
        if self.chunks:  # absent, not empty, so a one-object part reads as it always did (and signs the same)
            d["chunks"] = [asdict(c) for c in self.chunks]
        return d

    @classmethod
    def from_dict(cls, d: object) -> Part:
        if not isinstance(d, dict):
            raise _fail(f"each part must be an object, got {type(d).__name__}")
        if set(d) - {"chunks"} != {"path", "size", "hash"}:
            raise _fail(f"a part has the keys path, size, hash and optionally chunks; got {sorted(d)}")
        chunks = d.get("chunks", [])
        if not isinstance(chunks, list) or (not chunks and "chunks" in d):
            raise _fail(f"chunks of part {d['path']!r} must be a non-empty list")
        return cls(path=d["path"], size=d["size"], hash=d["hash"], chunks=tuple(_chunk(c) for c in chunks))


def _chunk(d: object) -> Chunk:
    if not isinstance(d, dict) or set(d) != {"path", "size"}:
        raise _fail(f"a chunk is an object with exactly the keys path and size, got {d!r}")
    return Chunk(path=d["path"], size=d["size"])


@dataclass(frozen=True)
class Signature:
    """A detached signature over the manifest's canonical JSON without its ``signature`` field."""

    alg: str
    key_id: str
    value: str  # base64

    def __post_init__(self) -> None:
        if self.alg not in SIGNATURE_ALGORITHMS:
            raise _fail(f"signature algorithm must be one of {SIGNATURE_ALGORITHMS}, got {self.alg!r}")
        _fp(self.key_id, "signature key_id")
        v = _str(self.value, "signature value")
        if not v or len(v) > 1024 or not _B64.fullmatch(v):
            raise _fail("signature value must be base64")

    @classmethod
    def from_dict(cls, d: object) -> Signature:
        if not isinstance(d, dict) or set(d) != {"alg", "key_id", "value"}:
            raise _fail("signature must be an object with exactly the keys alg, key_id, value")
        return cls(alg=_str(d["alg"], "signature alg"), key_id=d["key_id"], value=d["value"])


def _meta(value: object) -> dict[str, str | int | float | bool]:
    if not isinstance(value, dict):
        raise _fail(f"meta must be an object, got {type(value).__name__}")
    if len(value) > MAX_META_KEYS:
        raise _fail(f"meta has {len(value)} keys, at most {MAX_META_KEYS} allowed")
    for k, v in value.items():
        if not isinstance(k, str) or not k or len(k) > 128:
            raise _fail(f"meta keys must be non-empty strings of at most 128 characters, got {k!r}")
        if not isinstance(v, str | int | float | bool) or (isinstance(v, str) and len(v) > 4096):
            raise _fail(f"meta[{k!r}] must be a string (<= 4096 chars), number or boolean, got {v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise _fail(f"meta[{k!r}] must be finite, got {v!r}")
    return dict(value)


class SignedRecord:
    """What a manifest and a member record share: canonical JSON, the bytes a signature covers, a signed copy."""

    signature: Signature | None
    _json_keys: tuple[str, ...]  # in order, the signature last

    def to_dict(self, *, with_signature: bool = True) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self._json_keys[:-1]}
        if with_signature:
            d["signature"] = asdict(self.signature) if self.signature is not None else None
        return d

    def to_json(self) -> str:
        """Canonical JSON: sorted keys, no insignificant whitespace, ASCII only."""
        return canonical_json(self.to_dict())

    def signing_payload(self) -> bytes:
        """The bytes a signature covers: the canonical JSON of everything but the signature."""
        return canonical_json(self.to_dict(with_signature=False)).encode("ascii")

    def with_signature(self, signature: Signature | None) -> Self:
        return replace(self, signature=signature)  # type: ignore[type-var]  # subclasses are dataclasses


def load_json(
    text: str | bytes, fail: Callable[[str], IntegrityError], keys: Collection[str], optional: Collection[str]
) -> dict[str, Any]:
    """Parse a record's JSON strictly (no NaN or Infinity): an object with exactly ``keys``, less any of
    ``optional``; ``fail`` makes the error that names the record."""
    try:
        d = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # the last: nesting deeper than Python's stack
        raise fail(f"not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise fail(f"top level must be an object, got {type(d).__name__}")
    unknown = set(d) - set(keys)
    if unknown:
        raise fail(f"unknown fields {sorted(unknown)}")
    missing = set(keys) - set(optional) - set(d)
    if missing:
        raise fail(f"missing fields {sorted(missing)}")
    return d


@dataclass(frozen=True)
class Manifest(SignedRecord):
    """What one artifact on the board holds. ``version`` (its folder) always equals ``target_version``;
    keyframes have no base, patches and spans go from ``base_version`` up to ``target_version``."""

    run: str
    version: int
    kind: Kind
    base_version: int | None
    target_version: int
    base_view_fp: str | None
    target_view_fp: str
    served_format: str
    parts: tuple[Part, ...]
    created: str
    publisher: str
    meta: Mapping[str, str | int | float | bool] = field(default_factory=dict)
    signature: Signature | None = None
    schema: int = MANIFEST_SCHEMA

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _kind(self.kind))
        if not isinstance(self.parts, tuple):
            object.__setattr__(self, "parts", tuple(self.parts))
        if _int(self.schema, "schema") != MANIFEST_SCHEMA:
            raise _fail(
                f"schema {self.schema!r} is not supported (this flipsync reads schema {MANIFEST_SCHEMA}); "
                "upgrade flipsync"
            )
        object.__setattr__(self, "meta", _meta(dict(self.meta) if isinstance(self.meta, Mapping) else self.meta))
        check_name(self.run, "run")
        check_name(self.publisher, "publisher")
        _int(self.version, "version")
        _int(self.target_version, "target_version")
        if self.version != self.target_version:
            raise _fail(f"version {self.version} must equal target_version {self.target_version}")
        _fp(self.target_view_fp, "target_view_fp")
        fmt = _str(self.served_format, "served_format")
        if not _FORMAT.fullmatch(fmt):
            raise _fail(f"served_format must be 1-64 characters of [A-Za-z0-9._+-], got {fmt!r}")
        check_time(self.created, "created")
        if self.kind is Kind.KEYFRAME:
            if self.base_version is not None or self.base_view_fp is not None:
                raise _fail("a keyframe has no base: base_version and base_view_fp must be null")
        else:
            base = _int(self.base_version, "base_version")
            if base >= self.target_version:
                raise _fail(f"base_version {base} must be below target_version {self.target_version}")
            _fp(self.base_view_fp, "base_view_fp")
        if not self.parts:
            raise _fail("an artifact has at least one part")
        if len(self.parts) > MAX_PARTS:
            raise _fail(f"{len(self.parts)} parts, at most {MAX_PARTS} allowed")
        seen: set[str] = set()
        for p in self.parts:
            if not isinstance(p, Part):
                raise _fail(f"parts must be Part objects, got {type(p).__name__}")
            for path, _ in p.objects:
                if path in seen:
                    raise _fail(f"part path {path!r} appears twice")
                seen.add(path)
        if self.signature is not None and not isinstance(self.signature, Signature):
            raise _fail("signature must be a Signature or null")

    # -- derived ------------------------------------------------------------------------------------

    @property
    def total_size(self) -> int:
        """Bytes a reader downloads to fetch every part."""
        return sum(p.size for p in self.parts)

    @property
    def created_at(self) -> datetime:
        return parse_time(self.created)

    @property
    def edge(self) -> tuple[str, int | None, int]:
        """(kind, base, target): the identity of the transition, used by the catch-up planner."""
        return (self.kind.value, self.base_version, self.target_version)

    @property
    def where(self) -> str:
        """The transition, for messages: ``patch v3->v4``."""
        return f"{self.kind.value} v{self.base_version}->v{self.target_version}"

    @property
    def target(self) -> ViewRef:
        return ViewRef(self.target_view_fp, self.target_version)

    def check_patch(self, header: PatchHeader) -> None:
        """The patch joined from this artifact's parts must go from its base view to its target view, in its
        format: a patch that disagrees with its (signed) manifest is refused before an engine sees it."""
        if header.base.view != self.base_view_fp or header.target.view != self.target_view_fp:
            raise CorruptPatchError(
                f"{self.where}: the patch goes from view {header.base.view[:16]} to {header.target.view[:16]}, "
                f"but its manifest says {str(self.base_view_fp)[:16]} to {self.target_view_fp[:16]}"
            )
        if header.served_format is not None and header.served_format != self.served_format:
            raise CorruptPatchError(
                f"{self.where}: the patch is {header.served_format}, its manifest says {self.served_format}"
            )

    # -- JSON -----------------------------------------------------------------------------------------

    def to_dict(self, *, with_signature: bool = True) -> dict[str, Any]:
        d = super().to_dict(with_signature=with_signature)
        return d | {"kind": self.kind.value, "parts": [p.to_dict() for p in self.parts], "meta": dict(self.meta)}

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """Parse and validate; every problem raises IntegrityError naming the field."""
        d = load_json(text, _fail, _FIELDS, optional=("signature", "meta"))
        parts = d.pop("parts")
        if not isinstance(parts, list):
            raise _fail(f"parts must be a list, got {type(parts).__name__}")
        if len(parts) > MAX_PARTS:
            raise _fail(f"{len(parts)} parts, at most {MAX_PARTS} allowed")
        sig = d.pop("signature", None)
        signature = None if sig is None else Signature.from_dict(sig)
        return cls(**d, parts=tuple(Part.from_dict(p) for p in parts), signature=signature)


# The JSON keys in the order ``to_dict`` writes them: the schema, then the fields as declared (the signature last).
_FIELDS = ("schema", *(f.name for f in fields(Manifest) if f.name != "schema"))
Manifest._json_keys = _FIELDS


def _kind(value: object) -> Kind:
    try:
        return Kind(value)  # type: ignore[arg-type]  # any non-member (str or not) raises ValueError
    except ValueError:
        raise _fail(f"unknown kind {value!r} (expected one of {[k.value for k in Kind]})") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
