"""The patch file: fixed cost per version (binary fixed fields, the value steps and the positions of small
sections each in one grouped stream). Round trips over any patch; crafted, truncated and garbled header tensors
are refused with a CorruptPatchError before anything is allocated past the stream's own size."""

from __future__ import annotations

import json
import struct
import tracemalloc

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from flipsync.codec import Patch, apply_patch, diff_views, squash
from flipsync.codec.coders import position_gaps
from flipsync.codec.container import GROUP, HEADER_TENSOR, overhead_bytes, split_tail
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.codec.rice import rice_encode
from flipsync.domain.headers import read_varint, varint
from flipsync.errors import CorruptPatchError, FlipsyncError
from tests.codec.container_helpers import header_tensor, refused_leaving_base, relayout, rows, tail_parts
from tests.codec.container_helpers import with_part as _with_part
from tests.codec.container_helpers import with_rows as _with_rows
from tests.fuzz.seeds import _steps, grouped_case
from tests.strategies import same_bits, view_pairs

OLD, NEW, PATCH = grouped_case(seed=3, tensors=40)
DATA = PATCH.to_bytes()


def parts(data: bytes) -> list[bytes]:
    return tail_parts(data)


def with_rows(mutate: object) -> bytes:
    return _with_rows(DATA, mutate)


def with_part(i: int, blob: bytes) -> bytes:
    return _with_part(DATA, i, blob)


def _apply(old: dict, data: bytes) -> dict:
    work = {k: v.clone() for k, v in old.items()}
    apply_patch(work, Patch.from_bytes(data), FingerprintTable.of(work), verify="digest")
    return work


def test_small_sections_share_one_position_stream_and_one_value_stream() -> None:
    refs, _, values, positions, _ = parts(DATA)
    assert positions and values and len(refs) < 64
    hlen = struct.unpack_from("<Q", DATA)[0]
    assert list(json.loads(DATA[8 : 8 + hlen])) == ["__metadata__", HEADER_TENSOR]  # all small: one table entry
    grouped = [row for row in rows(DATA)["sections"] if row[5] == GROUP]
    assert len(grouped) >= 2 and all(row[3] is None for row in grouped)  # no n, k or length per section
    assert any(row[6] == GROUP for row in rows(DATA)["sections"])
    back = Patch.from_bytes(DATA)
    # ordinary sections again, their counts restored
    assert all(s.pos["codec"] != GROUP and s.val["codec"] != GROUP and s.n >= 1 for s in back.sections)
    assert [s.n for s in back.sections] == [s.n for s in PATCH.sections]
    for a, b in zip(PATCH.sections, back.sections, strict=True):  # each member gets its own stream back
        assert a.pos == b.pos
        assert bytes(back.section_blob(a.name))[: b.pos["bytes"]] == bytes(PATCH.section_blob(a.name))[: a.pos["bytes"]]
    assert back.header.base == PATCH.header.base and back.header.target == PATCH.header.target
    assert back.to_bytes() == DATA  # read back, it writes the same file
    assert Patch(back.header, {s.name: back.section_blob(s.name) for s in back.sections}).to_bytes() == DATA
    for a, b in zip(PATCH.changes(), back.changes(), strict=True):
        assert np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values)
    assert all(same_bits(t, NEW[k]) for k, t in _apply(OLD, DATA).items())
    # the fixed cost: the table, the fixed fields and ~10 bytes of compressed row per changed tensor
    assert overhead_bytes(DATA) < 200 + 12 * len(PATCH.sections)


def test_fixed_fields_are_binary_and_hold_versions_and_digest() -> None:
    patch = PATCH.with_refs(base=PATCH.header.base.__class__(PATCH.header.base.view, 7))
    back = Patch.from_bytes(patch.to_bytes())
    assert back.header.base.version == 7 and back.header.target.version is None
    assert back.header.digest == Patch.from_bytes(DATA).header.digest is not None
    text = zstandard.ZstdDecompressor().decompress(parts(DATA)[1])
    assert PATCH.header.base.view.encode() not in text and b'"digest"' not in text


@st.composite
def many_small(draw: st.DrawFn) -> tuple[dict, dict]:
    """2 to 30 small tensors with a few changes each (some none), sizes and dtypes drawn."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    count = draw(st.integers(2, 30))
    old, new = {}, {}
    for i in range(count):
        numel = draw(st.sampled_from([1, 7, 64, 300, 3000, 20000]))
        t = torch.from_numpy(rng.standard_normal(numel).astype(np.float32))
        old[f"m{i}.w"] = t.to(torch.bfloat16) if draw(st.booleans()) else t
        frac = draw(st.sampled_from([0.0, 0.0005, 0.003, 0.02, 0.3]))
        if old[f"m{i}.w"].dtype == torch.bfloat16:
            new[f"m{i}.w"] = _steps(rng, old[f"m{i}.w"], frac) if frac else old[f"m{i}.w"].clone()
        else:
            bits = old[f"m{i}.w"].view(torch.int32).clone()
            hit = torch.from_numpy(rng.random(numel) < frac)
            bits[hit] += 1
            new[f"m{i}.w"] = bits.view(torch.float32)
    return old, new


@settings(max_examples=40, deadline=None)
@given(many_small(), st.sampled_from(["step", "raw"]))
def test_patches_of_many_small_sections_round_trip(pair: tuple[dict, dict], mode: str) -> None:
    old, new = pair
    patch, _ = diff_views(old, new, mode=mode)
    data = patch.to_bytes()
    back = Patch.from_bytes(data)
    assert back.to_bytes() == data
    assert [(s.name, s.n) for s in back.sections] == [(s.name, s.n) for s in patch.sections]
    for a, b in zip(patch.changes(old), back.changes(old), strict=True):
        assert np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values)
    assert all(same_bits(t, new[k]) for k, t in _apply(old, data).items())


def _positions(k: int, n: int, code: bytes) -> bytes:
    return bytes([k]) + varint(n) + code


def _first_grouped(doc: dict) -> list:
    return next(row for row in doc["sections"] if row[5] == GROUP)


_K = parts(DATA)[3][0]
_N, _AT = read_varint(parts(DATA)[3], 1, "the count")
_CODE = parts(DATA)[3][_AT:]

CRAFTED = {
    "positions truncated": lambda: with_part(3, parts(DATA)[3][:-1]),
    "positions cut to k": lambda: with_part(3, parts(DATA)[3][:1]),
    "huge count": lambda: with_part(3, _positions(_K, (1 << 62) - 1, _CODE)),
    "count past its bits": lambda: with_part(3, _positions(_K, 8 * len(_CODE) + 1, _CODE)),
    "fewer positions than sections": lambda: with_part(3, _positions(_K, 1, _CODE)),
    "one position fewer": lambda: with_part(3, _positions(_K, _N - 1, _CODE)),
    "one position more": lambda: with_part(3, _positions(_K, _N + 1, _CODE)),
    "k too large": lambda: with_part(3, _positions(63, _N, _CODE)),
    "another k": lambda: with_part(3, _positions(max(0, _K - 2), _N, _CODE)),
    "trailing bytes": lambda: with_part(3, parts(DATA)[3] + b"\x00"),
    "positions past the sections": lambda: with_part(3, _positions(_K, _N, b"\x00" * len(_CODE))),
    "varint not shortest": lambda: with_part(3, bytes([_K]) + bytes([(_N & 0x7F) | 0x80, 0x80, 0]) + _CODE),
    "no grouped positions": lambda: with_part(3, b""),
    "stream without grouped rows": lambda: with_rows(
        lambda d: [row.__setitem__(5, {"codec": "rice", "k": 3, "bytes": 0}) for row in d["sections"]]
    ),
    "grouped row with its count": lambda: with_rows(lambda d: _first_grouped(d).__setitem__(3, 1)),
    "grouped row with params": lambda: with_rows(lambda d: _first_grouped(d).__setitem__(5, {"codec": GROUP, "k": 1})),
    "ordinary row without count": lambda: with_rows(
        lambda d: _first_grouped(d).__setitem__(5, {"codec": "rice", "k": 3, "bytes": 1})
    ),
    "a grouped section emptied": lambda: with_rows(lambda d: _first_grouped(d).__setitem__(2, [0])),
    "grouped space too large": lambda: with_rows(lambda d: _first_grouped(d).__setitem__(2, [1 << 24] * 3)),
    "refs unknown flag": lambda: with_part(0, bytes([parts(DATA)[0][0] | 0x40]) + parts(DATA)[0][1:]),
    "refs truncated": lambda: with_part(0, parts(DATA)[0][:-1]),
    "refs trailing byte": lambda: with_part(0, parts(DATA)[0] + b"\x00"),
    "refs empty fingerprint": lambda: with_part(0, bytes([0, 0])),
    "ends in the rows": lambda: with_rows(lambda d: d.update(base={"view": "ab"})),
    "unknown key in the rows": lambda: with_rows(lambda d: d.update(flipsync_patch=4)),
    "tail truncated": lambda: relayout(DATA, {HEADER_TENSOR: header_tensor(DATA)[:3]}),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_grouped_positions_are_refused(case: str) -> None:
    refused_leaving_base(CRAFTED[case](), OLD)


def test_a_huge_count_is_refused_before_it_is_allocated() -> None:
    with pytest.raises(CorruptPatchError, match="cannot be those of"):
        Patch.from_bytes(CRAFTED["huge count"]())


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_truncated_and_garbledheader_tensor(data: st.DataObject) -> None:
    """Cuts and bit flips anywhere in the header tensor (fixed fields, rows, grouped values and positions):
    a clean refusal, or (a flip that changes nothing the digest covers) an exact apply."""
    tail = bytearray(header_tensor(DATA))
    if data.draw(st.booleans()):
        tail = tail[: data.draw(st.integers(0, len(tail) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 4))):
            tail[data.draw(st.integers(0, len(tail) - 1))] ^= data.draw(st.integers(1, 255))
    work = {k: v.clone() for k, v in OLD.items()}
    try:
        apply_patch(work, Patch.from_bytes(relayout(DATA, {HEADER_TENSOR: bytes(tail)})), FingerprintTable.of(work))
    except FlipsyncError:
        assert all(same_bits(work[k], OLD[k]) for k in OLD)
        return
    assert all(same_bits(work[k], NEW[k]) for k in NEW)


def test_a_huge_declared_tensor_costs_no_memory_when_ungrouped() -> None:
    """A grouped member that declares 2^40 elements and holds one change near its start (a small k): giving it
    its own stream back allocates by the decoded count and gaps, not by the declared size (32 GiB here)."""
    old = {f"t{i}": torch.zeros(64, dtype=torch.bfloat16) for i in range(3)}
    new = {k: v.clone() for k, v in old.items()}
    for v in new.values():
        v[5] = 1.0
    patch, _ = diff_views(old, new)
    data = patch.to_bytes()
    p = [bytes(x or b"") for x in split_tail(header_tensor(data))]
    doc = json.loads(zstandard.ZstdDecompressor().decompress(p[1]))
    assert [row[5] for row in doc["sections"]] == [GROUP] * 3
    doc["sections"][0][2] = [1 << 40]
    params, code = rice_encode(position_gaps(np.array([5, (1 << 40) + 5, (1 << 40) + 64 + 5], np.int64)))
    p[1] = zstandard.ZstdCompressor().compress(json.dumps(doc).encode())
    p[3] = bytes([params["k"]]) + varint(3) + code
    crafted = relayout(data, {HEADER_TENSOR: b"".join(varint(len(x)) + x for x in p[:4]) + p[4]})
    tracemalloc.start()
    try:
        back = Patch.from_bytes(crafted)
        change = back.change("t0")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert change.positions.tolist() == [5] and peak < 1 << 20
    with pytest.raises(FlipsyncError):  # and the replica refuses it: its tensor is not that shape
        apply_patch({k: v.clone() for k, v in old.items()}, back, FingerprintTable.of(old))


def _with_values(values: bytes) -> bytes:
    return with_part(2, values)


def _preamble(params: object, stream: bytes = b"") -> bytes:
    text = json.dumps(params).encode()
    return struct.pack("<H", len(text)) + text + stream


def _first_value_grouped(doc: dict) -> list:
    return next(row for row in doc["sections"] if row[6] == GROUP)


GROUPED_VALUES = {
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
    "a raw section grouped": lambda: with_rows(lambda d: _first_value_grouped(d).__setitem__(4, "raw")),
    "values without grouped rows": lambda: with_rows(
        lambda d: [row.__setitem__(6, {"codec": "bits", "bits": 8, "bytes": 0}) for row in d["sections"]]
    ),
}


@pytest.mark.parametrize("case", sorted(GROUPED_VALUES))
def test_crafted_grouped_values_are_refused(case: str) -> None:
    refused_leaving_base(GROUPED_VALUES[case](), OLD)


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


def test_grouped_patch_refuses_a_wrong_base_before_any_change() -> None:
    work = {k: v.clone() for k, v in NEW.items()}
    with pytest.raises(FlipsyncError, match="applies to view"):
        apply_patch(work, Patch.from_bytes(DATA), FingerprintTable.of(work))
    assert all(same_bits(work[k], NEW[k]) for k in NEW)


@settings(max_examples=30, deadline=None)
@given(view_pairs(max_tensors=6, max_numel=2000), st.booleans())
def test_any_patch_round_trips_through_the_container(pair: tuple[dict, dict], raw: bool) -> None:
    old, new = pair
    patch, _ = diff_views(old, new, mode="raw" if raw else "step")
    data = patch.to_bytes()
    back = Patch.from_bytes(data)
    assert back.to_bytes() == data
    work = _apply(old, data)
    assert all(same_bits(work[k], new[k]) for k in new)
    # the squash of a patch with its inverse steps, read from bytes, returns to the base
    undo, _ = diff_views(new, old, mode="raw" if raw else "step")
    both = squash(
        [
            Patch.from_bytes(
                patch.to_bytes(),
            ),
            Patch.from_bytes(undo.to_bytes()),
        ],
        base=old,
    )
    work = _apply(old, both.to_bytes())
    assert all(same_bits(work[k], old[k]) for k in old)


def test_a_tensor_the_header_does_not_list_is_refused() -> None:
    """A section copied under a new name used to be ignored; a file must hold exactly what its header lists."""
    g = torch.Generator().manual_seed(0)
    old = {"a": torch.randn(200_000, generator=g).to(torch.bfloat16), "b": torch.randn(3000).to(torch.bfloat16)}
    new = {k: v.clone() for k, v in old.items()}
    new["a"].view(torch.int16)[torch.rand(200_000, generator=g) < 0.05] += 1
    data = diff_views(old, new)[0].to_bytes()
    hlen = struct.unpack_from("<Q", data)[0]
    outer = json.loads(data[8 : 8 + hlen])
    assert "a" in outer  # large enough for its own tensor
    a0, a1 = outer["a"]["data_offsets"]
    copy = data[8 + hlen + a0 : 8 + hlen + a1]
    end = max(e["data_offsets"][1] for k, e in outer.items() if k != "__metadata__")
    outer["b"] = {"dtype": "U8", "shape": [len(copy)], "data_offsets": [end, end + len(copy)]}
    head = json.dumps(outer).encode()
    crafted = struct.pack("<Q", len(head)) + head + data[8 + hlen :] + copy
    with pytest.raises(CorruptPatchError, match="does not list"):
        Patch.from_bytes(crafted)
