"""Container version 4: the fixed fields in binary and the positions of small sections in one grouped stream.
Round trips over patches of many small sections; crafted, truncated and garbled grouped positions are refused
with a CorruptPatchError before anything is allocated past the stream's own size."""

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

from flipsync.codec import FingerprintTable, Patch, apply_patch, diff_views, overhead_bytes
from flipsync.codec.coders import position_gaps
from flipsync.codec.patch import GROUP, HEADER_TENSOR, _split_tail4
from flipsync.codec.rice import rice_encode
from flipsync.domain.headers import read_varint, varint
from flipsync.errors import CorruptPatchError, FlipsyncError
from tests.codec.test_codec_hostile import refused_leaving_base, relayout
from tests.fuzz.seeds import _steps, grouped_case
from tests.strategies import same_bits

OLD, NEW, PATCH = grouped_case(seed=3, tensors=40)
DATA = PATCH.to_bytes()


def _header_tensor(data: bytes) -> bytes:
    hlen = struct.unpack_from("<Q", data)[0]
    a, b = json.loads(data[8 : 8 + hlen])[HEADER_TENSOR]["data_offsets"]
    return data[8 + hlen + a : 8 + hlen + b]


def parts(data: bytes) -> list[bytes]:
    """[fixed fields, compressed rows, grouped values, grouped positions, small sections] of a version 4 file."""
    return [bytes(p or b"") for p in _split_tail4(_header_tensor(data))]


def rebuild(refs: bytes, packed: bytes, values: bytes, positions: bytes, small: bytes) -> bytes:
    tail = b"".join(varint(len(p)) + p for p in (refs, packed, values, positions)) + small
    return relayout(DATA, {HEADER_TENSOR: tail})


def rows(data: bytes = DATA) -> dict:
    return json.loads(zstandard.ZstdDecompressor().decompress(parts(data)[1]))


def with_rows(mutate: object) -> bytes:
    doc = rows()
    mutate(doc)  # type: ignore[operator]
    p = parts(DATA)
    p[1] = zstandard.ZstdCompressor().compress(json.dumps(doc, separators=(",", ":")).encode())
    return rebuild(*p)


def with_part(i: int, blob: bytes) -> bytes:
    p = parts(DATA)
    p[i] = blob
    return rebuild(*p)


def _apply(old: dict, data: bytes) -> dict:
    work = {k: v.clone() for k, v in old.items()}
    apply_patch(work, Patch.from_bytes(data), FingerprintTable.of(work), verify="digest")
    return work


def test_small_sections_share_one_position_stream() -> None:
    refs, _, values, positions, _ = parts(DATA)
    assert positions and values and len(refs) < 64
    grouped = [row for row in rows()["sections"] if row[5] == GROUP]
    assert len(grouped) >= 2 and all(row[3] is None for row in grouped)  # no n, k or length per section
    back = Patch.from_bytes(DATA)
    assert back.container == "4"  # ordinary sections again, their counts restored
    assert all(s.pos["codec"] != GROUP and s.val["codec"] != GROUP and s.n >= 1 for s in back.sections)
    assert [s.n for s in back.sections] == [s.n for s in PATCH.sections]
    for a, b in zip(PATCH.sections, back.sections, strict=True):  # each member gets its own stream back
        assert a.pos == b.pos
        assert bytes(back.section_blob(a.name))[: b.pos["bytes"]] == bytes(PATCH.section_blob(a.name))[: a.pos["bytes"]]
    assert back.header.base == PATCH.header.base and back.header.target == PATCH.header.target
    assert back.to_bytes() == DATA  # read back, it writes the same file
    for a, b in zip(PATCH.changes(), back.changes(), strict=True):
        assert np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values)
    assert all(same_bits(t, NEW[k]) for k, t in _apply(OLD, DATA).items())
    v3 = PATCH.to_bytes(container="3")
    assert len(DATA) < len(v3) and overhead_bytes(DATA) < overhead_bytes(v3)
    assert Patch.from_bytes(v3).to_bytes() == v3  # a version 3 patch is still written back as version 3


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
    assert len(data) <= len(patch.to_bytes(container="3")) + 8  # never much larger than version 3
    assert Patch.from_bytes(patch.to_bytes(container="3")).container == "3"


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
    "version key in the rows": lambda: with_rows(lambda d: d.update(flipsync_patch=4)),
    "tail truncated": lambda: relayout(DATA, {HEADER_TENSOR: _header_tensor(DATA)[:3]}),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_grouped_positions_are_refused(case: str) -> None:
    refused_leaving_base(CRAFTED[case](), OLD)


def test_a_huge_count_is_refused_before_it_is_allocated() -> None:
    with pytest.raises(CorruptPatchError, match="cannot be those of"):
        Patch.from_bytes(CRAFTED["huge count"]())


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_truncated_and_garbled_header_tensor(data: st.DataObject) -> None:
    """Cuts and bit flips anywhere in the header tensor (fixed fields, rows, grouped values and positions):
    a clean refusal, or (a flip that changes nothing the digest covers) an exact apply."""
    tail = bytearray(_header_tensor(DATA))
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
    p = [bytes(x or b"") for x in _split_tail4(_header_tensor(data))]
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
