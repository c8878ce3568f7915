"""``flipsync sidecar`` and ``flipsync relay`` as processes: a sidecar reading a board through a relay."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from flipsync.cli.sidecar import sidecar_app
from flipsync.serving import free_port
from flipsync.stores import ObstoreStore
from tests.sidecar.sidecar_helpers import Trainer, stop_process


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        module = "flipsync.cli.relay" if args[0] == "relay" else "flipsync.cli.sidecar"
        return subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT, env=env)


def _wait_http(url: str, timeout: float, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, "a process exited early"
        try:
            if httpx.get(url, timeout=1).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def _wait_log(log: Path, text: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"the process exited early: {log.read_text(errors='replace')[-2000:]}"
        assert time.monotonic() < deadline, f"{text!r} not in {log} after {timeout} s"
        time.sleep(0.1)


def test_sidecar_through_a_relay_end_to_end(store: ObstoreStore, board_dir: str, tmp_path: Path) -> None:
    """The sidecar starts before its relay (as containers of one pod may): it waits for the relay, then follows."""
    trainer = Trainer(store)
    relay_port, proxy_port = free_port(), free_port()
    side = _start(
        [
            "sidecar",
            "--board",
            f"http://127.0.0.1:{relay_port}",
            "--listen",
            f"127.0.0.1:{proxy_port}",
            "--poll",
            "0.1",
            "--threads",
            "1",
            "--commit-mode",
            "quiesce",
        ],
        tmp_path / "sidecar.log",
    )
    base = f"http://127.0.0.1:{proxy_port}"
    relay = None
    try:
        _wait_log(tmp_path / "sidecar.log", "cannot be read yet", 90, side)
        relay = _start(["relay", "--board", board_dir, "--listen", f"127.0.0.1:{relay_port}"], tmp_path / "relay.log")
        _wait_http(f"http://127.0.0.1:{relay_port}/health", 60, [relay])
        _wait_http(f"{base}/flipsync/status", 90, [side])
        r = httpx.get(f"{base}/flipsync/wait", params={"min_version": 0, "timeout_s": 30}, timeout=40)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["weight_version"] == {"start": 0, "end": 0}
        trainer.step()
        r = httpx.get(f"{base}/flipsync/wait", params={"min_version": 1, "timeout_s": 30}, timeout=40)
        assert r.status_code == 200 and r.json()["version"] == 1
        st = httpx.get(f"{base}/flipsync/status", timeout=10).json()
        assert st["commit_mode"] == "quiesce" and st["engine"]["name"] == "torch"
        stats = httpx.get(f"http://127.0.0.1:{relay_port}/relay/stats", timeout=10).json()
        assert stats["upstream"] > 0 and stats["board"].startswith("file://")
    finally:
        codes = (stop_process(side), stop_process(relay) if relay is not None else None)
    logs = "".join(f.read_text() for f in (tmp_path / "sidecar.log", tmp_path / "relay.log") if f.exists())
    assert codes == (0, 0), logs


def test_a_board_still_unreachable_after_the_wait_timeout_is_an_error() -> None:
    args = ["sidecar", "--board", f"http://127.0.0.1:{free_port()}", "--wait-timeout", "1", "--poll", "0.1"]
    t = time.monotonic()
    r = CliRunner().invoke(sidecar_app, args)
    assert r.exit_code == 2 and "check that the relay is running" in r.output, r.output
    assert 1 <= time.monotonic() - t < 30  # waited, then gave up


def test_cli_refuses_bad_settings(board_dir: str, store: ObstoreStore) -> None:
    runner = CliRunner()
    r = runner.invoke(sidecar_app, ["sidecar", "--board", board_dir, "--listen", "nowhere"])
    assert r.exit_code == 2 and "HOST:PORT" in r.output
    r = runner.invoke(sidecar_app, ["sidecar", "--board", board_dir, "--engine", "tpu"])
    assert r.exit_code == 2 and "unknown engine" in r.output
    r = runner.invoke(sidecar_app, ["sidecar", "--board", board_dir, "--listen", "127.0.0.1:0"])
    assert r.exit_code == 2 and "no run" in r.output  # an empty board
    Trainer(store)
    r = runner.invoke(sidecar_app, ["sidecar", "--board", board_dir, "--engine", "vllm"])
    assert r.exit_code == 2 and "--upstream" in r.output
    up = ["--upstream", "http://127.0.0.1:9"]
    r = runner.invoke(sidecar_app, ["sidecar", "--board", board_dir, "--engine", "vllm", *up])
    assert r.exit_code == 2 and "model_dir" in r.output
    r = runner.invoke(sidecar_app, ["sidecar", "--board", board_dir, "--engine", "sglang", *up])
    assert r.exit_code == 2 and "host_copy" in r.output


def test_arguments_are_checked_before_the_heavy_imports(board_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # An import of the engines' module (torch, transformers, uvicorn) would fail: a typo is answered first.
    monkeypatch.setitem(sys.modules, "flipsync.sidecar.service", None)
    runner = CliRunner()
    r = runner.invoke(sidecar_app, ["sidecar", "--board", board_dir, "--engine", "tensorrt"])
    assert r.exit_code == 2 and "unknown engine 'tensorrt'" in r.output, r.output
    r = runner.invoke(sidecar_app, ["sidecar", "--board", board_dir, "--engine", "vllm"])
    assert r.exit_code == 2 and "--upstream" in r.output, r.output
    r = runner.invoke(sidecar_app, ["sidecar", "--board", board_dir, "--engine-listen", "nowhere"])
    assert r.exit_code == 2 and "HOST:PORT" in r.output, r.output


def test_format_is_checked_against_the_first_manifest(store: ObstoreStore, board_dir: str) -> None:
    """A run with no version yet is waited for; its first manifest's format is then checked, not assumed."""
    Trainer(store, run="other")
    publish = threading.Timer(0.5, lambda: Trainer(store, run="later", fmt="fp8-block"))
    publish.start()
    try:
        args = ["sidecar", "--board", board_dir, "--run", "later", "--format", "bf16", "--poll", "0.05"]
        r = CliRunner().invoke(sidecar_app, [*args, "--wait-timeout", "60"])
    finally:
        publish.join()
    out = " ".join(r.output.split())
    assert r.exit_code == 2, out
    assert "--format bf16 does not match run 'later'" in out and "serves fp8-block" in out, out


def test_waiting_for_a_missing_run_names_the_runs_there(store: ObstoreStore, caplog: pytest.LogCaptureFixture) -> None:
    from flipsync.board.reader import BoardReader
    from flipsync.errors import ConfigError
    from flipsync.sidecar.service import wait_for_format

    Trainer(store, run="r1")
    reader = BoardReader(store, "r7")
    with caplog.at_level(logging.WARNING), pytest.raises(ConfigError, match="gave up waiting"):
        wait_for_format(reader, poll_s=0.01, timeout_s=0.1)
    assert "run 'r7' does not exist" in caplog.text and "the runs there are: r1" in caplog.text
    assert "waiting for its first version" in caplog.text
    assert wait_for_format(BoardReader(store, "r1"), poll_s=0.01, timeout_s=0) == "bf16"
