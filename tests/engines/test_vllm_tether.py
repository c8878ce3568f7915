"""``flipsync.engines.vllm.tether``: a server started through it dies, its own children included, when the process
that started it is SIGKILLed (a demo island, a sidecar), with a fake long-running server in place of vLLM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flipsync.engines.vllm.tether import tethered

# A "server" that starts a child of its own (as vllm serve starts its engine core), writes both pids, and sleeps.
SERVER = textwrap.dedent(
    """
    import subprocess, sys, time
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{__import__('os').getpid()} {kid.pid}")
    __import__('os').replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
    """
)
# The process that launches it, in a session of its own as the demo's islands do; it is the one SIGKILLed.
PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    cmd = {cmd!r}
    subprocess.Popen(cmd, start_new_session=True)
    time.sleep(300)
    """
)


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a reaper the container may not have)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_for(path: Path, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"the fake server did not start within {timeout:g} s")
        time.sleep(0.05)
    return [int(x) for x in path.read_text().split()]


def gone_within(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def cleanup():
    pids: list[int] = []
    yield pids
    for p in pids:  # never leave the fake server behind, whatever the test found
        if alive(p):
            os.kill(p, signal.SIGKILL)


def test_a_sigkilled_launcher_takes_the_server_and_its_children_with_it(tmp_path: Path, cleanup) -> None:
    pids_file = tmp_path / "pids"
    cmd = tethered([sys.executable, "-c", SERVER, str(pids_file)], grace_s=2.0)
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(cmd=cmd)])
    server, kid = wait_for(pids_file)
    cleanup.extend([server, kid])
    assert alive(server) and alive(kid)
    parent.kill()  # SIGKILL: nothing of the launcher runs
    parent.wait()
    assert gone_within([server, kid], 15.0), "the server (or its child) outlived the process that started it"


def test_without_the_tether_the_server_is_orphaned(tmp_path: Path, cleanup) -> None:
    """What the demo did: the killed island's server kept running (the reason for the tether)."""
    pids_file = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(cmd=[sys.executable, "-c", SERVER, str(pids_file)])])
    server, kid = wait_for(pids_file)
    cleanup.extend([server, kid])
    parent.kill()
    parent.wait()
    assert not gone_within([server], 2.0)


def test_sigterm_stops_the_group_and_the_exit_status_passes_through(tmp_path: Path, cleanup) -> None:
    """The stop ends once the group has exited, not after the grace: the group's leader is a zombie until the
    launcher reaps it, and counted as alive every stop of a vLLM server waited out the whole grace (10 s)."""
    pids_file = tmp_path / "pids"
    tether = subprocess.Popen(tethered([sys.executable, "-c", SERVER, str(pids_file)], grace_s=60.0))
    server, kid = wait_for(pids_file)
    cleanup.extend([server, kid])
    tether.send_signal(signal.SIGTERM)
    assert tether.wait(timeout=20) == 128 + signal.SIGTERM, "the stop waited for the grace"
    assert gone_within([server, kid], 5.0)
    done = subprocess.run(tethered([sys.executable, "-c", "raise SystemExit(3)"]), timeout=60, check=False)
    assert done.returncode == 3


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path, cleanup) -> None:
    pids_file = tmp_path / "pids"
    stubborn = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + SERVER
    tether = subprocess.Popen(tethered([sys.executable, "-c", stubborn, str(pids_file)], grace_s=1.0))
    server, kid = wait_for(pids_file)
    cleanup.extend([server, kid])
    tether.send_signal(signal.SIGTERM)
    assert tether.wait(timeout=20) == 128 + signal.SIGTERM
    assert gone_within([server, kid], 5.0), "what ignored SIGTERM outlived the grace"
