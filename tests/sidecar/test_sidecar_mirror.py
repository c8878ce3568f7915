"""A sidecar reading a board through flipsync.board.mirror.MirrorStore: its lag and fallbacks on /metrics,
and the CLI's --origin / --mirror-wait options. (The replication itself is tested in
tests/board/test_board_mirror.py with two moto buckets.)"""

from __future__ import annotations

import re

import httpx
from sidecar_helpers import FAST, Trainer, fast_replica, tiny_engine, wait_until
from typer.testing import CliRunner

from flipsync.board.mirror import MirrorPolicy, MirrorStore
from flipsync.board.store import open_store
from flipsync.sidecar.cli import sidecar_app
from flipsync.sidecar.openai_server import create_engine_app
from flipsync.sidecar.server import ServerThread
from flipsync.sidecar.service import Sidecar


def test_sidecar_exports_mirror_metrics(trainer: Trainer, board_dir: str) -> None:
    engine = tiny_engine()
    server = ServerThread(create_engine_app(engine, max_concurrency=2)).start()
    mirror = MirrorStore(open_store(board_dir, FAST), policy=MirrorPolicy(wait_s=1.0, poll_s=0.05))
    sidecar = Sidecar(mirror, "run", engine, server.url, replica_config=fast_replica())
    try:
        sidecar.start()
        trainer.step()
        assert wait_until(lambda: sidecar.replica.version == 1)
        text = httpx.get(sidecar.url + "/metrics", timeout=10).text
        manifests = re.search(r"^flipsync_mirror_manifests_total (\S+)$", text, re.M)
        lag = re.search(r"^flipsync_mirror_lag_seconds (\S+)$", text, re.M)
        assert manifests is not None and float(manifests.group(1)) >= 1
        assert lag is not None and float(lag.group(1)) >= 0  # -1 until a version manifest was read
        assert "flipsync_mirror_origin_reads_total 0.0" in text
    finally:
        sidecar.stop()
        server.stop()
        mirror.close()


def test_cli_checks_mirror_options(board_dir: str) -> None:
    runner = CliRunner()
    r = runner.invoke(sidecar_app, ["sidecar", "--board", board_dir, "--mirror-wait", "-1"])
    assert r.exit_code == 2 and "--mirror-wait" in r.output
    r = runner.invoke(sidecar_app, ["sidecar", "--board", board_dir, "--origin", board_dir, "--origin-option", "x"])
    assert r.exit_code == 2 and "key=value" in r.output
