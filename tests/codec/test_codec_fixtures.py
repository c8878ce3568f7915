"""Patches written by earlier releases stay readable, and today's coders reproduce their bytes exactly.

``fixtures/v1`` holds patch files made by the version 1 codec (commit da543db; the cases of
``tests/fuzz/seeds.patch_cases`` and a long section whose values use four interleaved rANS lanes), each
beside a safetensors file with its base (``old/``) and target (``new/``) views. ``fixtures/v2`` holds container
version 2 patches (JSON header with per-section fingerprints and digests) whose positions are coded against
the base (``ctx``), written at commit 22e74bd before the decoder learnt to work in chunks and before the
compact version 3 container (``fixtures/make_v2.py``; ``ctx`` by the container change): BF16, F16, FP8
(E4M3) and packed FP4 (U8). ``fixtures/v3`` holds container version 3 patches (compact header in the header
tensor, grouped values of small sections), written at commit a2f94f8 before version 4 (``fixtures/make_v3.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

from flipsync.codec import FingerprintTable, Patch, apply_patch
from flipsync.codec.bits import dtype_named
from flipsync.codec.context import BaseBits, ContextCoder
from flipsync.codec.patch import encode_change, split_streams
from flipsync.codec.streams import decode_symbols
from tests.codec.test_codec_hostile import tail_parts

FIXTURES = Path(__file__).parent / "fixtures"
V1_CASES = sorted(p.stem for p in (FIXTURES / "v1").glob("*.patch"))
V2_CASES = sorted(p.stem for p in (FIXTURES / "v2").glob("*.patch"))
V3_CASES = sorted(p.stem for p in (FIXTURES / "v3").glob("*.patch"))
CASES = [("v1", name) for name in V1_CASES] + [("v2", name) for name in V2_CASES] + [("v3", n) for n in V3_CASES]


def _views(name: str, version: str = "v1") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    loaded = safetensors.torch.load_file(FIXTURES / version / f"{name}.views.safetensors")
    old = {k.removeprefix("old/"): v for k, v in loaded.items() if k.startswith("old/")}
    new = {k.removeprefix("new/"): v for k, v in loaded.items() if k.startswith("new/")}
    return old, new


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_every_fixture_is_present() -> None:
    assert V1_CASES == ["lanes", "mixed", "runs_raw", "small"]


@pytest.mark.parametrize(("version", "name"), CASES)
def test_old_patches_apply_bitwise(version: str, name: str) -> None:
    old, new = _views(name, version)
    patch = Patch.load(FIXTURES / version / f"{name}.patch")
    tensors = {k: v.clone() for k, v in old.items()}
    apply_patch(tensors, patch, FingerprintTable.of(tensors), verify="digest")
    assert tensors.keys() == new.keys()
    assert all(_same_bits(tensors[k], new[k]) for k in new)


@pytest.mark.parametrize(("version", "name"), CASES)
def test_old_sections_reencode_to_the_same_bytes(version: str, name: str) -> None:
    data = (FIXTURES / version / f"{name}.patch").read_bytes()
    patch = Patch.from_bytes(data)
    assert patch.to_bytes() == data  # a patch read from a file is written back as it is
    grouped = version == "v3" and _had_grouped_values(data)
    # and the writer still writes its container byte for byte (grouped values are coded anew, so may differ)
    if version in ("v1", "v2"):
        assert patch.to_bytes(legacy=True) == data
    elif not grouped:
        assert patch.to_bytes(container="3") == data
    old, _ = _views(name, version)
    for change in patch.changes(old):
        if grouped:  # read back, grouped values come in a simpler code: the changes, not the bytes, must match
            continue
        section, blob = encode_change(change, old[change.name])
        was = patch.header.sections[[s.name for s in patch.sections].index(change.name)]
        if was.val["codec"] != "ans":
            assert blob == bytes(patch.section_blob(change.name))
            assert section == was
            continue
        # rANS tables now code their counts more compactly: the positions are the same bytes, the values
        # the same symbols in no more bytes
        streams, old_streams = split_streams(section, blob), split_streams(was, patch.section_blob(change.name))
        assert streams["pos"] == old_streams["pos"] and section.pos == was.pos
        assert len(streams["val"]) <= len(old_streams["val"])
        new_symbols = decode_symbols(section.val, streams["val"], change.n)
        assert new_symbols.tolist() == decode_symbols(was.val, old_streams["val"], change.n).tolist()


def _had_grouped_values(data: bytes) -> bool:
    return bool(tail_parts(data)[1])


def test_every_v3_fixture_is_present_and_reads_as_version_3() -> None:
    assert V3_CASES == ["big", "ctx", "grouped", "mixed", "runs_raw", "small"]
    modes, codecs = set(), set()
    for name in V3_CASES:
        data = (FIXTURES / "v3" / f"{name}.patch").read_bytes()
        patch = Patch.from_bytes(data)
        assert patch.container == "3" and patch.header.digest is not None
        assert all(s.base_fp is None for s in patch.sections)  # compact: no per-section fingerprints
        modes |= {s.mode for s in patch.sections}
        codecs |= {s.pos["codec"] for s in patch.sections}
        # written as version 4, it holds the same changes
        again = Patch.from_bytes(patch.to_bytes(container="4"))
        assert again.container == "4"
        old, _ = _views(name, "v3")
        for a, b in zip(patch.changes(old), again.changes(old), strict=True):
            assert np.array_equal(a.positions, b.positions) and np.array_equal(a.values, b.values)
    assert modes == {"step", "raw", "mixed"} and codecs == {"rice", "zstd", "ctx"}
    assert _had_grouped_values((FIXTURES / "v3" / "grouped.patch").read_bytes())


def test_every_v2_fixture_is_present_and_uses_ctx() -> None:
    assert V2_CASES == ["bf16", "ctx", "fp16", "fp8_block", "mxfp4"]
    dtypes = set()
    for name in V2_CASES:
        patch = Patch.load(FIXTURES / "v2" / f"{name}.patch")
        dtypes |= {s.dtype for s in patch.sections if s.pos["codec"] == "ctx"}
    assert dtypes == {"BF16", "F16", "F8_E4M3", "U8"}


@pytest.mark.parametrize("name", V2_CASES)
@pytest.mark.parametrize("chunked", [False, True])
def test_v2_ctx_patches_apply_bitwise(name: str, chunked: bool) -> None:
    old, new = _views(name, "v2")
    patch = Patch.load(FIXTURES / "v2" / f"{name}.patch")
    assert patch.needs_base
    tensors = {k: v.clone() for k, v in old.items()}
    if chunked:  # the chunked pass on a pool, as a large base gets it, must read the same stream
        coder = ContextCoder(chunk=257, parallel_from=0, workers=2)
        for change in patch.changes(old):
            s = next(s for s in patch.sections if s.name == change.name)
            if s.pos["codec"] == "ctx":
                bits = old[change.name].contiguous().view(-1).view(torch.uint8).numpy()
                base = BaseBits(bits.view(dtype_named(s.dtype).uint_numpy), dtype_named(s.dtype))
                blob = bytes(patch.section_blob(s.name))[: s.pos["bytes"]]
                positions = coder.decode(s.pos, blob, s.n, base.bits.size, base)
                assert np.array_equal(positions, change.positions)
    apply_patch(tensors, patch, FingerprintTable.of(tensors), verify="digest")
    assert all(_same_bits(tensors[k], new[k]) for k in new)
