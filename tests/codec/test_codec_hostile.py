"""Hostile patch files: truncated, bit-flipped or crafted input gives a clean flipsync error, never a crash,
a hang or an unbounded allocation."""

from __future__ import annotations

import contextlib
import json
import struct

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from flipsync.codec import Patch, apply_patch, diff_views
from flipsync.codec.container import HEADER_TENSOR
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.errors import CorruptPatchError, FlipsyncError
from tests.codec.container_helpers import relayout, tail_parts, with_part, with_rows
from tests.strategies import edit, same_bits


def _valid_patch() -> tuple[dict, dict, bytes]:
    rng = np.random.default_rng(11)
    old = {
        "a": torch.randn(100_000).to(torch.bfloat16),  # its own tensor, an ordinary row
        "b": torch.randn(64, 8),
        "c": torch.randint(0, 255, (900,), dtype=torch.uint8),
    }
    new = {k: edit(rng, v, 0.05, style="ulp" if k != "c" else "bits") for k, v in old.items()}
    patch, _ = diff_views(old, new)
    return old, new, patch.to_bytes()


# grouped streams have their own hostile tests in test_codec_container
OLD, NEW, VALID = _valid_patch()


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
    """The valid patch with its header's rows changed by ``mutate(doc)``, each section a dict of its fields."""
    return with_rows(VALID, mutate, as_dicts=True)


CRAFTED = {
    "huge shape": lambda d: d["sections"][0].update(shape=[1 << 24, 1 << 24], n=1 << 47),
    "n larger than tensor": lambda d: d["sections"][0].update(n=10**9),
    "negative n": lambda d: d["sections"][0].update(n=-1),
    "unknown dtype": lambda d: d["sections"][0].update(dtype="F128"),
    "unknown codec": lambda d: d["sections"][0]["pos"].update(codec="lzma"),
    "huge rice k": lambda d: d["sections"][0]["pos"].update(codec="rice", k=10**6),
    "stream past the end": lambda d: d["sections"][0]["val"].update(bytes=10**9),
    "mixed without flags": lambda d: d["sections"][0].update(mode="mixed"),
    "a digest among the rows": lambda d: d.update(digest="xyz"),
    "sections not a list": lambda d: d.update(sections={"a": 1}),
    "an unknown field": lambda d: d.update(flipsync_patch=99),
    "deep nesting": lambda d: d.update(meta={"a": [[[[[[]]]]]]}),
    "duplicate section": lambda d: d["sections"].append(d["sections"][0]),
    "zstd bomb width": lambda d: d["sections"][0]["pos"].update(codec="zstd", width=8),
    "lengths disagree": lambda d: d["sections"][0]["pos"].update(bytes=d["sections"][0]["pos"]["bytes"] + 3),
}


ROW_SHAPE = {  # how a row is laid out
    "short row": lambda d: d["sections"][0].pop("val"),
    "long row": lambda d: d["sections"][0].update(tag={"codec": "bits"}, extra=1),
    "row not a list": lambda d: d.update(sections=[{"name": "a"}]),
}


@pytest.mark.parametrize("case", sorted(CRAFTED) + sorted(ROW_SHAPE))
def test_crafted_headers(case: str) -> None:
    data = _with_header({**CRAFTED, **ROW_SHAPE}[case])
    with pytest.raises(CorruptPatchError):
        _decode_everything(data)
    _apply_or_refuse(data)


def test_container_damage() -> None:
    """A file without its header tensor, with a truncated one, with rows that are no zstd frame or declare too
    much, or with another container format."""
    with pytest.raises(CorruptPatchError, match="lacks its header tensor"):
        _decode_everything(VALID.replace(HEADER_TENSOR.encode(), b"flipsync.headex"))
    for cut in (b"", b"\x01", b"\x05abc", tail_parts(VALID)[0][:1]):
        with pytest.raises(CorruptPatchError, match=r"truncated|cannot be decoded|fixed fields"):
            _decode_everything(relayout(VALID, {HEADER_TENSOR: cut}))
    with pytest.raises(CorruptPatchError, match="cannot be decoded"):
        _decode_everything(with_part(VALID, 1, b"not zstd"))
    bomb = zstandard.ZstdCompressor().compress(b" " * ((64 << 20) + 1))
    with pytest.raises(CorruptPatchError, match="declares"):
        _decode_everything(with_part(VALID, 1, bomb))
    for version in ("5", "3", "x"):  # same length: only the container format differs
        with pytest.raises(CorruptPatchError, match="unsupported patch container"):
            _decode_everything(VALID.replace(b'"flipsync_patch":"4"', f'"flipsync_patch":"{version}"'.encode()))


def test_not_a_patch() -> None:
    from safetensors.torch import save

    with pytest.raises(CorruptPatchError, match="not a flipsync patch"):
        Patch.from_bytes(save({"x": torch.zeros(3)}))
    with pytest.raises(CorruptPatchError, match="uint8"):
        Patch.from_bytes(save({"x": torch.zeros(3)}, metadata={"flipsync_patch": "4"}))
    with pytest.raises(CorruptPatchError, match="unsupported patch container"):
        Patch.from_bytes(save({"x": torch.zeros(3, dtype=torch.uint8)}, metadata={"flipsync_patch": "1"}))


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
