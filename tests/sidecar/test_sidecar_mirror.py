"""A sidecar reading a board through flipsync.board.mirror.MirrorStore: its lag and fallbacks on /metrics,
and the CLI's --origin / --mirror-wait options. (The replication itself is tested in
tests/board/test_board_mirror.py with two moto buckets.)"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from typer.testing import CliRunner

from flipsync.board.mirror import MirrorPolicy, MirrorStore
from flipsync.cli.sidecar import sidecar_app
from flipsync.engines.torch.openai_server import create_engine_app
from flipsync.serving import ServerThread
from flipsync.sidecar.service import Sidecar
from flipsync.stores import ObstoreStore, open_store
from tests.sidecar.sidecar_helpers import FAST, Trainer, fast_replica, stop_process, tiny_engine, wait_until


def test_sidecar_exports_mirror_metrics(trainer: Trainer, board_dir: str) -> None:
    engine = tiny_engine()
    server = ServerThread(create_engine_app(engine, max_concurrency=2)).start()
    mirror = MirrorStore(open_store(board_dir, FAST), policy=MirrorPolicy(wait_s=1.0, poll_s=0.05))
    sidecar = Sidecar(mirror, "run", engine, server.url, replica_config=fast_replica())
    try:
        sidecar.start()
        # v1 is published once the sidecar holds v0: a lag sample is taken only for a manifest seen to appear
        # (missed at one look, there at a later one), and the kernel warm-up delays the first look.
        assert wait_until(lambda: sidecar.replica.version == 0, timeout=120)
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


def copy_manifests(origin: str, mirror: str) -> None:
    """A replicator that copies manifests and the HEAD hint but never a part."""
    for path in Path(origin).rglob("*.json"):
        dest = Path(mirror) / path.relative_to(origin)
        if not dest.exists() or path.name == "latest.json":
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m is not None, name
    return float(m.group(1))


def test_sidecar_cli_follows_a_mirror_that_lacks_every_part(
    store: ObstoreStore, board_dir: str, tmp_path: Path
) -> None:
    """`flipsync sidecar --board MIRROR --origin ORIGIN`: the mirror holds manifests only; every part is waited
    for (--mirror-wait), then read from the origin, and the engine still serves each version."""
    trainer = Trainer(store)
    mirror = str(tmp_path / "mirror")
    copy_manifests(board_dir, mirror)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = ["sidecar", "--board", mirror, "--origin", board_dir, "--mirror-wait", "0.2", "--poll", "0.1"]
    args += ["--listen", f"127.0.0.1:{port}", "--threads", "1"]
    log = tmp_path / "sidecar.log"
    with log.open("wb") as out:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "flipsync.cli.sidecar", *args], stdout=out, stderr=out, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{base}/flipsync/status", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        r = httpx.get(f"{base}/flipsync/wait", params={"min_version": 0, "timeout_s": 30}, timeout=40)
        assert r.status_code == 200, r.text
        trainer.step()
        copy_manifests(board_dir, mirror)
        r = httpx.get(f"{base}/flipsync/wait", params={"min_version": 1, "timeout_s": 30}, timeout=40)
        assert r.status_code == 200 and r.json()["version"] == 1
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["weight_version"] == {"start": 1, "end": 1}
        text = httpx.get(f"{base}/metrics", timeout=10).text
        # v1's patch came from the origin after a wait (the engine adopted v0: its preset's weights are v0's).
        assert metric(text, "flipsync_mirror_origin_reads_total") >= 1
        assert metric(text, "flipsync_mirror_waits_total") >= 1
        assert metric(text, "flipsync_mirror_manifests_total") >= 1  # v1's manifest appeared while it looked
    finally:
        stop_process(proc)
    assert proc.returncode == 0, log.read_text()
