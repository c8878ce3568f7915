"""Patch files written before the codec was reorganised stay readable, and today's encoder writes them again
byte for byte: the container format and the coders' choices are unchanged (``fixtures/README.md``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from flipsync.codec import Patch, apply_patch
from flipsync.codec.bits import dtype_named
from flipsync.codec.class_index import BaseBits
from flipsync.codec.container import PatchFileWriter
from flipsync.codec.context import ContextCoder
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.codec.section import encode_change
from flipsync.errors import CorruptPatchError
from tests.codec.container_helpers import tail_parts

FIXTURES = Path(__file__).parent / "fixtures"
CASES = sorted(p.stem for p in FIXTURES.glob("*.patch"))


def _views(name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    loaded = safetensors.torch.load_file(FIXTURES / f"{name}.views.safetensors")
    old = {k.removeprefix("old/"): v for k, v in loaded.items() if k.startswith("old/")}
    new = {k.removeprefix("new/"): v for k, v in loaded.items() if k.startswith("new/")}
    return old, new


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_every_fixture_is_present_and_they_cover_every_mode_and_coder() -> None:
    assert CASES == [
        "big", "ctx", "ctx_bf16", "ctx_fp16", "ctx_fp8_block", "ctx_mxfp4", "grouped", "lanes", "mixed", "runs_raw",
        "small",
    ]  # fmt: skip
    modes, positions, values, ctx_dtypes = set(), set(), set(), set()
    for name in CASES:
        patch = Patch.load(FIXTURES / f"{name}.patch")
        modes |= {s.mode for s in patch.sections}
        positions |= {s.pos["codec"] for s in patch.sections}
        values |= {s.val["codec"] for s in patch.sections}
        ctx_dtypes |= {s.dtype for s in patch.sections if s.pos["codec"] == "ctx"}
    assert modes == {"step", "raw", "mixed"}
    assert positions == {"rice", "zstd", "ctx"} and values == {"bits", "ans"}
    assert ctx_dtypes == {"BF16", "F16", "F8_E4M3", "U8"}
    grouped = tail_parts((FIXTURES / "grouped.patch").read_bytes())
    assert grouped[2] and grouped[3]  # grouped values and grouped positions


@pytest.mark.parametrize("name", CASES)
def test_fixtures_apply_bitwise(name: str) -> None:
    old, new = _views(name)
    patch = Patch.load(FIXTURES / f"{name}.patch")
    tensors = {k: v.clone() for k, v in old.items()}
    apply_patch(tensors, patch, FingerprintTable.of(tensors), verify="digest")
    assert tensors.keys() == new.keys()
    assert all(_same_bits(tensors[k], new[k]) for k in new)


@pytest.mark.parametrize("name", CASES)
def test_fixtures_are_written_again_byte_for_byte(name: str) -> None:
    """Each section re-encoded from its decoded change (against its base) gives the same header row and
    streams, and a file laid out anew from them is the fixture, byte for byte."""
    data = (FIXTURES / f"{name}.patch").read_bytes()
    patch = Patch.from_bytes(data)
    assert patch.to_bytes() == data  # a patch read from a file is written back as it is
    old, _ = _views(name)
    writer = PatchFileWriter()
    out = []
    for change in patch.changes(old):
        section, blob = encode_change(change, old[change.name])
        assert section == next(s for s in patch.sections if s.name == change.name)
        assert blob == bytes(patch.section_blob(change.name))
        out.append(writer.add(change.name, blob))
    head, tail = writer.finish(patch.header)
    assert b"".join([head, *(b for b in out if b is not None), tail]) == data


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("ctx")])
def test_ctx_fixtures_decode_the_same_in_chunks(name: str) -> None:
    """The chunked pass on a pool, as a large base gets it, must read the same stream."""
    old, _ = _views(name)
    patch = Patch.load(FIXTURES / f"{name}.patch")
    assert patch.needs_base
    coder = ContextCoder(chunk=257, parallel_from=0, workers=2)
    for change in patch.changes(old):
        s = next(s for s in patch.sections if s.name == change.name)
        if s.pos["codec"] == "ctx":
            bits = old[change.name].contiguous().view(-1).view(torch.uint8).numpy()
            base = BaseBits(bits.view(dtype_named(s.dtype).uint_numpy), dtype_named(s.dtype))
            blob = bytes(patch.section_blob(s.name))[: s.pos["bytes"]]
            assert np.array_equal(coder.decode(s.pos, blob, s.n, base.bits.size, base), change.positions)


@pytest.mark.parametrize("found", ["1", "2", "3", "5", ""])
def test_other_container_formats_are_refused_with_what_to_do(found: str) -> None:
    data = bytearray((FIXTURES / "small.patch").read_bytes())
    at = data.index(b'"flipsync_patch":"4"') + len(b'"flipsync_patch":"')
    edited = bytes(data[:at]) + found.encode() + bytes(data[at + 1 :])
    # keep the safetensors header's length right (pad with spaces, as safetensors does)
    hlen = int.from_bytes(data[:8], "little")
    body = edited[8 : 8 + hlen - 1 + len(found)]
    body += b" " * (hlen - len(body))
    edited = data[:8] + body + bytes(data[8 + hlen :])
    with pytest.raises(CorruptPatchError, match=r"published again|not a flipsync patch|unsupported"):
        Patch.from_bytes(bytes(edited))
