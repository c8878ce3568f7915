"""Hostile patch files: truncated, bit-flipped or crafted input gives a clean flipsync error, never a crash,
a hang or an unbounded allocation."""

from __future__ import annotations

import base64
import contextlib
import json
import struct

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from flipsync.codec import FingerprintTable, Patch, apply_patch, diff_views
from flipsync.errors import CorruptPatchError, FlipsyncError
from tests.strategies import edit, same_bits


def _valid_patch() -> tuple[dict, dict, bytes]:
    rng = np.random.default_rng(11)
    old = {
        "a": torch.randn(4000).to(torch.bfloat16),
        "b": torch.randn(64, 8),
        "c": torch.randint(0, 255, (900,), dtype=torch.uint8),
    }
    new = {k: edit(rng, v, 0.05, style="ulp" if k != "c" else "bits") for k, v in old.items()}
    patch, _ = diff_views(old, new)
    return old, new, patch.to_bytes()


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
    """Re-serialise the valid patch with its flipsync header JSON changed by ``mutate(doc)``."""
    hlen = struct.unpack_from("<Q", VALID)[0]
    outer = json.loads(VALID[8 : 8 + hlen])
    packed = base64.b64decode(outer["__metadata__"]["flipsync_header"])
    doc = json.loads(zstandard.ZstdDecompressor().decompress(packed))
    mutate(doc)  # type: ignore[operator]
    packed = zstandard.ZstdCompressor().compress(json.dumps(doc).encode())
    outer["__metadata__"]["flipsync_header"] = base64.b64encode(packed).decode()
    head = json.dumps(outer).encode()
    return struct.pack("<Q", len(head)) + head + VALID[8 + hlen :]


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
    "sections not a list": lambda d: d.update(sections={"a": 1}),
    "wrong format version": lambda d: d.update(flipsync_patch=99),
    "deep nesting": lambda d: d.update(meta={"a": [[[[[[]]]]]]}),
    "duplicate section": lambda d: d["sections"].append(d["sections"][0]),
    "zstd bomb width": lambda d: d["sections"][0]["pos"].update(codec="zstd", width=8),
    "lengths disagree": lambda d: d["sections"][-1]["pos"].update(bytes=d["sections"][-1]["pos"]["bytes"] + 3),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_headers(case: str) -> None:
    data = _with_header(CRAFTED[case])
    with pytest.raises(CorruptPatchError):
        _decode_everything(data)
    _apply_or_refuse(data)


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
