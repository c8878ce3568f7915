"""docs/sidecar.md's trainer + torch sidecar example, run as the doc writes it (so the two cannot drift).

The ``trainer.py`` block is written to a file and run; the shell block after it is run line by line: the
trainer, ``flipsync sidecar`` as a process (on a free port instead of 8100), and each ``curl`` as the same
HTTP request. The sidecar must reach the trainer's HEAD holding its view, and answer on it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from flipsync.board.reader import BoardReader
from flipsync.serving import free_port
from flipsync.stores import open_store
from tests.sidecar.sidecar_helpers import stop_process

DOC = Path(__file__).resolve().parents[2] / "docs" / "sidecar.md"


def doc_blocks() -> tuple[str, list[str]]:
    """The ``trainer.py`` block and the shell lines of the block right after it."""
    blocks = re.findall(r"```(\w*)\n(.*?)```", DOC.read_text(), flags=re.S)
    at = next(i for i, (lang, body) in enumerate(blocks) if lang == "python" and body.startswith("# trainer.py"))
    lang, shell = blocks[at + 1]
    assert lang == "bash"
    lines = shell.replace("\\\n", " ").splitlines()
    return blocks[at][1], [line for line in lines if line.strip()]


def curl(line: str, port: int) -> httpx.Response:
    """Send what a ``curl -s URL [-H header] [-d body]`` line sends."""
    words = shlex.split(line, comments=True)[1:]
    url, headers, body = None, {}, None
    while words:
        w = words.pop(0)
        if w == "-H":
            k, _, v = words.pop(0).partition(":")
            headers[k.strip()] = v.strip()
        elif w == "-d":
            body = words.pop(0)
        elif not w.startswith("-"):
            url = "http://" + w.replace("127.0.0.1:8100", f"127.0.0.1:{port}")
    assert url is not None, line
    if body is None:
        return httpx.get(url, timeout=180)
    return httpx.post(url, content=body, headers=headers, timeout=180)


def test_the_trainer_and_sidecar_example_runs_as_written(tmp_path: Path) -> None:
    trainer, shell = doc_blocks()
    (tmp_path / "trainer.py").write_text(trainer)
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    sidecar: subprocess.Popen[bytes] | None = None
    answers: list[httpx.Response] = []
    head = None
    try:
        for line in shell:
            words = shlex.split(line, comments=True)
            if words[:2] == ["python", "trainer.py"]:
                out = subprocess.run(
                    [sys.executable, *words[1:]], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
                )
                assert out.returncode == 0, out.stderr
                head = int(re.search(r"HEAD is v(\d+)", out.stdout).group(1))  # type: ignore[union-attr]
            elif words[0] == "flipsync":
                assert words[1] == "sidecar" and words[-1] == "&"
                args = [w.replace("127.0.0.1:8100", f"127.0.0.1:{port}") for w in words[1:-1]]
                with (tmp_path / "sidecar.log").open("wb") as log:
                    sidecar = subprocess.Popen(
                        [sys.executable, "-m", "flipsync.cli.main", *args],
                        cwd=tmp_path,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                wait_listening(port, sidecar, tmp_path / "sidecar.log")
            elif words[0] == "curl":
                answers.append(curl(line, port))
            else:
                pytest.fail(f"the example has a line this test does not know how to run: {line}")
        assert head is not None and head >= 1 and sidecar is not None
        waited, completion = answers
        assert waited.status_code == 200 and waited.json()["satisfied"], waited.text
        assert completion.status_code == 200, completion.text
        stamp = completion.json()["weight_version"]
        assert 1 <= stamp["start"] <= stamp["end"] <= head
        # The sidecar reaches the trainer's HEAD and holds exactly the view its manifest names.
        want = BoardReader(open_store(tmp_path / "board"), "demo-run").catalog.version(head).target_view_fp
        status = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = httpx.get(f"http://127.0.0.1:{port}/flipsync/status", timeout=30).json()
            if status["version"] == head:
                break
            time.sleep(0.2)
        assert status["version"] == head and status["view_fp"] == want, status
    finally:
        if sidecar is not None:
            stop_process(sidecar, 20)


def wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the sidecar exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/flipsync/status", timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    pytest.fail(f"the sidecar did not listen within {timeout_s} s: {log.read_text()[-2000:]}")
