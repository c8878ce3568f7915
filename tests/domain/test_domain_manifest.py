"""The manifest: canonical JSON round trip and strict validation of everything read from a board."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flipsync.domain.manifest import Chunk, Kind, Manifest, Part, Signature, canonical_json
from flipsync.errors import BoardError, IntegrityError
from tests.strategies import PART_HASH, patch_manifest

H = PART_HASH


def as_dict(**over: Any) -> dict[str, Any]:
    d = patch_manifest().to_dict()
    d.update(over)
    return d


def test_round_trip_is_canonical() -> None:
    m = patch_manifest()
    text = m.to_json()
    assert Manifest.from_json(text) == m
    assert text == canonical_json(json.loads(text))  # sorted keys, compact
    assert list(json.loads(text)) == sorted(json.loads(text))
    assert m.total_size == 123
    assert m.edge == ("patch", 6, 7)


def test_keyframe_and_signature_round_trip() -> None:
    sig = Signature(alg="ed25519", key_id="0123456789abcdef", value="c2lnbmF0dXJl")
    m = patch_manifest(kind="keyframe", base_version=None, base_view_fp=None, signature=sig)
    assert m.kind is Kind.KEYFRAME
    back = Manifest.from_json(m.to_json())
    assert back == m and back.signature == sig
    # The signature covers everything but itself.
    assert b"signature" not in m.signing_payload()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("kind", "delta", "unknown kind"),
        ("version", "7", "version must be an integer"),
        ("version", True, "version must be an integer"),
        ("version", -1, "version must be >= 0"),
        ("target_version", 8, "must equal target_version"),
        ("base_version", 7, "must be below target_version"),
        ("base_version", None, "base_version must be an integer"),
        ("base_view_fp", "XYZ", "lowercase hex"),
        ("target_view_fp", 5, "must be a string"),
        ("served_format", "bf16 fp8", "served_format"),
        ("run", "../other", "run must be"),
        ("publisher", "", "publisher must be"),
        ("created", "yesterday", "ISO 8601"),
        ("created", "2026-01-02T03:04:05", "time zone"),
        ("parts", [], "at least one part"),
        ("parts", {"path": "x"}, "parts must be a list"),
        ("meta", {"x": [1]}, "must be a string"),
        ("schema", 2, "schema 2 is not supported"),
        ("signature", {"alg": "rsa", "key_id": "00", "value": "AA=="}, "signature algorithm"),
    ],
)
def test_invalid_fields_are_rejected(field: str, value: object, message: str) -> None:
    with pytest.raises(IntegrityError, match=message):
        Manifest.from_json(json.dumps(as_dict(**{field: value})))


def test_a_chunked_part_round_trips_and_a_plain_one_keeps_its_old_json() -> None:
    chunked = {
        "path": "a/p.0",
        "size": 10,
        "hash": H,
        "chunks": [{"path": "a/p.1", "size": 4}, {"path": "a/p.2", "size": 3}],
    }
    m = Manifest.from_json(json.dumps(as_dict(parts=[chunked, {"path": "b", "size": 1, "hash": H}])))
    assert m.parts[0].objects == (("a/p.0", 3), ("a/p.1", 4), ("a/p.2", 3))
    assert m.parts[1].objects == (("b", 1),) and "chunks" not in m.parts[1].to_dict()
    assert Manifest.from_json(m.to_json()) == m


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"path": "../v6/patch.safetensors", "size": 1, "hash": H}, "escapes"),
        ({"path": "/abs/patch", "size": 1, "hash": H}, "escapes"),
        ({"path": "a//b", "size": 1, "hash": H}, "escapes"),
        ({"path": "a/./b", "size": 1, "hash": H}, "escapes"),
        ({"path": "a\\..\\b", "size": 1, "hash": H}, "unsafe segment"),
        ({"path": "manifest.json", "size": 1, "hash": H}, "manifest.json"),
        ({"path": "p", "size": -5, "hash": H}, "size of part 'p' must be >= 0"),
        ({"path": "p", "size": 1.5, "hash": H}, "must be an integer"),
        ({"path": "p", "size": 1, "hash": "ab" * 31}, "BLAKE3"),
        ({"path": "p", "size": 1, "hash": "AB" * 32}, "BLAKE3"),
        ({"path": "p", "size": 1}, "path, size, hash and optionally chunks"),
        ({"path": "p", "size": 1, "hash": H, "extra": 1}, "path, size, hash and optionally chunks"),
        ({"path": "p", "size": 9, "hash": H, "chunks": []}, "non-empty list"),
        ({"path": "p", "size": 9, "hash": H, "chunks": {"path": "c", "size": 1}}, "non-empty list"),
        ({"path": "p", "size": 9, "hash": H, "chunks": [{"path": "c"}]}, "exactly the keys path and size"),
        ({"path": "p", "size": 9, "hash": H, "chunks": [{"path": "../c", "size": 1}]}, "escapes"),
        ({"path": "p", "size": 9, "hash": H, "chunks": [{"path": "c", "size": 0}]}, "must be >= 1"),
        ({"path": "p", "size": 9, "hash": H, "chunks": [{"path": "c", "size": 9}]}, "none of its 9 bytes"),
    ],
)
def test_bad_parts_are_rejected(part: dict[str, Any], message: str) -> None:
    with pytest.raises(IntegrityError, match=message):
        Manifest.from_json(json.dumps(as_dict(parts=[part])))


def test_duplicate_parts_unknown_and_missing_fields() -> None:
    p = {"path": "p", "size": 1, "hash": H}
    with pytest.raises(IntegrityError, match="appears twice"):
        Manifest.from_json(json.dumps(as_dict(parts=[p, p])))
    chunked = {"path": "q", "size": 9, "hash": H, "chunks": [{"path": "p", "size": 1}]}
    with pytest.raises(IntegrityError, match="'p' appears twice"):
        Manifest.from_json(json.dumps(as_dict(parts=[p, chunked])))
    with pytest.raises(IntegrityError, match="unknown fields"):
        Manifest.from_json(json.dumps(as_dict(surprise=1)))
    d = as_dict()
    del d["served_format"]
    with pytest.raises(IntegrityError, match="missing fields"):
        Manifest.from_json(json.dumps(d))


@pytest.mark.parametrize("text", [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"version": NaN}'])
def test_garbage_is_an_integrity_error(text: bytes) -> None:
    with pytest.raises(IntegrityError, match="invalid manifest"):
        Manifest.from_json(text)


def test_keyframe_may_not_have_a_base() -> None:
    with pytest.raises(BoardError, match="keyframe has no base"):
        patch_manifest(kind=Kind.KEYFRAME)


_segment = st.from_regex(r"[a-z0-9_][a-z0-9._-]{0,10}", fullmatch=True).filter(lambda s: s not in (".", ".."))


@settings(max_examples=60, deadline=None)
@given(
    version=st.integers(1, 10**9),
    sizes=st.lists(st.integers(0, 2**40), min_size=1, max_size=5),
    chunks=st.lists(st.integers(1, 2**30), max_size=4),
    seg=_segment,
    step=st.integers(-(2**31), 2**31),
)
def test_round_trip_property(version: int, sizes: list[int], chunks: list[int], seg: str, step: int) -> None:
    streamed = tuple(Chunk(f"{seg}/p0.{k:05d}", c) for k, c in enumerate(chunks, 1))
    parts = tuple(
        Part(f"{seg}/p{i}", s + (sum(chunks) + 1 if i == 0 and chunks else 0), f"{i:064x}", streamed if i == 0 else ())
        for i, s in enumerate(sizes)
    )
    m = patch_manifest(
        version=version, target_version=version, base_version=version - 1, parts=parts, meta={"step": step, "note": seg}
    )
    assert Manifest.from_json(m.to_json()) == m
    assert Manifest.from_json(m.to_json()).to_json() == m.to_json()
