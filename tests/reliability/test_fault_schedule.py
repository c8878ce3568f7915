"""A randomized schedule of store faults on both sides of the board, checked against the promise:

a replica never serves weights that were not published, never reports a version it does not hold bitwise,
and converges to HEAD once the faults are gone; the board loses and overwrites nothing.

The trainer publishes real patches of a tiny model through one faulty store (failed and torn writes,
delays); a sidecar replica with a real torch engine follows through another (failed, delayed, corrupted
and stale reads). ``FLIPSYNC_FAULT_ITERATIONS`` sets the length (CI runs a few dozen per seed; the slow
marker runs hundreds).

A second schedule, ``run_startup_schedule``, races a background trainer `Publisher`'s start-up against its first
steps (the initial snapshot is taken on the publisher's thread while training goes on) under CPU contention:
busy neighbour processes, store delays, steps right away or a moment later, through ``step()`` or the
optimizer hook. Every version must hold exactly the weights its manifest's ``meta.step`` names, and v0 must
be step 0, the initial weights, in every run.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from flipsync.board.reader import BoardReader
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.errors import FlipsyncError
from flipsync.formats import served_view
from flipsync.sidecar.replica import Replica
from flipsync.stores import open_store
from flipsync.trainer import Publisher as TrainerPublisher
from flipsync.trainer import PublisherConfig
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


# -- publisher start-up racing the first steps ------------------------------------------------------------

STARTUP_DELAYS = FaultRates(delay=0.3, delay_s=0.005)


@contextmanager
def busy_neighbours(n: int) -> Iterator[None]:
    """``n`` CPU-bound processes at the lowest priority: they starve the publisher's niced threads (as other
    background work on a trainer's node would), not the training thread."""
    spin = "import os\nos.nice(19)\nwhile True: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def view_fp(model: torch.nn.Module) -> str:
    return FingerprintTable.of(served_view(model.state_dict(), "bf16")).view_fp()


def startup_run(board: Path, rng: random.Random, seed: int) -> tuple[list[str], int]:
    """One run: a publisher starts and the trainer steps at once (or nearly); the problems found, versions."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hook = rng.random() < 0.25  # the optimizer hook (view computed on its own thread) or explicit step()
    steps = rng.randint(1, 3)
    pause = rng.choice([0.0, 0.0, 0.0, 0.0, 0.001])  # most runs step at once, the tightest race
    store = FaultyStore(open_store(board), STARTUP_DELAYS, seed)
    fps = {0: view_fp(model)}
    pub = TrainerPublisher(
        model, store, run="startup", optimizer=opt if hook else None, config=PublisherConfig(spans=False)
    )
    try:
        if pause:  # (even sleep(0) would hand the publisher's thread the core)
            time.sleep(pause)
        for step in range(1, steps + 1):
            model(torch.ones(2, 32)).square().sum().backward()
            opt.step()
            opt.zero_grad()
            if not hook:
                pub.step()
            fps[step] = view_fp(model)
    finally:
        pub.close()
    reader = BoardReader(open_store(board), "startup")
    head = reader.head()
    assert head is not None
    problems: list[str] = []
    covered = 0
    for v in range(head + 1):
        m = reader.catalog.version(v)
        step = int(m.meta["step"])
        covered += int(m.meta.get("steps", 1))
        if v == 0 and step != 0:
            problems.append(f"v0 holds step {step}, not the initial weights")
        if m.target_view_fp != fps.get(step):
            problems.append(f"v{v} says step {step} but holds other weights")
    if covered != steps + 1:
        problems.append(f"versions cover {covered} steps of {steps + 1}")
    return problems, head + 1


def run_startup_schedule(tmp_path: Path, seed: int, runs: int, neighbours: int = 2) -> dict[str, int]:
    rng = random.Random(seed)
    stats = {"runs": 0, "versions": 0, "bad_runs": 0}
    problems: list[str] = []
    with busy_neighbours(neighbours):
        for i in range(runs):
            found, versions = startup_run(tmp_path / f"board-{i}", rng, seed * 1000 + i)
            stats["runs"] += 1
            stats["versions"] += versions
            stats["bad_runs"] += bool(found)
            problems += [f"run {i}: {p}" for p in found]
    print(f"start-up seed {seed}: {stats}")
    assert not problems, problems
    return stats


STARTUP_RUNS = int(os.environ.get("FLIPSYNC_STARTUP_RUNS", "12"))


def test_publisher_start_up_racing_the_first_steps(tmp_path: Path) -> None:
    run_startup_schedule(tmp_path, 7, STARTUP_RUNS)


@pytest.mark.slow
def test_long_publisher_start_up_schedule(tmp_path: Path) -> None:
    run_startup_schedule(tmp_path, 99, 200)
