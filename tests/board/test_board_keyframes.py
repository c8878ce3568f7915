"""Keyframes: sharded plain safetensors with an HF-style index, loadable as a checkpoint folder, and read
back bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
from board_helpers import backend_params, fp, small_view
from safetensors.torch import load_file

from flipsync.board.keyframes import INDEX_NAME, iter_keyframe_files, plan_shards, tensors_from_files
from flipsync.board.reader import BoardReader
from flipsync.board.writer import BoardWriter
from flipsync.errors import ConfigError, IntegrityError
from flipsync.stores import ObstoreStore


def view() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(64, 64, generator=g).to(torch.bfloat16)
    return {
        "embed.weight": embed,  # 8 KiB
        "layers.0.q.weight": torch.randn(32, 64, generator=g).to(torch.float8_e4m3fn),  # fp8 payload
        "layers.0.q.scale": torch.rand(32, 1, generator=g),
        "layers.0.packed": torch.randint(0, 255, (32, 32), generator=g, dtype=torch.uint8),  # fp4 pairs
        "tied.view": embed[:8],  # a view of another tensor's storage
        "norm.weight": torch.ones(64, dtype=torch.bfloat16),
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_shards_and_index() -> None:
    t = view()
    files = dict(iter_keyframe_files(t, max_shard_bytes=6000))
    shards = sorted(n for n in files if n != INDEX_NAME)
    n = len(shards)
    assert n >= 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads(files[INDEX_NAME])
    assert set(index["weight_map"]) == set(t)
    assert index["metadata"]["total_size"] == sum(x.numel() * x.element_size() for x in t.values())
    back = tensors_from_files(files)
    assert list(back) == list(t)
    assert all(same(back[k], t[k].contiguous()) for k in t)
    one = dict(iter_keyframe_files(t, max_shard_bytes=1 << 20))  # aliases in one shard get their own copy
    assert sorted(one) == sorted([INDEX_NAME, "model-00001-of-00001.safetensors"])
    assert all(same(tensors_from_files(one)[k], t[k]) for k in t)
    # One tensor larger than the limit gets a shard of its own; order is kept.
    assert plan_shards({"a": torch.zeros(10), "b": torch.zeros(1000), "c": torch.zeros(1)}, 100) == [
        ["a"],
        ["b"],
        ["c"],
    ]
    with pytest.raises(ConfigError):
        list(iter_keyframe_files({}, 100))


def test_damaged_keyframe_files_are_refused() -> None:
    files = dict(iter_keyframe_files(view(), max_shard_bytes=6000))
    shard = next(n for n in files if n != INDEX_NAME)
    with pytest.raises(IntegrityError, match="not a valid safetensors"):
        tensors_from_files({**files, shard: b"\x00" * 100})
    with pytest.raises(IntegrityError, match="not among its parts"):
        tensors_from_files({k: v for k, v in files.items() if k != shard})
    with pytest.raises(IntegrityError, match="weight_map"):
        tensors_from_files({**files, INDEX_NAME: b'{"weight_map": 3}'})
    with pytest.raises(IntegrityError, match="has no"):
        tensors_from_files({shard: files[shard]})


@pytest.mark.parametrize("store_factory", backend_params("file", "s3", "azure"), indirect=True)
def test_keyframe_round_trip_on_a_board(store: ObstoreStore) -> None:
    t = view()
    pub = BoardWriter(store, "run", publisher_id="t", max_shard_bytes=6000)
    snap = pub.publish_snapshot(t, version=0, view_fp=fp(0), served_format="fp8")
    assert len(snap.parts) >= 3 and snap.meta["tensors"] == len(t)
    reader = BoardReader(store, "run")
    back = reader.load_keyframe()
    assert list(back) == list(t) and all(same(back[k], t[k].contiguous()) for k in t)
    assert all(same(a, b) for a, b in zip(reader.load_keyframe(0).values(), back.values(), strict=True))


def test_keyframe_folder_loads_as_a_checkpoint(store: ObstoreStore) -> None:
    """An engine reads the index, then each shard with a plain safetensors loader."""
    t = small_view(3)
    pub = BoardWriter(store, "run", publisher_id="t", max_shard_bytes=4096)
    pub.publish_snapshot(small_view(0), version=0, view_fp=fp(0), served_format="bf16")
    pub.publish_patch(
        [b"p"], base_version=0, target_version=1, base_view_fp=fp(0), target_view_fp=fp(1), served_format="bf16"
    )
    m = pub.publish_keyframe(t, version=1, view_fp=fp(1), served_format="bf16")
    reader = BoardReader(store, "run")
    assert reader.newest_keyframe().version == 1
    folder = Path(urlparse(reader.checkpoint_location(m)).path)
    index = json.loads((folder / INDEX_NAME).read_text())
    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(folder / shard))
    assert set(loaded) == set(t) and all(same(loaded[k], t[k]) for k in t)
