"""A randomized schedule of store faults on both sides of the board, checked against the promise:

a replica never serves weights that were not published, never reports a version it does not hold bitwise,
and converges to HEAD once the faults are gone; the board loses and overwrites nothing.

The trainer publishes real patches of a tiny model through one faulty store (failed and torn writes,
delays); a sidecar replica with a real torch engine follows through another (failed, delayed, corrupted
and stale reads). ``FLIPSYNC_FAULT_ITERATIONS`` sets the length (CI runs a few dozen per seed; the slow
marker runs hundreds).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from flipsync.board.reader import BoardReader
from flipsync.board.store import open_store
from flipsync.errors import FlipsyncError
from flipsync.sidecar.replica import Replica
from tests.reliability.faults import FaultRates, FaultyStore
from tests.sidecar.sidecar_helpers import Trainer, fast_replica, same_bits, tiny_engine

WRITE_FAULTS = FaultRates(fail=0.15, delay=0.1, torn=0.1)
READ_FAULTS = FaultRates(fail=0.1, delay=0.1, corrupt=0.05, stale=0.1)


def run_schedule(tmp_path: Path, seed: int, iterations: int) -> dict[str, int]:
    board = open_store(tmp_path / "board")
    trainer_store = FaultyStore(board, WRITE_FAULTS, seed)
    trainer_store.enabled = False  # v0 lands whole: a replica needs a first keyframe
    trainer = Trainer(trainer_store, run="faults")
    trainer_store.enabled = True
    reader_store = FaultyStore(open_store(tmp_path / "board"), READ_FAULTS, seed + 1)
    engine = tiny_engine()
    replica = Replica(BoardReader(reader_store, "faults"), engine, config=fast_replica())
    published_fps = set(trainer.fps.values())
    stats = {"published": 0, "publish_failures": 0, "syncs": 0, "sync_failures": 0, "audits": 0}
    rng = random.Random(seed)
    for i in range(iterations):
        if rng.random() < 0.5:
            try:
                trainer.step(lr=0.05, fraction=0.03)
                stats["published"] += 1
            except FlipsyncError:
                # the version was not published; the next step diffs from the last published view
                stats["publish_failures"] += 1
            published_fps = set(trainer.fps.values())
        ok = replica.sync_once()
        stats["syncs"] += 1
        stats["sync_failures"] += not ok
        v = replica.version
        if v is not None:
            # never reports a version it does not hold: the engine's fingerprints are the version's
            assert replica.view_fp == trainer.fps[v]
            assert engine.table.view_fp() == trainer.fps[v]
            if i % 7 == 0:
                assert engine.recompute_table().view_fp() == trainer.fps[v]  # O(size) audit of the weights
                stats["audits"] += 1
        # never serves unpublished weights: whatever the engine holds while serving was published
        if replica.version is not None:
            assert engine.table.view_fp() in published_fps
    # the faults go away: the replica converges to HEAD and holds it bit for bit
    trainer_store.enabled = reader_store.enabled = False
    for _ in range(50):
        if replica.sync_once() and replica.version == trainer.version:
            break
    assert replica.version == trainer.version
    assert same_bits(engine.served, trainer.view)
    # the board lost nothing and nothing was overwritten: every version reads back and verifies
    check = BoardReader(board, "faults")
    assert check.head() == trainer.version
    for v in range(1, trainer.version + 1):
        m = check.catalog.version(v)
        assert m.target_view_fp == trainer.fps[v]
        check.catalog.fetch_parts(m, check.catalog.artifact_dir(m))  # sizes and BLAKE3 hashes
    stats.update({f"injected_{k}": n for k, n in (trainer_store.counts + reader_store.counts).items()})
    return stats


ITERATIONS = int(os.environ.get("FLIPSYNC_FAULT_ITERATIONS", "40"))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fault_schedule(tmp_path: Path, seed: int) -> None:
    stats = run_schedule(tmp_path, seed, ITERATIONS)
    assert stats["published"] > 0 and stats["publish_failures"] > 0 and stats["sync_failures"] > 0
    print(f"seed {seed}: {stats}")


@pytest.mark.slow
def test_long_fault_schedule(tmp_path: Path) -> None:
    stats = run_schedule(tmp_path, 99, 400)
    print(f"seed 99: {stats}")
