"""The slime / miles post-write hook on directories laid out exactly as their disk weight sync writes them.

`slime_version_dir` writes what slime's ``UpdateWeightFromDiskDelta._write_delta_files`` (and miles' copy of
it) writes for one sync: the changed tensors' zstd-compressed byte diffs split over one
``model-{offset:05d}-of-{total:05d}.safetensors`` per writing rank (numbered from 0 across the ranks that
have changes), each file's metadata the new bytes' checksums, and rank 0's index with the version metadata.
"""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from flipsync.board import open_store
from flipsync.board.catalog import Catalog
from flipsync.errors import ConfigError, IntegrityError
from flipsync.integrations.slime import SlimePublisher, slime_checksum
from tests.integrations.slime_layout import hf_checkpoint, slime_checksum_ref, slime_version_dir, weights_after
from tests.trainer.trainer_helpers import Replica, assert_bitwise, tiny_llama


@pytest.mark.parametrize(("encoding", "checksum"), [("xor", "xxh3-128"), ("overwrite", "blake3"), ("xor", "adler32")])
def test_the_hook_publishes_every_slime_delta_version_bitwise(tmp_path: Path, encoding: str, checksum: str) -> None:
    views = weights_after(tiny_llama(tie=False), 3)
    base = hf_checkpoint(tmp_path / "hf", views[0])
    delta_dir = tmp_path / "delta"
    delta_dir.mkdir()
    store = open_store(tmp_path / "board")
    hook = SlimePublisher(store, run="slime")
    args = Namespace(hf_checkpoint=str(base))
    hook(args, str(delta_dir), [])  # slime's baseline call: the stream starts from the HF checkpoint
    replica = Replica(store, "slime")
    replica.follow_each()
    assert_bitwise(views[0], replica.tensors)
    for v in (1, 2, 3):
        vdir = slime_version_dir(delta_dir, v, views[v - 1], views[v], encoding=encoding, checksum=checksum)
        hook(args, str(vdir), [])
        assert replica.follow_each() == v
        assert_bitwise(views[v], replica.tensors)
    hook.close()
    cat = Catalog(store, "slime")
    assert [cat.version(v).meta["step"] for v in range(4)] == [0, 1, 2, 3]
    assert [cat.version(v).meta["source"] for v in (1, 2, 3)] == ["weight_v000001", "weight_v000002", "weight_v000003"]


def test_a_damaged_or_out_of_order_version_publishes_nothing(tmp_path: Path) -> None:
    views = weights_after(tiny_llama(tie=False), 3)
    base = hf_checkpoint(tmp_path / "hf", views[0])
    store = open_store(tmp_path / "board")
    hook = SlimePublisher(store, run="bad", base=base)
    hook(Namespace(), str(tmp_path / "delta"), [])
    # version 2 before version 1: applies to a base the hook does not hold
    v2 = slime_version_dir(tmp_path / "delta", 2, views[1], views[2])
    with pytest.raises(IntegrityError, match="out of order"):
        hook(Namespace(), str(v2), [])
    # a diff made against other weights: decodes to bytes whose checksum fails; nothing is applied
    v1 = slime_version_dir(tmp_path / "delta", 1, views[2], views[1])
    with pytest.raises(IntegrityError, match="checksum"):
        hook(Namespace(), str(v1), [])
    assert_bitwise(views[0], hook.held or {})
    assert Catalog(store, "bad").version(0).meta["step"] == 0
    hook.close()


def test_full_disk_syncs_are_published_as_they_are(tmp_path: Path) -> None:
    views = weights_after(tiny_llama(tie=False), 2)
    store = open_store(tmp_path / "board")
    hook = SlimePublisher(store, run="full")
    replica = Replica(store, "full")
    for v in (1, 2, 3):  # --update-weight-mode full: every weight_vNNNNNN/ is a whole HF checkpoint
        vdir = hf_checkpoint(tmp_path / f"weight_v{v:06d}", views[v - 1], shards=2)
        hook(Namespace(), str(vdir), [])
        replica.follow_each()
        assert_bitwise(views[v - 1], replica.tensors)
    hook.close()
    assert [Catalog(store, "full").version(v).meta["step"] for v in range(3)] == [1, 2, 3]


def test_a_delta_before_the_stream_start_is_refused(tmp_path: Path) -> None:
    views = weights_after(tiny_llama(tie=False), 1)
    hook = SlimePublisher(open_store(tmp_path / "board"), run="r")
    vdir = slime_version_dir(tmp_path / "delta", 1, views[0], views[1])
    with pytest.raises(ConfigError, match="stream's start"):
        hook(Namespace(), str(vdir), [])
    with pytest.raises(ConfigError, match="hf-checkpoint"):
        hook(Namespace(), str(tmp_path / "delta"), [])


@pytest.mark.parametrize("algorithm", ["xxh3-128", "blake3", "adler32"])
def test_checksums_are_slimes(algorithm: str) -> None:
    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8)
    assert slime_checksum(algorithm, data) == slime_checksum_ref(algorithm, data)
    with pytest.raises(ConfigError):
        slime_checksum("md5", data)
