"""``flipsync gateway`` and a fleet member ``flipsync sidecar --public-url`` as processes: the record on the
board, a request through the gateway, SIGTERM draining a request in flight (exit 0, record gone); and the
settings refused before anything starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from typer.testing import CliRunner

from flipsync.board.membership import MemberReader
from flipsync.cli.main import app
from flipsync.serving import free_port
from flipsync.stores import ObstoreStore
from tests.sidecar.sidecar_helpers import Trainer, stop_process, wait_until

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


def start(module: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT, env=ENV)


def test_sidecar_and_gateway_processes_drain_on_sigterm(store: ObstoreStore, board_dir: str, tmp_path: Path) -> None:
    trainer = Trainer(store)
    sp, gp = free_port(), free_port()
    side = start(
        "flipsync.cli.sidecar",
        [
            *("sidecar", "--board", board_dir, "--listen", f"127.0.0.1:{sp}", "--threads", "1", "--poll", "0.1"),
            *("--public-url", f"http://127.0.0.1:{sp}", "--island", "test", "--heartbeat", "0.3"),
            *("--member-ttl", "3", "--exit-timeout", "60"),
        ],
        tmp_path / "sidecar.log",
    )
    gw = start(
        "flipsync.cli.gateway",
        [
            *("gateway", "--board", board_dir, "--listen", f"127.0.0.1:{gp}", "--refresh", "0.2", "--max-lag", "0"),
            *("--hold", "5"),  # the request after the drain waits this long for a member before its 503
        ],
        tmp_path / "gateway.log",
    )
    gateway = f"http://127.0.0.1:{gp}"
    slow: dict[str, httpx.Response] = {}
    try:

        def ready() -> bool:
            assert side.poll() is None and gw.poll() is None, "a process exited early"
            try:
                return httpx.get(f"{gateway}/flipsync/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(ready, timeout=120, interval=0.2)
        records = MemberReader(store).scan().live
        assert [(r.replica, r.island, r.url) for r in records] == [
            (f"127.0.0.1-{sp}", "test", f"http://127.0.0.1:{sp}")
        ]
        trainer.step()
        status = f"http://127.0.0.1:{sp}/flipsync/status"
        # the first patch a fresh checkout stages compiles the codec's kernels (14 s seen on a loaded CI box):
        # wait for it here, so that the gateway's 5 s hold below only covers the heartbeat and the refresh
        assert wait_until(lambda: httpx.get(status, timeout=5).json()["version"] == 1, timeout=120, interval=0.2)
        r = httpx.post(  # held by the gateway until its view of the members says v1
            f"{gateway}/v1/completions",
            json={"prompt": "hi", "max_tokens": 3, "weight_version": {"min_version": 1}},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["weight_version"]["start"] == 1, r.text

        def long_request() -> None:
            slow["r"] = httpx.post(
                f"{gateway}/v1/completions", json={"prompt": "a", "max_tokens": 240, "ignore_eos": True}, timeout=120
            )

        worker = threading.Thread(target=long_request)
        worker.start()
        assert wait_until(lambda: httpx.get(status, timeout=5).json()["requests_in_flight"] == 1, timeout=30)
        side.send_signal(signal.SIGTERM)
        t = time.monotonic()
        worker.join(120)
        code = side.wait(60)
        assert code == 0, (tmp_path / "sidecar.log").read_text()
        assert slow["r"].status_code == 200, slow["r"].text
        assert len(slow["r"].json()["choices"][0]["token_versions"]) == 240
        assert time.monotonic() - t < 60
        assert not store.list("runs/run/members")  # it left the board
        assert wait_until(lambda: httpx.get(f"{gateway}/flipsync/health", timeout=5).status_code == 503)
        r = httpx.post(f"{gateway}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
    finally:
        codes = (stop_process(side), stop_process(gw))
    assert codes == (0, 0), (tmp_path / "gateway.log").read_text()


def test_settings_are_refused_before_anything_starts(board_dir: str) -> None:
    runner = CliRunner()
    for args, words in (
        (["gateway"], "either --board"),
        (["gateway", "--board", board_dir, "--replica", "http://127.0.0.1:9"], "either --board"),
        (["gateway", "--board", board_dir, "--listen", "nowhere"], "HOST:PORT"),
        (["gateway", "--board", board_dir, "--max-lag", "-1"], "--max-lag"),
        (["gateway", "--board", board_dir, "--refresh", "0"], "--refresh"),
        (["sidecar", "--board", board_dir, "--replica-id", "x"], "need --public-url"),
        (["sidecar", "--board", board_dir, "--public-url", "ftp://10.0.0.1:8100"], "http"),
        (["sidecar", "--board", board_dir, "--public-url", "http://10.0.0.1:8100", "--heartbeat", "20"], "below"),
        (["sidecar", "--board", board_dir, "--exit-timeout", "-1"], "--exit-timeout"),
        (["sidecar", "--board", "http://127.0.0.1:9", "--public-url", "http://10.0.0.1:8100"], "--fleet-board"),
    ):
        r = runner.invoke(app, args)
        assert r.exit_code == 2 and words in r.output, (args, r.output)
