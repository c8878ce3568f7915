"""The request-version protocol a sidecar's proxy and the gateway both speak: the headers and the body field
that ask for a version (``min_version`` / ``exact_version``), the headers a response is stamped with, and a POST
body read as JSON whatever its Content-Type, charset and Content-Encoding say, so that a version constraint in it
is never skipped (bodies that cannot be read so are refused: 415 when they do not claim to be JSON, 400 when they
do). Pure: bytes and header values in, values or `BadRequest` out. See docs/sidecar.md#the-proxy."""

from __future__ import annotations

import codecs
import json
import zlib
from dataclasses import dataclass
from typing import Any

from flipsync.errors import FlipsyncError

H_MIN = "x-flipsync-min-version"
H_EXACT = "x-flipsync-exact-version"
H_VERSION = "X-Flipsync-Weight-Version"
H_START = "X-Flipsync-Weight-Version-Start"
H_END = "X-Flipsync-Weight-Version-End"
BODY_FIELD = "weight_version"

# Content-Encodings decoded here (RFC 9110 8.4.1); any other is refused with 415.
ENCODINGS = ("identity", "gzip", "x-gzip", "deflate")
_UTF8 = frozenset({"utf-8", "utf8"})
# RFC 8259 8.1 allows only UTF-8 on the wire, RFC 4627 3 also UTF-16/32; these BOMs say which.
_BOMS = (codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF8, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)
_TOO_DEEP = "the JSON body nests arrays/objects too deeply to parse (about 1000 levels or more); send a flatter body"


class BadRequest(FlipsyncError):
    """A request the proxy or the gateway refuses before forwarding it: ``status`` (400, 413, 415) says why."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class JsonBody:
    """A body read as JSON: ``doc``, and whether the raw bytes are already what every engine reads the same way
    (UTF-8 without a BOM, a JSON Content-Type, not compressed); when not, forward ``encode(doc)`` instead."""

    doc: Any
    as_sent: bool


def media_type(content_type: str | None) -> tuple[str, dict[str, str]]:
    """``type/subtype`` (lower case) and the parameters of a Content-Type header ("" when there is none)."""
    if not content_type:
        return "", {}
    kind, *params = content_type.split(";")
    out: dict[str, str] = {}
    for p in params:
        key, sep, value = p.partition("=")
        if sep:
            out[key.strip().lower()] = value.strip().strip('"')
    return kind.strip().lower(), out


def claims_json(kind: str) -> bool:
    """``application/json``, ``text/json`` and ``*/*+json`` (RFC 6839) claim JSON; no Content-Type counts too
    (JSON is the only body the OpenAI routes take)."""
    return kind == "" or kind.endswith(("/json", "+json"))


def encode(doc: Any) -> bytes:
    """What is forwarded when the body had to be decoded: plain UTF-8 (ASCII) JSON."""
    try:
        return json.dumps(doc).encode()
    except RecursionError:  # json.dumps recurses per bracket, as json.loads does
        raise BadRequest(_TOO_DEEP) from None


def _inflate(data: bytes, wbits: int, max_bytes: int, name: str) -> bytes:
    out: list[bytes] = []
    size = 0
    while data:
        d = zlib.decompressobj(wbits)
        chunk = d.decompress(data, max_bytes + 1 - size)
        size += len(chunk)
        out.append(chunk)
        if size > max_bytes:
            raise BadRequest(f"the body exceeds {max_bytes} bytes once {name}-decoded", 413)
        if not d.eof:
            raise BadRequest(f"the {name} body is truncated or corrupt (Content-Encoding: {name})")
        data = d.unused_data if wbits > 16 else b""  # gzip may hold several members (RFC 1952 2.2)
    return b"".join(out)


def decode_content(raw: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """``raw`` with its Content-Encoding (a list, applied in order) undone: gzip and deflate, else 415."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",") if c.strip()]
    for coding in reversed(codings):
        try:
            if coding in ("gzip", "x-gzip"):
                raw = _inflate(raw, 16 + zlib.MAX_WBITS, max_bytes, "gzip")
            elif coding == "deflate":  # RFC 9110 says zlib-wrapped; some clients send raw deflate
                try:
                    raw = _inflate(raw, zlib.MAX_WBITS, max_bytes, "deflate")
                except zlib.error:
                    raw = _inflate(raw, -zlib.MAX_WBITS, max_bytes, "deflate")
            elif coding != "identity":
                raise BadRequest(
                    f"Content-Encoding {coding!r} is not supported here; send the body uncompressed, gzip or deflate",
                    415,
                )
        except zlib.error as e:
            raise BadRequest(f"the body is not valid {coding} data (Content-Encoding: {coding}): {e}") from None
    return raw


def _text(data: bytes, charset: str | None) -> tuple[str, bool]:
    """The body as text, and whether it was plain UTF-8 without a BOM. A BOM wins over a ``charset``, which
    wins over RFC 4627's detection by the pattern of zero bytes."""
    if data.startswith(_BOMS) or charset is None:
        name = json.detect_encoding(data)
    else:
        try:
            name = codecs.lookup(charset).name
        except LookupError:
            raise BadRequest(f"the charset {charset!r} of the body is unknown; send UTF-8 JSON", 415) from None
    text = data.decode(name)
    return text.removeprefix("\ufeff"), name.replace("_", "-") in _UTF8 and not data.startswith(codecs.BOM_UTF8)


def read_json(raw: bytes, content_type: str | None, content_encoding: str | None, max_bytes: int) -> JsonBody | None:
    """The body as JSON (None for an empty body), or BadRequest: 413 too large once decoded, 415 when it cannot be
    read as JSON and its Content-Type is not JSON (or its encoding or charset is unsupported), 400 when it claims
    JSON and is malformed. The message names the Content-Type, so a client sees which."""
    if not raw:
        return None
    kind, params = media_type(content_type)
    data = decode_content(raw, content_encoding, max_bytes)
    said = f"Content-Type: {content_type}" if content_type else "no Content-Type"
    try:
        text, utf8 = _text(data, params.get("charset"))
        doc = json.loads(text)
    except (ValueError, UnicodeError) as e:  # UnicodeDecodeError and JSONDecodeError are both ValueErrors
        if claims_json(kind):
            raise BadRequest(f"the body is not valid JSON ({said}): {e}") from None
        raise BadRequest(
            f"the body is not JSON ({said}): {e}; send a JSON object with Content-Type: application/json", 415
        ) from None
    except RecursionError:  # json.loads recurses per bracket; no engine reads this either
        raise BadRequest(_TOO_DEEP) from None
    identity = all(c.strip().lower() in ("", "identity") for c in (content_encoding or "").split(","))
    return JsonBody(doc, as_sent=utf8 and identity and claims_json(kind) and kind != "")


@dataclass(frozen=True)
class VersionConstraint:
    min_version: int | None = None
    exact_version: int | None = None

    @property
    def pinned(self) -> bool:
        return self.exact_version is not None

    def satisfied_by(self, version: int) -> bool:
        return self.exact_version in (None, version) and (self.min_version is None or version >= self.min_version)

    def describe(self) -> str:
        if self.exact_version is not None:
            return f"exactly v{self.exact_version}"
        return f"at least v{self.min_version}"


def _version_value(v: Any, where: str) -> int:
    if isinstance(v, str) and v.strip().isascii() and v.strip().isdigit():
        v = int(v.strip())
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise BadRequest(f"{where} must be a non-negative integer version")
    return v


def parse_constraint(field: Any, headers: Any) -> VersionConstraint:
    """The request's version constraint from the body field and/or the headers (the stricter wins)."""
    mins: list[int] = []
    exacts: list[int] = []
    if field is not None:
        if not isinstance(field, dict) or not set(field) <= {"min_version", "exact_version"}:
            raise BadRequest(f'{BODY_FIELD} must be {{"min_version": N}} or {{"exact_version": N}}')
        if field.get("min_version") is not None:
            mins.append(_version_value(field["min_version"], f"{BODY_FIELD}.min_version"))
        if field.get("exact_version") is not None:
            exacts.append(_version_value(field["exact_version"], f"{BODY_FIELD}.exact_version"))
    if headers.get(H_MIN) is not None:
        mins.append(_version_value(headers[H_MIN], H_MIN))
    if headers.get(H_EXACT) is not None:
        exacts.append(_version_value(headers[H_EXACT], H_EXACT))
    if len(set(exacts)) > 1:
        raise BadRequest(f"conflicting exact versions {sorted(set(exacts))}")
    return VersionConstraint(max(mins) if mins else None, exacts[0] if exacts else None)
