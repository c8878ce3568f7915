"""Sharded training over torch.distributed: two spawned processes, gloo on loopback, bounded timeouts.

FSDP2 (DTensor row shards: each rank casts and diffs its own rows; fp8 gathers what it quantizes), DDP-style
replicas (tensors split between ranks), a non-finite weight in one rank's shard, and a rank that dies while
uploading its part. The parent then follows every run as a replica and checks it bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file
from trainer_dist_workers import run_ranks, scenarios
from trainer_helpers import Replica, assert_bitwise, versions_are_whole

from flipsync.board import open_store


def notes(workdir: Path, rank: int) -> dict:
    return json.loads((workdir / f"notes-{rank}.json").read_text())


def test_sharded_ranks_publish_versions_a_replica_applies_bitwise_and_survive_a_dead_rank(tmp_path: Path) -> None:
    assert run_ranks(scenarios, 2, tmp_path, timeout_s=170) == [0, 17]  # rank 1 dies in the last scenario
    store = open_store(tmp_path / "board")
    for run in ("fsdp-bf16", "fsdp-fp8", "ddp-nvfp4"):
        replica = Replica(store, run)
        assert replica.follow_each() == notes(tmp_path, 0)[run] == notes(tmp_path, 1)[run]
        assert_bitwise(load_file(tmp_path / f"{run}.safetensors"), replica.tensors)
        assert replica.patches and all(s.manifest.meta["ranks"] == 2 for s in replica.patches)
        if run == "fsdp-bf16":  # every rank diffs its own rows of every tensor: one part per rank
            assert all(len(s.manifest.parts) == 2 for s in replica.patches)
    # A NaN in rank 1's shard: rank 1 raised it, rank 0 heard of it, and no rank published that step.
    assert notes(tmp_path, 1)["nan"].startswith("NonFiniteError")
    assert notes(tmp_path, 0)["nan"].startswith("BoardError") and "rank 1: NonFiniteError" in notes(tmp_path, 0)["nan"]
    # Rank 1 died while uploading its part of v3: rank 0 says so, and readers stay at v2.
    seen = notes(tmp_path, 0)
    assert "failed" in seen["error"] and "not published" in seen["error"]
    assert versions_are_whole(store, "dying") == [0, 1, 2] and seen["head"] == 2
    assert Replica(store, "dying").follow_each() == 2
