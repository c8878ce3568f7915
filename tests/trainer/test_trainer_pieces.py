"""Row-shard pieces, the part chain of one version coded by the codec's PatchEncoder, and reading several parts
as one patch on a replica."""

from __future__ import annotations

from concurrent.futures import Executor, ThreadPoolExecutor

import pytest
import torch
from trainer_helpers import assert_bitwise

from flipsync.board.reader import PatchStep, join_step
from flipsync.codec import DiffEngine, Patch, PatchEncoder, apply_patch, diff_views
from flipsync.codec.fingerprint import FingerprintTable, Hasher
from flipsync.domain.headers import ViewRef
from flipsync.domain.manifest import Manifest, Part
from flipsync.errors import ConfigError, CorruptPatchError
from flipsync.trainer.pieces import Piece, dedupe_tied
from flipsync.trainer.rounds import assemble, check_tiling, merge_deltas, table_of_pieces
from tests.strategies import PART_HASH, patch_manifest


def patch_from_parts(parts: list[bytes], manifest: Manifest, table: FingerprintTable) -> Patch:
    return join_step(PatchStep(manifest, parts), table)


def views(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    old = {"w": torch.randn(11, 8, generator=g), "b": torch.randn(7, generator=g), "n": torch.randn(5, generator=g)}
    new = {
        k: v + 1e-2 * torch.randn(v.shape, generator=g) * (torch.rand(v.shape, generator=g) < 0.3)
        for k, v in old.items()
    }
    return {k: v.bfloat16() for k, v in old.items()}, {k: v.bfloat16() for k, v in new.items()}


def shard(view: dict[str, torch.Tensor], world: int) -> list[dict[str, Piece]]:
    """torch.chunk row shards (uneven; a rank may get none), "n" whole on the last rank."""
    out: list[dict[str, Piece]] = [{} for _ in range(world)]
    for name, t in view.items():
        if name == "n":
            out[-1][name] = Piece(t, 0, tuple(t.shape))
            continue
        start = 0
        for r, rows in enumerate(torch.chunk(t, world, dim=0)):
            out[r][name] = Piece(rows.contiguous(), start * (t.numel() // t.shape[0]), tuple(t.shape))
            start += rows.shape[0]
    return out


def parts_of(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], world: int, *, pool: Executor | None = None
) -> tuple[list[bytes], str, str]:
    """What the publisher does on each rank, done here rank by rank: the chain of parts of one version, each
    part's file streamed as its sections are coded (on ``pool``) and checked against the file it writes."""
    olds, news = shard(old, world), shard(new, world)
    with DiffEngine(1) as engine, Hasher(1) as hasher:
        specs = [{n: p.spec(n, r) for n, p in olds[r].items()} for r in range(world)]
        layout = check_tiling(specs)
        table = table_of_pieces(
            layout, [{n: hasher.fingerprint(p.tensor, p.offset) for n, p in v.items()} for v in olds]
        )
        encoders, streamed = [], []
        for r in range(world):
            data: list[bytes | memoryview] = []
            encoder = PatchEncoder(pool=pool, stream=data.append)
            for name in sorted(news[r]):
                a, b = olds[r][name], news[r][name]
                changes = engine.changes(a.tensor.contiguous(), b.tensor.contiguous())
                if changes.size:
                    digest = hasher.digest(b.tensor) if b.whole else None
                    encoder.add(name, b.shape, changes, dtype=b.dtype_name, offset=b.offset, digest=digest)
            encoders.append(encoder)
            streamed.append(data)
    deltas = [dict(e.deltas) for e in encoders]
    target = table.advanced(merge_deltas(deltas))
    with_parts = [r for r in range(world) if deltas[r]]
    parts = []
    for r in with_parts:
        before = table.advanced(merge_deltas(deltas[:r]))
        part = encoders[r].finish(
            base=ViewRef(before.view_fp(), 0 if r == with_parts[0] else None),
            target=ViewRef(before.advanced(deltas[r]).view_fp(), 1 if r == with_parts[-1] else None),
            served_format="bf16",
        )
        head, tail = encoders[r].file_ends()
        assert b"".join([head, *streamed[r], tail]) == part.to_bytes()  # streamed: the very file
        parts.append(part.to_bytes())
    assert target.view_fp() == FingerprintTable.of(new).view_fp()  # summed piece fingerprints = the real ones
    return parts, table.view_fp(), target.view_fp()


def manifest_of(n_parts: int, base_fp: str, target_fp: str) -> Manifest:
    """Version 1 of ``n_parts`` parts from ``base_fp`` to ``target_fp`` (the parts' bytes are not read here)."""
    parts = tuple(Part(f"p{i}", 1, PART_HASH) for i in range(n_parts))
    return patch_manifest(
        version=1, base_version=0, target_version=1, base_view_fp=base_fp, target_view_fp=target_fp, parts=parts
    )


@pytest.mark.parametrize("world", [1, 3, 16])  # 16 ranks: some hold no rows of "b" (7 rows)
def test_parts_of_row_shards_rebuild_the_new_view_bitwise(world: int) -> None:
    old, new = views()
    parts, base_fp, target_fp = parts_of(old, new, world)
    replica = {k: v.clone() for k, v in old.items()}
    table = FingerprintTable.of(replica)
    assert table.view_fp() == base_fp
    # the version as one patch (the chain squashed), what the engine port stages
    joined = patch_from_parts(parts, manifest_of(len(parts), base_fp, target_fp), table)
    assert (joined.header.base.view, joined.header.target.view) == (base_fp, target_fp)
    apply_patch(replica, joined, table, verify="digest")
    assert table.view_fp() == target_fp
    assert_bitwise(new, replica)


@pytest.mark.parametrize("world", [1, 3])
def test_sections_coded_on_a_pool_are_the_same_bytes(world: int) -> None:
    """The publisher codes pieces' sections side by side on a pool while it diffs the next ones: the parts must
    be the same files as when each is coded in turn, and stream in piece order however the pool finishes."""
    old, new = views(2)
    with ThreadPoolExecutor(4) as pool:
        early, base_fp, target_fp = parts_of(old, new, world, pool=pool)
    late, base_fp2, target_fp2 = parts_of(old, new, world)
    assert (base_fp, target_fp) == (base_fp2, target_fp2) and len(early) == len(late) == world
    assert early == late


def test_parts_out_of_order_are_refused_before_any_write() -> None:
    old, new = views(1)
    parts, base_fp, target_fp = parts_of(old, new, 2)
    assert len(parts) == 2
    replica = {k: v.clone() for k, v in old.items()}
    table = FingerprintTable.of(replica)
    with pytest.raises(CorruptPatchError, match="neither form a chain nor are shards"):
        patch_from_parts(parts[::-1], manifest_of(2, base_fp, target_fp), table)
    assert_bitwise(old, replica)


def test_overlapping_shards_are_refused_but_a_chain_squashes() -> None:
    a, b = views(2)
    c = {k: (v.float() + 1e-2).bfloat16() for k, v in b.items()}
    fps = [FingerprintTable.of(v).view_fp() for v in (a, b, c)]
    p1, _ = diff_views(a, b)
    p2, _ = diff_views(a, c)  # from the same base, touching the same tensors as p1: not disjoint shards
    replica = {k: v.clone() for k, v in a.items()}
    table = FingerprintTable.of(replica)
    with pytest.raises(CorruptPatchError, match="more than one shard"):
        patch_from_parts([p1.to_bytes(), p2.to_bytes()], manifest_of(2, fps[0], fps[2]), table)
    p2, _ = diff_views(b, c)  # the chain a -> b -> c touches the same elements twice, and squashes fine
    apply_patch(replica, patch_from_parts([p1.to_bytes(), p2.to_bytes()], manifest_of(2, fps[0], fps[2]), table), table)
    assert_bitwise(c, replica)


def test_tiling_errors_name_the_tensor() -> None:
    old, _ = views()
    pieces = shard(old, 2)
    specs = [{n: p.spec(n, r) for n, p in pieces[r].items()} for r in range(2)]
    del specs[1]["w"]
    with pytest.raises(ConfigError, match=r"pieces of tensor 'w' cover"):
        check_tiling(specs)
    specs = [{n: p.spec(n, r) for n, p in pieces[r].items()} for r in range(2)]
    specs[1]["b"] = specs[0]["b"]
    with pytest.raises(ConfigError, match="do not tile"):
        check_tiling(specs)


def test_assemble_puts_row_shards_back_together() -> None:
    old, _ = views()
    pieces = shard(old, 3)
    layout = check_tiling([{n: p.spec(n, r) for n, p in pieces[r].items()} for r in range(3)])
    full = assemble(layout, [{n: (p.offset, p.tensor) for n, p in v.items()} for v in pieces])
    assert_bitwise(old, full)


def test_tied_names_keep_the_checkpoint_name() -> None:
    shared = torch.zeros(4, 2)
    state = {"model.embed_tokens.weight": shared, "x": torch.ones(3), "lm_head.weight": shared}
    masters, aliases = dedupe_tied(state, {"lm_head.weight"})
    assert list(masters) == ["model.embed_tokens.weight", "x"]
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    masters, aliases = dedupe_tied({"lm_head.weight": shared, "model.embed_tokens.weight": shared}, {"lm_head.weight"})
    assert list(masters) == ["model.embed_tokens.weight"] and aliases == {"lm_head.weight": "model.embed_tokens.weight"}
