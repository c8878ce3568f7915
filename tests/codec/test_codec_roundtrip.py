"""diff -> bytes -> decode -> apply is bitwise for any dtype, shape and edit; squash composes exactly."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flipsync.codec import Patch, apply_patch, diff_views, squash
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.domain.headers import ViewRef
from flipsync.errors import PatchError
from tests.strategies import edit, patch_chains, same_bits, view_pairs


def clone(view: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in view.items()}


@given(view_pairs(), st.sampled_from(["step", "raw"]))
def test_round_trip_is_bitwise(pair: tuple[dict, dict], mode: str) -> None:
    old, new = pair
    patch, new_table = diff_views(old, new, mode=mode)  # type: ignore[arg-type]
    decoded = Patch.from_bytes(patch.to_bytes())
    work = clone(old)
    table = FingerprintTable.of(work)
    apply_patch(work, decoded, table, verify="digest")
    assert all(same_bits(work[k], new[k]) for k in new)
    assert table == FingerprintTable.of(new) == new_table
    assert table.view_fp() == decoded.header.target.view
    changed = sum(
        int((~np.equal(*(t.reshape(-1).view(torch.uint8).numpy() for t in (old[k], new[k])))).any()) for k in old
    )
    assert (len(decoded) == 0) == (changed == 0)


@given(patch_chains(max_steps=5))
def test_squash_equals_sequential_apply(chain: tuple) -> None:
    views, patches = chain
    merged = Patch.from_bytes(squash(patches).to_bytes())
    work = clone(views[0])
    wt = FingerprintTable.of(work)
    apply_patch(work, merged, wt, verify="digest")
    assert all(same_bits(work[k], views[-1][k]) for k in work)
    assert merged.header.base == patches[0].header.base and merged.header.target == patches[-1].header.target


def test_squash_is_smaller_than_the_sum() -> None:
    rng = np.random.default_rng(0)
    v0 = {"w": torch.randn(200_000).to(torch.bfloat16)}
    views = [v0]
    for _ in range(6):
        views.append({"w": edit(rng, views[-1]["w"], 0.01, style="ulp")})
    patches, table = [], None
    for a, b in itertools.pairwise(views):
        p, table = diff_views(a, b, old_table=table)
        patches.append(p)
    merged = squash(patches)
    assert len(merged.to_bytes()) < sum(len(p.to_bytes()) for p in patches)


def test_steps_that_cancel_vanish_from_a_squash() -> None:
    a = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    b = {"w": a["w"].clone()}
    b["w"][10] = 1.0
    p1, t1 = diff_views(a, b)
    p2, _ = diff_views(b, a, old_table=t1)
    merged = squash([p1, p2])
    assert len(merged) == 0
    assert merged.header.base.view == merged.header.target.view


def test_squash_refuses_a_broken_chain() -> None:
    a = {"w": torch.zeros(10)}
    b = {"w": torch.ones(10)}
    c = {"w": torch.full((10,), 2.0)}
    p1, _ = diff_views(a, b)
    p2, _ = diff_views(a, c)
    with pytest.raises(PatchError, match="do not form a chain"):
        squash([p1, p2])


def test_edge_values_are_exact() -> None:
    """+-0, subnormals, max, inf and NaN payloads in the served bits all survive a round trip."""
    specials = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 1.1754942e-38, 3.4028235e38, -3.4028235e38, float("inf"), float("-inf"), 1.0],
        dtype=torch.float32,
    )
    nan_payloads = torch.tensor([0x7FC00000, 0x7F800001, 0xFFC00001 - (1 << 32)], dtype=torch.int32).view(torch.float32)
    old = {"f32": torch.cat([specials, nan_payloads]), "bf16": torch.cat([specials, nan_payloads]).to(torch.bfloat16)}
    new = {k: v.flip(0).contiguous() for k, v in old.items()}
    patch, _ = diff_views(old, new)
    work = clone(old)
    apply_patch(work, Patch.from_bytes(patch.to_bytes()), FingerprintTable.of(work), verify="digest")
    assert all(same_bits(work[k], new[k]) for k in new)


def test_layout_changes_are_refused() -> None:
    with pytest.raises(PatchError, match="keyframe"):
        diff_views({"w": torch.zeros(4)}, {"w": torch.zeros(5)})
    with pytest.raises(PatchError, match="keyframe"):
        diff_views({"w": torch.zeros(4)}, {"v": torch.zeros(4)})
    with pytest.raises(PatchError, match="keyframe"):
        diff_views({"w": torch.zeros(4)}, {"w": torch.zeros(4, dtype=torch.bfloat16)})


def test_disjoint_shards_merge_into_one_patch() -> None:
    """One patch per trainer rank, each over its own tensors, applied as one version of the whole view."""
    rng = np.random.default_rng(3)
    old = {f"w{i}": torch.randn(500).to(torch.bfloat16) for i in range(4)}
    new = {k: edit(rng, v, 0.05, style="ulp") for k, v in old.items()}
    shards = [{k: old[k] for k in ("w0", "w1")}, {k: old[k] for k in ("w2", "w3")}]
    parts = [diff_views(s, {k: new[k] for k in s})[0] for s in shards]
    full_old, full_new = FingerprintTable.of(old), FingerprintTable.of(new)
    merged = Patch.merge_disjoint(
        [Patch.from_bytes(p.to_bytes()) for p in parts],
        base=ViewRef(full_old.view_fp(), 0),
        target=ViewRef(full_new.view_fp(), 1),
    )
    work = clone(old)
    table = FingerprintTable.of(work)
    apply_patch(work, Patch.from_bytes(merged.to_bytes()), table, verify="digest")
    assert all(same_bits(work[k], new[k]) for k in new)
    assert table.view_fp() == full_new.view_fp()
    with pytest.raises(PatchError, match="more than one shard"):
        Patch.merge_disjoint([parts[0], parts[0]], base=ViewRef(full_old.view_fp()), target=ViewRef(full_new.view_fp()))


@given(view_pairs())
def test_the_container_is_plain_safetensors_and_its_bytes_depend_only_on_the_patch(pair: tuple[dict, dict]) -> None:
    import safetensors.numpy

    patch, _ = diff_views(*pair)
    data = patch.to_bytes()
    assert Patch.from_bytes(data).to_bytes() == data  # same header and sections, same bytes (and BLAKE3)
    (hlen,) = np.frombuffer(data[:8], dtype="<u8")
    assert (8 + int(hlen)) % 8 == 0  # the data area starts 8-byte aligned, as safetensors writes it
    tensors = safetensors.numpy.load(data)  # any safetensors reader lists the sections
    for s in patch.sections:
        if s.name in tensors:
            assert tensors[s.name].tobytes() == bytes(patch.section_blob(s.name))


def test_a_file_writer_refuses_a_header_that_lists_other_sections() -> None:
    from flipsync.codec.container import PatchFileWriter

    old = {"a": torch.zeros(8, dtype=torch.bfloat16), "b": torch.zeros(8, dtype=torch.bfloat16)}
    new = {k: v + 1 for k, v in old.items()}
    patch, _ = diff_views(old, new)
    writer = PatchFileWriter()
    writer.add("b", patch.section_blob("b"))
    writer.add("a", patch.section_blob("a"))
    with pytest.raises(PatchError, match="does not list the sections that were laid out"):
        writer.finish(patch.header)
