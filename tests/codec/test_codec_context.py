"""The version 2 ``ctx`` position coder: exact round trips against the base for every format's dtype, patches
that shrink and never grow, clean refusals of corrupt streams and wrong bases, and squash with the base."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flipsync.codec import Patch, apply_patch, diff_views, squash
from flipsync.codec.bits import bits_numpy, dtype_named
from flipsync.codec.class_index import BaseBits, ClassIndex, class_rule
from flipsync.codec.context import ContextCoder, conditional_position_bits
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.errors import CorruptPatchError, PatchError
from flipsync.formats import served_view

CODER = ContextCoder()
# The same coder working in chunks on a pool, whatever the base's size: its pass must give the same positions,
# and refuse the same streams, as the one-thread pass, and its encoder the same stream.
CHUNKED = (ContextCoder(chunk=97, parallel_from=0, workers=2), ContextCoder(chunk=4096, parallel_from=0, workers=3))
# Each pass with its emit forced branch-free (dense_from=0) or branching (dense_from=2), whatever the density,
# one-thread and chunked: every variant must give the same positions and refuse the same streams.
PASSES = (
    ContextCoder(dense_from=0.0),
    ContextCoder(dense_from=2.0),
    ContextCoder(chunk=97, parallel_from=0, workers=2, dense_from=0.0),
    ContextCoder(chunk=1000, parallel_from=0, workers=2, dense_from=2.0),
)
# With the base's class index: every change placed block by block (place_upto=inf), or the pass in chunks
# that take their class counts from the index (place_upto=0); the same positions, the same refusals.
INDEXED = (
    ContextCoder(place_upto=math.inf),
    ContextCoder(place_upto=0.0, chunk=97, parallel_from=0, workers=2),
    ContextCoder(place_upto=0.0, chunk=4096, parallel_from=0, workers=3, dense_from=2.0),
)
DTYPES = ["BF16", "F16", "F32", "F8_E4M3", "F8_E5M2", "F8_E8M0", "U8"]


def _indexed(base: BaseBits) -> BaseBits:
    """``base`` held by a class index, whatever its size (by default small tensors are not indexed)."""
    return ClassIndex(min_blocks=1).base("t", base.bits, base.dtype, fp=0)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@st.composite
def bases_and_positions(draw: st.DrawFn) -> tuple[BaseBits, np.ndarray]:
    d = dtype_named(draw(st.sampled_from(DTYPES)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    numel = draw(st.integers(1, 20_000))
    bits = rng.integers(0, 1 << d.bits, size=numel, dtype=np.uint64).astype(d.uint_numpy)
    if draw(st.booleans()):  # few distinct values: long runs of one class
        bits = bits[rng.integers(0, min(3, numel), size=numel)]
    if draw(st.booleans()):  # edge patterns: +-0, +-inf or all-ones exponents (NaN), smallest subnormals, max
        top, ones = 1 << (d.bits - 1), (1 << d.bits) - 1
        edges = np.array([0, top, ones, ones ^ top, 1, top | 1, top - 1, ones - 1], dtype=np.uint64)
        at = rng.random(numel) < draw(st.sampled_from([0.05, 0.5]))
        bits[at] = edges[rng.integers(0, edges.size, int(at.sum()))].astype(d.uint_numpy)
    density = draw(st.sampled_from([0.0005, 0.01, 0.2, 0.9, 1.0]))
    pos = np.flatnonzero(rng.random(numel) < density)
    if pos.size == 0:
        pos = np.array([numel - 1], dtype=np.int64)
    return BaseBits(bits, d), pos.astype(np.int64)


@settings(max_examples=150, deadline=None)
@given(bases_and_positions())
def test_ctx_positions_round_trip(case: tuple[BaseBits, np.ndarray]) -> None:
    base, pos = case
    params, blob = CODER.encode(pos, base)
    out = CODER.decode(params, blob, pos.size, base.bits.size, base)
    assert out.dtype == np.int64 and np.array_equal(out, pos)
    for coder in CHUNKED:
        assert np.array_equal(coder.decode(params, blob, pos.size, base.bits.size, base), pos)
        assert coder.encode(pos, base) == (params, blob)  # the chunked encoder writes the same stream
    for coder in PASSES:
        assert np.array_equal(coder.decode(params, blob, pos.size, base.bits.size, base), pos)
    indexed = _indexed(base)
    for coder in (CODER, *INDEXED):
        assert np.array_equal(coder.decode(params, blob, pos.size, base.bits.size, indexed), pos)


@settings(max_examples=60, deadline=None)
@given(bases_and_positions(), st.data())
def test_corrupt_ctx_streams_are_refused_cleanly(case: tuple[BaseBits, np.ndarray], data: st.DataObject) -> None:
    base, pos = case
    params, blob = CODER.encode(pos, base)
    raw = bytearray(blob)
    how = data.draw(st.sampled_from(["flip", "cut", "extend", "n", "classes"]))
    n = pos.size
    if how == "flip" and raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "cut":
        raw = raw[: data.draw(st.integers(0, max(0, len(raw) - 1)))]
    elif how == "extend":
        raw += b"\x01"
    elif how == "n":
        n = data.draw(st.integers(0, 3 * n + 8))
    else:
        params = {**params, "classes": data.draw(st.integers(-1, class_rule(base.dtype).n_classes + 1))}
    results = []
    indexed = _indexed(base)
    for coder, held in [(c, base) for c in (CODER, *CHUNKED, *PASSES)] + [(c, indexed) for c in INDEXED]:
        try:
            results.append(coder.decode(params, bytes(raw), n, base.bits.size, held))
        except CorruptPatchError:
            results.append(None)
    out = results[0]
    assert all((r is None) == (out is None) for r in results), "the passes (chunked, branch-free, indexed...) disagree"
    if out is None:
        return
    # a mutation the stream cannot detect must still give n sorted positions inside the tensor, the same ones
    assert out.size == n and (n == 0 or (np.all(np.diff(out) > 0) and out[0] >= 0 and out[-1] < base.bits.size))
    assert all(np.array_equal(r, out) for r in results)


def test_a_base_of_another_size_is_refused() -> None:
    rng = np.random.default_rng(0)
    base = BaseBits(rng.integers(0, 1 << 16, 1000, dtype=np.uint64).astype(np.uint16), dtype_named("BF16"))
    pos = np.arange(0, 1000, 7, dtype=np.int64)
    params, blob = CODER.encode(pos, base)
    with pytest.raises(CorruptPatchError, match="the base holds 999 elements"):
        CODER.decode(params, blob, pos.size, 1000, BaseBits(base.bits[:999], base.dtype))


def _adam_like(numel: int, steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """FP32 masters at weight-like scales, moved by small correlated steps (as at lr 1e-6)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(numel, generator=g) * 0.02
    direction = torch.randn(numel, generator=g).sign()
    out = [{"w": w.clone()}]
    for _ in range(steps):
        w = w + 2e-6 * direction + 1e-6 * torch.randn(numel, generator=g)
        out.append({"w": w.clone()})
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block", "mxfp4", "nvfp4"])
def test_ctx_patches_apply_bitwise_and_are_never_larger(fmt: str) -> None:
    masters = _adam_like(1 << 16, 2)
    v0, v1, v2 = (served_view(m, fmt) for m in masters)
    p1, _ = diff_views(v0, v1)
    p1_v1, _ = diff_views(v0, v1, context=False)
    assert all(len(p1.section_blob(s.name)) <= len(p1_v1.section_blob(s.name)) for s in p1.sections)
    for patch, target in ((p1, v1), (p1_v1, v1)):
        work = {k: v.clone() for k, v in v0.items()}
        apply_patch(work, Patch.from_bytes(patch.to_bytes()), FingerprintTable.of(work), verify="digest")
        assert all(_same(work[k], target[k]) for k in target)
    # a chain squashed with its base reaches the last view
    p2, _ = diff_views(v1, v2)
    merged = squash([p1, p2], base=v0)
    work = {k: v.clone() for k, v in v0.items()}
    apply_patch(work, merged, FingerprintTable.of(work))
    assert all(_same(work[k], v2[k]) for k in v2)


def test_bf16_positions_shrink_towards_the_conditional_bound() -> None:
    v0, v1 = (served_view(m, "bf16") for m in _adam_like(1 << 20, 1))
    patch, _ = diff_views(v0, v1)
    plain, _ = diff_views(v0, v1, context=False)
    (s,) = patch.sections
    assert s.pos["codec"] == "ctx" and plain.sections[0].pos["codec"] == "rice"
    old = bits_numpy(v0["w"])
    positions = np.flatnonzero(old != bits_numpy(v1["w"]))
    bound = conditional_position_bits(old, positions, dtype_named("BF16")) / 8
    assert s.pos["bytes"] <= 1.08 * bound + 64
    assert s.pos["bytes"] < 0.9 * plain.sections[0].pos["bytes"]
    assert Patch.from_bytes(patch.to_bytes()).needs_base
    assert not plain.needs_base


def test_ctx_patches_need_their_base() -> None:
    v0, v1 = (served_view(m, "bf16") for m in _adam_like(1 << 16, 1))
    patch, _ = diff_views(v0, v1)
    plain, _ = diff_views(v0, v1, context=False)
    assert patch.needs_base and not plain.needs_base
    with pytest.raises(PatchError, match="coded against the base tensor"):
        list(patch.changes())
    with pytest.raises(PatchError, match="coded against the base tensor"):
        squash([patch])
    (change,) = patch.changes(v0)
    assert np.array_equal(change.positions, next(plain.changes()).positions)


def test_overwrite_patches_never_depend_on_the_base() -> None:
    v0, v1 = (served_view(m, "bf16") for m in _adam_like(1 << 16, 1))
    patch, _ = diff_views(v0, v1, mode="raw")
    assert not patch.needs_base and patch.header.idempotent


def test_a_wrong_base_is_refused_before_anything_changes() -> None:
    v0, v1 = (served_view(m, "bf16") for m in _adam_like(1 << 16, 1))
    patch, _ = diff_views(v0, v1)
    other = {"w": v1["w"].clone()}
    before = other["w"].clone()
    with pytest.raises(PatchError):
        apply_patch(other, patch, FingerprintTable.of(other))
    assert _same(other["w"], before)
