"""The demo's ``vllm serve`` launcher: the server's whole process tree runs at the niceness it is given (the demo
lowers the islands' engines, not their sidecars, below the trainer), and a server that exits is reported."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from flipsync.errors import EngineError
from flipsync_apps.demo.vllm_server import VllmServer


@pytest.mark.parametrize("nice", [0, 10])
def test_the_server_tree_runs_at_the_niceness_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nice: int) -> None:
    # a stand-in for vLLM's interpreter: it writes the niceness it runs at, then exits as a failed server would
    fake = tmp_path / "python"
    record = tmp_path / "nice.txt"
    code = f"import os; open({str(record)!r}, 'w').write(str(os.nice(0))); raise SystemExit(3)"
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} -c "{code}"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("FLIPSYNC_VLLM_PYTHON", str(fake))
    (tmp_path / "model").mkdir()
    server = VllmServer(str(tmp_path / "model"), "island-x", nice=nice, start_timeout_s=60)
    with pytest.raises(EngineError, match="exited with 3"):
        server.start()
    server.stop()
    assert int(record.read_text()) == min(19, os.nice(0) + nice)
