"""Container version 3 (still read, and written back): fixed cost per version. The compact header, the grouped
value steps of small sections, and what a replica can still refuse without per-section fingerprints; hostile
variants fail cleanly."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flipsync.codec import FingerprintTable, Patch, apply_patch, diff_views, overhead_bytes, squash
from flipsync.codec.patch import GROUP, HEADER_TENSOR, pack_tail
from flipsync.errors import CorruptPatchError, FlipsyncError
from tests.codec.test_codec_hostile import refused_leaving_base, relayout, tail_parts
from tests.fuzz.seeds import grouped_case
from tests.strategies import same_bits, view_pairs

OLD, NEW, PATCH = grouped_case()
DATA = PATCH.to_bytes(container="3")


def _tensors(data: bytes) -> tuple[dict, int]:
    hlen = struct.unpack_from("<Q", data)[0]
    return json.loads(data[8 : 8 + hlen]), 8 + hlen


def _apply(old: dict, data: bytes) -> dict:
    work = {k: v.clone() for k, v in old.items()}
    apply_patch(work, Patch.from_bytes(data), FingerprintTable.of(work), verify="digest")
    return work


def test_small_step_sections_share_one_value_stream() -> None:
    assert tail_parts(DATA)[1]  # grouped values
    assert list(_tensors(DATA)[0]) == ["__metadata__", HEADER_TENSOR]  # every section small: one table entry
    back = Patch.from_bytes(DATA)
    # read back, every section is an ordinary one again (fixed-width values), and it writes the same file
    assert all(s.val["codec"] != GROUP for s in back.sections)
    assert back.to_bytes() == DATA
    for a, b in zip(PATCH.changes(), back.changes(), strict=True):
        assert np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values)
    work = _apply(OLD, DATA)
    assert all(same_bits(work[k], NEW[k]) for k in NEW)
    legacy = PATCH.to_bytes(legacy=True)
    assert len(DATA) < 0.8 * len(legacy)
    assert overhead_bytes(DATA) < 0.5 * overhead_bytes(legacy)


@settings(max_examples=30, deadline=None)
@given(view_pairs(max_tensors=6, max_numel=2000), st.booleans())
def test_any_patch_round_trips_through_the_compact_container(pair: tuple[dict, dict], raw: bool) -> None:
    old, new = pair
    patch, _ = diff_views(old, new, mode="raw" if raw else "step")
    data = patch.to_bytes(container="3")
    back = Patch.from_bytes(data)
    assert back.container == "3" and back.to_bytes() == data
    work = _apply(old, data)
    assert all(same_bits(work[k], new[k]) for k in new)
    # the squash of a compact patch with its inverse steps, read from bytes, needs no fingerprints
    undo, _ = diff_views(new, old, mode="raw" if raw else "step")
    both = squash([back, Patch.from_bytes(undo.to_bytes())])
    work = _apply(old, both.to_bytes())
    assert all(same_bits(work[k], old[k]) for k in old)


def _with_values(values: bytes) -> bytes:
    packed, _, small = tail_parts(DATA)
    return relayout(DATA, {HEADER_TENSOR: pack_tail(packed, values, small)})


def _preamble(params: object, stream: bytes = b"") -> bytes:
    text = json.dumps(params).encode()
    return struct.pack("<H", len(text)) + text + stream


def _compact_doc(data: bytes) -> dict:
    import zstandard

    return json.loads(zstandard.ZstdDecompressor().decompress(tail_parts(data)[0]))


def _with_doc(mutate: object) -> bytes:
    import zstandard

    doc = _compact_doc(DATA)
    mutate(doc)  # type: ignore[operator]
    _, values, small = tail_parts(DATA)
    packed = zstandard.ZstdCompressor().compress(json.dumps(doc).encode())
    return relayout(DATA, {HEADER_TENSOR: pack_tail(packed, values, small)})


def _first_grouped(doc: dict) -> list:
    return next(row for row in doc["sections"] if row[6] == {"codec": GROUP})


CRAFTED = {
    "values tensor truncated": lambda: _with_values(b"\x01"),
    "params past the end": lambda: _with_values(struct.pack("<H", 999) + b"{}"),
    "params not JSON": lambda: _with_values(struct.pack("<H", 3) + b"{x}"),
    "params not an object": lambda: _with_values(_preamble([1, 2])),
    "params of nested values": lambda: _with_values(_preamble({"codec": "bits", "bits": [1]})),
    "grouped again": lambda: _with_values(_preamble({"codec": GROUP})),
    "unknown codec": lambda: _with_values(_preamble({"codec": "lzma"}, b"\x00" * 64)),
    "too few values": lambda: _with_values(_preamble({"codec": "bits", "bits": 2}, b"\x00")),
    "ans bomb": lambda: _with_values(
        _preamble({"codec": "ans", "alphabet": 1, "escapes": 0, "esc_width": 1}, b"\xff" * 40)
    ),
    "no grouped values": lambda: _with_values(b""),
    "a raw section grouped": lambda: _with_doc(lambda d: _first_grouped(d).__setitem__(4, "raw")),
    "zstd positions grouped": lambda: _with_doc(lambda d: _first_grouped(d)[5].update(codec="zstd")),
    "more values than positions": lambda: _with_doc(  # as many as the tensors hold: more than 1 bit each
        lambda d: [row.__setitem__(3, int(np.prod(row[2]))) for row in d["sections"] if row[6] == {"codec": GROUP}]
    ),
    "values without grouped rows": lambda: _with_doc(
        lambda d: [row.__setitem__(6, {"codec": "bits", "bits": 8, "bytes": 0}) for row in d["sections"]]
    ),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_grouped_values_are_refused(case: str) -> None:
    refused_leaving_base(CRAFTED[case](), OLD)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(DATA) - 1), st.integers(1, 255)), min_size=1, max_size=4))
def test_bit_flips_in_a_grouped_patch(flips: list[tuple[int, int]]) -> None:
    data = bytearray(DATA)
    for at, mask in flips:
        data[at] ^= mask
    work = {k: v.clone() for k, v in OLD.items()}
    try:
        apply_patch(work, Patch.from_bytes(bytes(data)), FingerprintTable.of(work), verify="digest")
    except FlipsyncError:
        assert all(same_bits(work[k], OLD[k]) for k in OLD)
        return
    assert all(same_bits(work[k], NEW[k]) for k in NEW)


def test_grouped_values_refuse_a_wrong_base_before_any_change() -> None:
    work = {k: v.clone() for k, v in NEW.items()}
    with pytest.raises(FlipsyncError, match="applies to view"):
        apply_patch(work, Patch.from_bytes(DATA), FingerprintTable.of(work))
    assert all(same_bits(work[k], NEW[k]) for k in NEW)


def test_corrupt_patch_error_for_a_crafted_count() -> None:
    with pytest.raises(CorruptPatchError, match="more than their positions"):
        Patch.from_bytes(CRAFTED["more values than positions"]())
