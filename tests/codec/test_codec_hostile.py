"""Hostile patch files: truncated, bit-flipped or crafted input gives a clean flipsync error, never a crash,
a hang or an unbounded allocation."""

from __future__ import annotations

import base64
import contextlib
import json
import struct

import numpy as np
import pytest
import safetensors.numpy
import torch
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from flipsync.codec import FingerprintTable, Patch, apply_patch, diff_views
from flipsync.codec.patch import HEADER_TENSOR, SMALL_SECTIONS, pack_tail, split_tail
from flipsync.domain.headers import COMPACT_ROW
from flipsync.errors import CorruptPatchError, FlipsyncError
from tests.strategies import edit, same_bits


def _valid_patch() -> tuple[dict, dict, bytes, bytes]:
    rng = np.random.default_rng(11)
    old = {
        "a": torch.randn(4000).to(torch.bfloat16),
        "b": torch.randn(64, 8),
        "c": torch.randint(0, 255, (900,), dtype=torch.uint8),
    }
    new = {k: edit(rng, v, 0.05, style="ulp" if k != "c" else "bits") for k, v in old.items()}
    patch, _ = diff_views(old, new)
    return old, new, patch.to_bytes(container="3"), patch.to_bytes(legacy=True)


# VALID: a version 3 file (still read; version 4's layout has its own hostile tests in test_codec_container_v4);
# LEGACY: the same patch in a version 1 container
OLD, NEW, VALID, LEGACY = _valid_patch()


def _decode_everything(data: bytes) -> None:
    patch = Patch.from_bytes(data)
    for change in patch.changes():
        assert change.positions.size == change.values.size


def _apply_or_refuse(data: bytes) -> None:
    """Any outcome but a crash: a clean error leaves the tensors as they were; success means exact."""
    work = {k: v.clone() for k, v in OLD.items()}
    try:
        apply_patch(work, Patch.from_bytes(data), FingerprintTable.of(work))
    except FlipsyncError:
        assert all(same_bits(work[k], OLD[k]) for k in OLD)
        return
    assert all(same_bits(work[k], NEW[k]) for k in NEW)


@given(st.integers(0, len(VALID) - 1))
def test_truncated_files(cut: int) -> None:
    with pytest.raises(FlipsyncError):
        _decode_everything(VALID[:cut])


@given(st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(1, 255)), min_size=1, max_size=8))
def test_bit_flips(flips: list[tuple[int, int]]) -> None:
    data = bytearray(VALID)
    for at, mask in flips:
        data[at] ^= mask
    with contextlib.suppress(FlipsyncError):
        _decode_everything(bytes(data))
    _apply_or_refuse(bytes(data))


@given(st.binary(max_size=2000))
def test_random_bytes(data: bytes) -> None:
    with pytest.raises(FlipsyncError):
        _decode_everything(data)


def _with_header(mutate: object) -> bytes:
    """Re-serialise the valid patch (version 1 container) with its header JSON changed by ``mutate(doc)``."""
    hlen = struct.unpack_from("<Q", LEGACY)[0]
    outer = json.loads(LEGACY[8 : 8 + hlen])
    packed = base64.b64decode(outer["__metadata__"]["flipsync_header"])
    doc = json.loads(zstandard.ZstdDecompressor().decompress(packed))
    mutate(doc)  # type: ignore[operator]
    packed = zstandard.ZstdCompressor().compress(json.dumps(doc).encode())
    outer["__metadata__"]["flipsync_header"] = base64.b64encode(packed).decode()
    head = json.dumps(outer).encode()
    return struct.pack("<Q", len(head)) + head + LEGACY[8 + hlen :]


def refused_leaving_base(data: bytes, old: dict[str, torch.Tensor]) -> None:
    """``data`` is refused as corrupt, by reading, decoding or applying it, and an apply that started leaves
    ``old`` as it was (all or nothing)."""
    with pytest.raises(CorruptPatchError):
        patch = Patch.from_bytes(data)
        list(patch.changes())
        work = {k: v.clone() for k, v in old.items()}
        try:
            apply_patch(work, patch, FingerprintTable.of(work), verify="digest")
        except CorruptPatchError:
            assert all(same_bits(work[k], old[k]) for k in old)
            raise


def relayout(data: bytes, replace: dict[str, bytes]) -> bytes:
    """The safetensors file ``data`` with some tensors' bytes replaced, every offset moved to match."""
    hlen = struct.unpack_from("<Q", data)[0]
    outer = json.loads(data[8 : 8 + hlen])
    body, cursor = [], 0
    for name, e in sorted(
        ((k, v) for k, v in outer.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"]
    ):
        a, b = e["data_offsets"]
        blob = replace.get(name, data[8 + hlen + a : 8 + hlen + b])
        e.update(shape=[len(blob)], data_offsets=[cursor, cursor + len(blob)])
        body.append(blob)
        cursor += len(blob)
    head = json.dumps(outer).encode()
    return struct.pack("<Q", len(head)) + head + b"".join(body)


def _with_compact_header(mutate: object) -> bytes:
    """The valid patch (version 3) with its compact header changed by ``mutate(doc)``, sections as objects."""
    packed, values, small = tail_parts(VALID)
    doc = json.loads(zstandard.ZstdDecompressor().decompress(packed))
    doc["sections"] = [dict(zip(COMPACT_ROW, row, strict=False)) for row in doc["sections"]]
    mutate(doc)  # type: ignore[operator]
    if isinstance(doc["sections"], list):
        doc["sections"] = [[s.get(k) for k in COMPACT_ROW if k in s] for s in doc["sections"]]
    packed = zstandard.ZstdCompressor().compress(json.dumps(doc).encode())
    return relayout(VALID, {HEADER_TENSOR: pack_tail(packed, values, small)})


def tail_parts(data: bytes) -> tuple[bytes, bytes, bytes]:
    """(compressed header, grouped values, small sections) of a version 3 file's header tensor."""
    hlen = struct.unpack_from("<Q", data)[0]
    a, b = json.loads(data[8 : 8 + hlen])[HEADER_TENSOR]["data_offsets"]
    packed, values, small = split_tail(data[8 + hlen + a : 8 + hlen + b])
    return bytes(packed), bytes(values or b""), bytes(small)


CRAFTED = {
    "huge shape": lambda d: d["sections"][0].update(shape=[1 << 24, 1 << 24], n=1 << 47),
    "n larger than tensor": lambda d: d["sections"][0].update(n=10**9),
    "negative n": lambda d: d["sections"][0].update(n=-1),
    "unknown dtype": lambda d: d["sections"][0].update(dtype="F128"),
    "unknown codec": lambda d: d["sections"][0]["pos"].update(codec="lzma"),
    "huge rice k": lambda d: d["sections"][0]["pos"].update(codec="rice", k=10**6),
    "stream past the end": lambda d: d["sections"][0]["val"].update(bytes=10**9),
    "mixed without flags": lambda d: d["sections"][0].update(mode="mixed"),
    "bad fingerprint": lambda d: d["sections"][0].update(base_fp="xyz"),
    "bad digest": lambda d: d.update(digest="xyz"),
    "sections not a list": lambda d: d.update(sections={"a": 1}),
    "wrong format version": lambda d: d.update(flipsync_patch=99),
    "deep nesting": lambda d: d.update(meta={"a": [[[[[[]]]]]]}),
    "duplicate section": lambda d: d["sections"].append(d["sections"][0]),
    "zstd bomb width": lambda d: d["sections"][0]["pos"].update(codec="zstd", width=8),
    "lengths disagree": lambda d: d["sections"][-1]["pos"].update(bytes=d["sections"][-1]["pos"]["bytes"] + 3),
}


COMPACT_ONLY = {  # fields only the compact header has, or that it lays out differently
    "short row": lambda d: d["sections"][0].pop("val"),
    "long row": lambda d: d["sections"][0].update(tag={"codec": "bits"}, extra=1),
    "row not a list": lambda d: d.update(sections=[{"name": "a"}]),
    "wrong compact version": lambda d: d.update(flipsync_patch=1),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_headers(case: str) -> None:
    data = _with_header(CRAFTED[case])
    with pytest.raises(CorruptPatchError):
        _decode_everything(data)
    _apply_or_refuse(data)


@pytest.mark.parametrize("case", sorted(set(CRAFTED) - {"bad fingerprint"} | set(COMPACT_ONLY)))
def test_crafted_compact_headers(case: str) -> None:
    """The same crafted fields in a version 3 container (which has no per-section fingerprint to corrupt)."""
    data = _with_compact_header({**CRAFTED, **COMPACT_ONLY}[case])
    with pytest.raises(CorruptPatchError):
        _decode_everything(data)
    _apply_or_refuse(data)


def test_compact_container_damage() -> None:
    """A version 3 file without its header tensor, with a truncated one, with a header that is no zstd frame or
    declares too much, with small sections outside it."""
    with pytest.raises(CorruptPatchError, match="must hold its header tensor"):
        _decode_everything(VALID.replace(HEADER_TENSOR.encode(), b"flipsync.headex"))
    with pytest.raises(CorruptPatchError, match="must hold its header tensor"):
        packed, values, small = tail_parts(VALID)
        arrays = {
            HEADER_TENSOR: np.frombuffer(pack_tail(packed, values, b""), np.uint8),
            SMALL_SECTIONS: np.frombuffer(small, np.uint8),
        }
        _decode_everything(safetensors.numpy.save(arrays, metadata={"flipsync_patch": "3"}))
    for cut in (b"", b"\x01", b"\x05\x00\x00\x00abc", pack_tail(b"abc", b"", b"")[:-1], b"\x00" * 4 + b"\x09\x00"):
        with pytest.raises(CorruptPatchError, match=r"truncated|cannot be decoded"):
            _decode_everything(relayout(VALID, {HEADER_TENSOR: cut}))
    _, values, small = tail_parts(VALID)
    with pytest.raises(CorruptPatchError, match="cannot be decoded"):
        _decode_everything(relayout(VALID, {HEADER_TENSOR: pack_tail(b"not zstd", values, small)}))
    bomb = zstandard.ZstdCompressor().compress(b" " * ((64 << 20) + 1))
    with pytest.raises(CorruptPatchError, match="declares"):
        _decode_everything(relayout(VALID, {HEADER_TENSOR: pack_tail(bomb, values, small)}))
    for version in ("5", "0", "x"):  # same length: only the version differs
        with pytest.raises(CorruptPatchError, match="unsupported patch container"):
            _decode_everything(VALID.replace(b'"flipsync_patch":"3"', f'"flipsync_patch":"{version}"'.encode()))


def test_legacy_and_compact_containers_hold_the_same_patch() -> None:
    legacy, compact = Patch.from_bytes(LEGACY), Patch.from_bytes(VALID)
    assert legacy.container == "1" and compact.container == "3" and len(VALID) < len(LEGACY)
    assert compact.header.digest is not None and all(s.base_fp is None for s in compact.sections)
    for a, b in zip(legacy.changes(), compact.changes(), strict=True):
        assert np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values)
    _apply_or_refuse(LEGACY)
    _apply_or_refuse(VALID)


def test_not_a_patch() -> None:
    from safetensors.torch import save

    with pytest.raises(CorruptPatchError, match="not a flipsync patch"):
        Patch.from_bytes(save({"x": torch.zeros(3)}))
    with pytest.raises(CorruptPatchError, match="uint8"):
        Patch.from_bytes(save({"x": torch.zeros(3)}, metadata={"flipsync_header": "{}"}))
    with pytest.raises(CorruptPatchError, match="cannot be decoded"):
        Patch.from_bytes(
            save({"x": torch.zeros(3, dtype=torch.uint8)}, metadata={"flipsync_patch": "1", "flipsync_header": "!!"})
        )


def _empty_patch() -> bytes:
    same = {"x": torch.zeros(8, dtype=torch.bfloat16)}
    return diff_views(same, {"x": same["x"].clone()})[0].to_bytes()


@given(st.binary(min_size=1, max_size=3000), st.sampled_from(["valid", "empty"]))
def test_bytes_past_the_end_of_the_container_are_refused(extra: bytes, which: str) -> None:
    """A file that continues past its container is a truncated or spliced upload, not a patch to apply."""
    data = VALID if which == "valid" else _empty_patch()
    Patch.from_bytes(data)  # whole: fine
    with pytest.raises(CorruptPatchError, match=f"{len(extra):,} extra bytes past the end of its container"):
        Patch.from_bytes(data + extra)


def test_a_patch_spliced_onto_another_is_refused() -> None:
    with pytest.raises(CorruptPatchError, match=f"{len(VALID):,} extra bytes"):
        Patch.from_bytes(VALID + VALID)


def test_bytes_no_stream_claims_inside_the_data_area_are_refused() -> None:
    """Every stream moved 16 bytes into the data area: the offsets still lie inside the file, yet the first 16
    bytes belong to nothing (a spliced file again)."""
    hlen = struct.unpack_from("<Q", VALID)[0]
    outer = json.loads(VALID[8 : 8 + hlen])
    for name, entry in outer.items():
        if name != "__metadata__":
            entry["data_offsets"] = [entry["data_offsets"][0] + 16, entry["data_offsets"][1] + 16]
    head = json.dumps(outer).encode()
    data = struct.pack("<Q", len(head)) + head + bytes(16) + VALID[8 + hlen :]
    with pytest.raises(CorruptPatchError, match="bytes 0-16 of its data area belong to no stream"):
        Patch.from_bytes(data)
