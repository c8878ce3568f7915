"""A small launcher that ties a server's whole process tree to the process that started it:

    python -m flipsync.engines.vllm.tether [--grace S] -- COMMAND...

It runs ``COMMAND`` in a process group of its own and watches its own parent; when the parent is gone (a sidecar
or demo island SIGKILLed: nothing of it runs to stop its ``vllm serve``), or the launcher gets SIGTERM / SIGINT /
SIGHUP, it sends SIGTERM to the whole group, and SIGKILL to what is left after ``--grace`` seconds (vLLM's API
server, its engine core and its workers all die). It exits with the command's status when the command exits.

Why a watchdog rather than ``PR_SET_PDEATHSIG`` alone: Linux delivers that signal when the *thread* that forked
the child exits, so a server started from a short-lived thread would be killed at once; and it reaches only the
direct child, not vLLM's own children. The parent is polled (``--poll`` seconds, default 0.5).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from types import FrameType

_stop = False


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _stop
    _stop = True


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs. A zombie has exited: the group's leader before this launcher
    reaps it, an orphan of a container whose init never reaps. ``killpg(pgid, 0)`` counts both, so every stop
    waited out the whole grace (10 s a vLLM server). Without /proc, that is all there is to ask."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after the command name: state, ppid, pgrp, ...
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            return True
    return False


def _kill_group(pgid: int, grace_s: float) -> None:
    """SIGTERM to the group, then SIGKILL to whatever still runs after ``grace_s``."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def tethered(command: list[str], *, python: str | None = None, grace_s: float = 10.0) -> list[str]:
    """``command`` run under this launcher (with ``python``, default this interpreter): it dies with its parent."""
    return [python or sys.executable, "-m", "flipsync.engines.vllm.tether", "--grace", str(grace_s), "--", *command]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tether", description=__doc__.split("\n")[0])
    ap.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)")
    ap.add_argument("--poll", type=float, default=0.5, help="how often the parent is checked (default 0.5 s)")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command given")
    parent = os.getppid()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    child = subprocess.Popen(command, start_new_session=True)  # its own group: the whole tree is killed as one
    try:
        while True:
            try:
                code = child.wait(timeout=args.poll)
            except subprocess.TimeoutExpired:
                if _stop or os.getppid() != parent:  # asked to stop, or the parent died (we were re-parented)
                    _kill_group(child.pid, args.grace)
                    child.wait()
                    return 128 + signal.SIGTERM
                continue
            _kill_group(child.pid, args.grace)  # the command exited: its leftovers go too
            return code
    finally:
        if child.poll() is None:
            _kill_group(child.pid, args.grace)


if __name__ == "__main__":
    sys.exit(main())
