"""SIGKILL the publisher at random moments of publishing; the board must stay readable, lose nothing, and
a restarted publisher must resume from the newest manifest. A replica built from the board then holds,
bit for bit, the view of whatever HEAD the killed publisher left."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from flipsync.board.reader import BoardReader, KeyframeStep, PatchStep, join_step
from flipsync.codec import apply_patch
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.stores import open_store
from tests.reliability.kill_publisher import view_of
from tests.sidecar.sidecar_helpers import same_bits

CHILD = Path(__file__).with_name("kill_publisher.py")


def replica_at_head(board: str, run: str) -> tuple[int, dict[str, torch.Tensor]]:
    """Boot a replica from the board (keyframe, then patches) and return the version and view it holds."""
    reader = BoardReader(open_store(board), run)
    head = reader.head()
    assert head is not None
    tensors: dict[str, torch.Tensor] = {}
    table = FingerprintTable()
    version = None
    for step in reader.steps(reader.plan(None, head)):
        if isinstance(step, KeyframeStep):
            tensors = {k: v.clone() for k, v in step.tensors.items()}
            table = FingerprintTable.of(tensors)
        else:
            assert isinstance(step, PatchStep)
            apply_patch(tensors, join_step(step), table)
        assert table.view_fp() == step.target_view_fp
        version = step.target_version
    assert version == head
    return head, tensors


def test_publisher_killed_at_random_moments(tmp_path: Path) -> None:
    board, run = str(tmp_path / "board"), "killed"
    rng = random.Random(7)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    heads = []
    for _ in range(6):
        child = subprocess.Popen([sys.executable, str(CHILD), board, run, "100000"], env=env, stdout=subprocess.PIPE)
        assert child.stdout is not None
        child.stdout.readline()  # it published at least one version in this life
        time.sleep(rng.uniform(0.0, 0.4))
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        head, view = replica_at_head(board, run)
        assert same_bits(view, view_of(head))  # the board is whole: HEAD is exactly what was published
        heads.append(head)
    assert heads == sorted(heads) and heads[-1] > heads[0]  # each restart resumed from the newest manifest
    # a last, clean life publishes a few more versions on top of whatever the kills left
    target = heads[-1] + 3
    subprocess.run(
        [sys.executable, str(CHILD), board, run, str(target)], env=env, check=True, timeout=120, capture_output=True
    )
    head, view = replica_at_head(board, run)
    assert head == target and same_bits(view, view_of(target))
