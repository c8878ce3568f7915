"""Every served format round-trips through the codec bit for bit, for any Adam-like step of the masters."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flipsync.codec import Patch, apply_patch, diff_views, squash
from flipsync.codec.fingerprint import FingerprintTable, Hasher, combine_digests
from flipsync.errors import BaseMismatchError, VerificationError
from flipsync.formats import FORMAT_NAMES, served_view
from tests.strategies import same_bits


@given(
    fmt=st.sampled_from(FORMAT_NAMES),
    seed=st.integers(0, 2**31),
    rows=st.integers(1, 40),
    cols=st.sampled_from([2, 16, 32, 48, 130]),
    lr=st.sampled_from([1e-7, 1e-6, 1e-5, 1e-3]),
    mode=st.sampled_from(["step", "raw"]),
)
def test_served_views_round_trip(fmt: str, seed: int, rows: int, cols: int, lr: float, mode: str) -> None:
    g = torch.Generator().manual_seed(seed)
    before = {
        "layers.0.q_proj.weight": torch.randn(rows, cols, generator=g) * 0.02,
        "layers.0.k_proj.weight": torch.randn(rows, cols, generator=g) * 0.05,
        "layers.0.norm.weight": 1 + 0.01 * torch.randn(cols, generator=g),
    }
    after = {k: v + lr * torch.randn(v.shape, generator=g).sign() for k, v in before.items()}
    old, new = served_view(before, fmt), served_view(after, fmt)
    patch, _ = diff_views(old, new, mode=mode, served_format=fmt)  # type: ignore[arg-type]
    replica = {k: v.clone() for k, v in old.items()}
    apply_patch(replica, Patch.from_bytes(patch.to_bytes()), FingerprintTable.of(replica), verify="digest")
    assert set(replica) == set(new)
    assert all(same_bits(replica[k], new[k]) for k in new)


def _views(fmt: str, seed: int, rows: int, cols: int, lr: float) -> list[dict[str, torch.Tensor]]:
    """Three served views of masters moved twice by sign steps of size lr."""
    g = torch.Generator().manual_seed(seed)
    m = {
        "a.weight": torch.randn(rows, cols, generator=g) * 0.02,
        "b.weight": torch.randn(rows, cols, generator=g) * 0.05,
        "c.norm": 1 + 0.01 * torch.randn(cols, generator=g),
    }
    out = [m]
    for _ in range(2):
        out.append({k: v + lr * torch.randn(v.shape, generator=g).sign() for k, v in out[-1].items()})
    return [served_view(v, fmt) for v in out]


@given(
    fmt=st.sampled_from(FORMAT_NAMES),
    seed=st.integers(0, 2**31),
    rows=st.integers(1, 24),
    cols=st.sampled_from([16, 32, 130]),
    lr=st.sampled_from([1e-6, 1e-4, 1e-2]),
)
def test_compact_container_round_trips_squashes_and_merges(
    fmt: str, seed: int, rows: int, cols: int, lr: float
) -> None:
    """Patch files (no per-section fingerprints, one digest) apply bitwise, read back from bytes they squash
    without a base and merge as shards."""
    v0, v1, v2 = _views(fmt, seed, rows, cols, lr)
    first, _ = diff_views(v0, v1, served_format=fmt, context=False)
    second, _ = diff_views(v1, v2, served_format=fmt, context=False)
    a, b = Patch.from_bytes(first.to_bytes()), Patch.from_bytes(second.to_bytes())
    assert a.header.digest is not None  # of no tensors, when nothing changed: the XOR of none
    replica = {k: v.clone() for k, v in v0.items()}
    table = FingerprintTable.of(replica)
    work, t = {k: v.clone() for k, v in replica.items()}, table.copy()
    apply_patch(work, a, t, verify="digest")
    assert all(same_bits(work[k], v1[k]) for k in v1) and t.view_fp() == a.header.target.view
    squashed = Patch.from_bytes(squash([a, b]).to_bytes())
    apply_patch(replica, squashed, table, verify="digest")
    assert all(same_bits(replica[k], v2[k]) for k in v2)
    # rank shards: each a patch over some tensors; their digests combine into the whole patch's
    names = [s.name for s in first.sections]
    with Hasher() as h:
        shards = [
            Patch.from_bytes(
                Patch.from_changes(
                    [first.change(n) for n in part],
                    base=first.header.base,
                    target=first.header.target,
                    digest=combine_digests((n, h.digest(v1[n])) for n in part),
                ).to_bytes()
            )
            for part in (names[:1], names[1:])
        ]
    merged = Patch.merge_disjoint(shards, base=first.header.base, target=first.header.target)
    assert merged.header.digest == a.header.digest
    work = {k: v.clone() for k, v in v0.items()}
    apply_patch(work, Patch.from_bytes(merged.to_bytes()), FingerprintTable.of(work), verify="digest")
    assert all(same_bits(work[k], v1[k]) for k in v1)


def test_compact_patches_refuse_a_wrong_base_and_a_wrong_result() -> None:
    """Without per-section fingerprints the view fingerprints still refuse a wrong base before any byte
    changes, and a wrong digest after the apply rolls it back."""
    v0, v1, _ = _views("bf16", 3, 16, 32, 1e-2)
    patch = Patch.from_bytes(diff_views(v0, v1)[0].to_bytes())
    work = {k: v.clone() for k, v in v1.items()}  # the target, not the base: same layout, other bits
    with pytest.raises(BaseMismatchError):
        apply_patch(work, patch, FingerprintTable.of(work))
    assert all(same_bits(work[k], v1[k]) for k in v1)
    forged = Patch(
        dataclasses.replace(patch.header, digest="0" * 32), {s.name: patch.section_blob(s.name) for s in patch.sections}
    )
    work = {k: v.clone() for k, v in v0.items()}
    with pytest.raises(VerificationError, match="target content digest"):
        apply_patch(work, forged, FingerprintTable.of(work), verify="digest")
    assert all(same_bits(work[k], v0[k]) for k in v0)
    moved = dataclasses.replace(patch.header, target=dataclasses.replace(patch.header.target, view="0" * 32))
    with pytest.raises(VerificationError, match="target view"):
        apply_patch(
            work, Patch(moved, {s.name: patch.section_blob(s.name) for s in patch.sections}), FingerprintTable.of(work)
        )
    assert all(same_bits(work[k], v0[k]) for k in v0)
