"""A version's parts become one patch for the engine (``codec.join_parts``, as the sidecar's ``join_step``
calls it): chains are squashed and shards merged, but only after every section is checked against the
engine's own tensors, so a crafted header cannot make the squash allocate for a tensor the engine does not
have; the result must go between the manifest's ends."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flipsync.board.reader import PatchStep, join_step
from flipsync.codec import Patch, diff_views
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.domain.manifest import Manifest, Part
from flipsync.errors import CorruptPatchError
from tests.strategies import PART_HASH, patch_manifest


def patch_from_parts(parts: list[bytes], manifest: Manifest, table: FingerprintTable) -> Patch:
    return join_step(PatchStep(manifest, parts), table)


def _views() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    v0 = {"a.weight": torch.randn(64, 32, generator=g).bfloat16(), "b.weight": torch.randn(16, generator=g).bfloat16()}
    out = [v0]
    for _ in range(2):
        nxt = {k: t.clone() for k, t in out[-1].items()}
        for t in nxt.values():
            t.view(torch.int16).view(-1)[::7] += 1
        out.append(nxt)
    return out


def _chain() -> tuple[list[dict[str, torch.Tensor]], list[Patch], list[FingerprintTable]]:
    views = _views()
    tables = [FingerprintTable.of(v) for v in views]
    patches = [
        diff_views(views[i], views[i + 1], old_table=tables[i], base_version=None, target_version=None)[0]
        for i in range(2)
    ]
    return views, patches, tables


def _manifest(tables: list[FingerprintTable]) -> Manifest:
    """Version 1, from the first view to the last, in two parts (their bytes are not read here)."""
    return patch_manifest(
        version=1,
        base_version=0,
        target_version=1,
        base_view_fp=tables[0].view_fp(),
        target_view_fp=tables[-1].view_fp(),
        parts=(Part("p0", 1, PART_HASH), Part("p1", 1, PART_HASH)),
    )


def test_a_chain_of_parts_squashes_into_the_version_when_its_tensors_are_the_engines() -> None:
    views, patches, tables = _chain()
    patch = patch_from_parts([p.to_bytes() for p in patches], _manifest(tables), tables[0])
    assert patch.header.base.view == tables[0].view_fp() and patch.header.target.view == tables[-1].view_fp()
    assert {c.name for c in patch.changes()} == set(views[0])


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"name": "c.weight"}, "no such tensor"),
        ({"shape": (1 << 20, 1 << 20), "n": 1 << 40}, "[1048576, 1048576]"),
        ({"dtype": "F16"}, "F16"),
    ],
)
def test_a_part_naming_other_tensors_is_refused_before_decoding(change: dict[str, object], words: str) -> None:
    _, patches, tables = _chain()
    first, *rest = patches[1].header.sections
    forged = replace(first, **change)
    blobs = {(forged.name if k == first.name else k): v for k, v in patches[1]._blobs.items()}
    crafted = Patch(replace(patches[1].header, sections=(forged, *rest)), blobs)
    parts = [patches[0].to_bytes(), crafted.to_bytes()]
    with pytest.raises(CorruptPatchError, match="receiver holds") as info:
        patch_from_parts(parts, _manifest(tables), tables[0])
    assert words in str(info.value)


def test_a_joined_patch_must_go_between_its_manifests_ends() -> None:
    _, patches, tables = _chain()
    wrong = _manifest([tables[1], tables[2]])  # says it starts at the middle view
    with pytest.raises(CorruptPatchError, match="but its manifest says"):
        patch_from_parts([p.to_bytes() for p in patches], wrong, tables[0])
