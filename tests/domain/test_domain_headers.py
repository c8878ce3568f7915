"""The version 4 header's binary fixed fields and rows: every header round-trips, every damage is refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flipsync.domain.headers import PatchHeader, SectionHeader, ViewRef, read_varint, varint
from flipsync.errors import CorruptPatchError

HEX = st.text("0123456789abcdef", min_size=1, max_size=128)
DIGESTS = st.text("0123456789abcdef", min_size=1, max_size=64).map(lambda s: s + s)  # whole bytes
VERSIONS = st.none() | st.integers(0, 1 << 62)
PARAMS = st.sampled_from([{"codec": "group"}, {"codec": "rice", "k": 3, "bytes": 9}, {"codec": "bits", "bits": 2}])


@st.composite
def headers(draw: st.DrawFn) -> PatchHeader:
    sections = []
    for i in range(draw(st.integers(0, 4))):
        pos = draw(PARAMS)
        shape = tuple(draw(st.lists(st.integers(1, 50), max_size=3)))
        n = 0 if pos == {"codec": "group"} else draw(st.integers(1, max(1, len(shape) and shape[0])))
        mixed = draw(st.booleans())
        sections.append(
            SectionHeader(
                f"t{i}",
                "BF16",
                shape,
                n,
                "mixed" if mixed else "step",
                pos,
                draw(PARAMS),
                tag=draw(PARAMS) if mixed else None,
            )
        )
    return PatchHeader(
        ViewRef(draw(HEX), draw(VERSIONS)),
        ViewRef(draw(HEX), draw(VERSIONS)),
        tuple(sections),
        draw(st.none() | st.sampled_from(["bf16", "mxfp4"])),
        draw(st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2)),
        draw(st.none() | DIGESTS),
    )


@given(headers())
def test_packed_headers_round_trip(header: PatchHeader) -> None:
    assert PatchHeader.from_packed(header.refs_bytes(), header.to_packed()) == header


@given(st.integers(0, (1 << 63) - 1))
def test_varints_round_trip_in_their_shortest_form(value: int) -> None:
    data = varint(value)
    assert read_varint(data + b"\xff", 0, "x") == (value, len(data))
    assert len(data) == max(1, -(-value.bit_length() // 7))


@given(headers(), st.data())
def test_damaged_fixed_fields_are_refused_or_read_as_other_fields(header: PatchHeader, data: st.DataObject) -> None:
    refs = bytearray(header.refs_bytes())
    if data.draw(st.booleans()):
        refs = refs[: data.draw(st.integers(0, len(refs) - 1))]
    else:
        refs[data.draw(st.integers(0, len(refs) - 1))] ^= data.draw(st.integers(1, 255))
    try:
        back = PatchHeader.from_packed(bytes(refs), header.to_packed())
    except CorruptPatchError:
        return
    assert back.refs_bytes() == bytes(refs)  # whatever it reads, it reads exactly those bytes
    assert back != header


def test_crafted_fixed_fields() -> None:
    good = PatchHeader(ViewRef("abc", 3), ViewRef("0f", None), (), digest="ff").refs_bytes()
    rows = '{"sections":[]}'
    assert PatchHeader.from_packed(good, rows).base == ViewRef("abc", 3)
    for bad in (b"", b"\x08", good + b"\x00", good[:-1], b"\x00\x00", b"\x00\x03\xab\xc1\x02\x0f"):
        with pytest.raises(CorruptPatchError):
            PatchHeader.from_packed(bad, rows)
    with pytest.raises(CorruptPatchError, match="shortest"):
        PatchHeader.from_packed(b"\x01\x02\xab\x02\x0f\x83\x00", rows)
    for doc in ('{"sections":[],"flipsync_patch":4}', '{"sections":[],"digest":"ab"}', "[]", "{"):
        with pytest.raises(CorruptPatchError):
            PatchHeader.from_packed(good, doc)


def test_a_digest_of_half_a_byte_is_refused() -> None:
    """Content digests are combined as bytes: an odd number of hex digits is a corrupt header, refused when it
    is read, not an error when the patch is written again (found by fuzzing)."""
    good = PatchHeader(ViewRef("abc", 3), ViewRef("0f", None), (), digest="ff")
    with pytest.raises(CorruptPatchError, match="whole bytes"):
        PatchHeader.from_packed(replace(good, digest="fff").refs_bytes(), '{"sections":[]}')
