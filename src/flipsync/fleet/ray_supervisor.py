"""The body of the Ray actors a `RayPool` places (``flipsync.fleet.ray_pool``): one process, supervised.

A `ProcessSupervisor` runs one command (``flipsync sidecar ...`` for a replica, ``flipsync gateway ...`` for
the cluster's gateway) on the node Ray placed it on, restarts it with a backoff when it dies, and stops it
with SIGTERM (a sidecar drains: it leaves the fleet, its requests in flight finish) when asked. The process
dies with the actor (PR_SET_PDEATHSIG): a node that is lost takes its replicas with it, as a real machine
would, and Ray restarts the actor on a node with room, which starts a new process there.

This module imports no Ray: Ray wraps the class (``ray.remote(ProcessSupervisor)``) where it is placed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flipsync.serving import free_port

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
LOG_TAIL_LINES = 200


def node_address() -> str:
    """The address other nodes reach this one at: the Ray node's IP when inside Ray, else loopback."""
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:  # outside Ray (unit use): loopback is the only honest answer
        return "127.0.0.1"


def _die_with_parent() -> None:
    # Runs in the child between fork and exec. A signal mask and ignored signals survive exec, and a Ray worker's
    # threads may block or ignore SIGTERM: without this a sidecar could not be drained.
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    # SIGKILL it when the supervising thread's process dies (a lost node, a killed actor), so that no orphaned
    # sidecar keeps serving and heartbeating for a dead actor.
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def expand(argv: Sequence[str], values: Mapping[str, str]) -> list[str]:
    """``argv`` with each ``{name}`` of ``values`` replaced (plain replacement: other braces stay as they are)."""
    out = []
    for arg in argv:
        for key, value in values.items():
            arg = arg.replace("{" + key + "}", value)
        out.append(arg)
    return out


class ProcessSupervisor:
    """Runs ``argv`` (with ``{host}``, ``{port}``, ``{replica_id}`` and ``{url}`` filled in) and keeps it running.

    ``name``: the prefix of this life's id (``NAME-xxxxxx``: a restarted actor is a new replica with a new
    record; the dead one's expires by its TTL). ``port``: 0 picks a free one. ``max_restarts``: process
    restarts within one actor life before it gives up (the actor then reports ``alive=False``).
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str,
        port: int = 0,
        env: Mapping[str, str] | None = None,
        max_restarts: int = 10,
        log_dir: str | None = None,
    ) -> None:
        self.host = node_address()
        self.port = port or free_port()
        self.replica_id = f"{name}-{secrets.token_hex(3)}"
        self.url = f"http://{self.host}:{self.port}"
        values = {"host": self.host, "port": str(self.port), "replica_id": self.replica_id, "url": self.url}
        self.argv = expand(argv, values)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.max_restarts = max_restarts
        folder = Path(log_dir or Path(tempfile.gettempdir()) / "flipsync-ray")
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / f"{self.replica_id}.log"
        self.started = time.time()
        self.restarts = 0
        self.exit_codes: deque[int] = deque(maxlen=20)
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._gave_up = False
        # One thread starts and waits on the process for the actor's whole life: PDEATHSIG fires when the
        # thread that forked the child exits, so it must be this long-lived one.
        self._thread = threading.Thread(target=self._supervise, name="flipsync-supervise", daemon=True)
        self._thread.start()
        log.info("supervising %s at %s: %s", self.replica_id, self.url, " ".join(self.argv))

    def _spawn(self) -> subprocess.Popen[bytes]:
        with self.log_path.open("ab") as out:
            return subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                preexec_fn=_die_with_parent,  # async-signal-safe: one prctl call
            )

    def _supervise(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            with self._lock:
                if self._stopping.is_set():
                    return
                self._proc = proc = self._spawn()
            t0 = time.monotonic()
            code = proc.wait()
            self.exit_codes.append(code)
            if self._stopping.is_set():
                return
            failures = 0 if time.monotonic() - t0 > 60 else failures + 1  # a minute up resets the backoff
            if self.restarts >= self.max_restarts:
                log.error("%s exited %d; %d restarts already: giving up", self.replica_id, code, self.restarts)
                self._gave_up = True
                return
            self.restarts += 1
            delay = min(30.0, 0.5 * 2 ** min(failures, 6))
            log.warning("%s exited %d: restarting in %.1f s (restart %d)", self.replica_id, code, delay, self.restarts)
            self._stopping.wait(delay)

    def info(self) -> dict[str, Any]:
        """Where and what this replica is: its id, URL, node, process, restarts, whether it runs."""
        proc = self._proc
        node_id = None
        with contextlib.suppress(Exception):
            import ray

            # Only inside Ray: outside, asking for the runtime context starts Ray or joins the last cluster this
            # machine ran (a dead one's address left behind: it hung there, retrying)
            if ray.is_initialized():
                node_id = ray.get_runtime_context().get_node_id()
        return {
            "replica": self.replica_id,
            "url": self.url,
            "host": self.host,
            "port": self.port,
            "node_id": node_id,
            "pid": None if proc is None else proc.pid,
            "alive": proc is not None and proc.poll() is None,
            "gave_up": self._gave_up,
            "restarts": self.restarts,
            "exit_codes": list(self.exit_codes),
            "started": self.started,
            "log": str(self.log_path),
        }

    def logs(self, lines: int = 50) -> str:
        """The last ``lines`` lines the process wrote (stdout and stderr)."""
        try:
            with self.log_path.open("rb") as f:
                tail = deque(f, maxlen=min(lines, LOG_TAIL_LINES))
        except OSError:
            return ""
        return b"".join(tail).decode("utf-8", "replace")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the process (a sidecar drains and leaves the fleet) and wait up to ``timeout_s`` for it to
        exit, then SIGKILL it. Its exit code (None: it was not running). Nothing restarts it afterwards."""
        with self._lock:
            self._stopping.set()
            proc = self._proc
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout_s + 15.0)  # its own drain bound (--exit-timeout), then engine shutdown
        except subprocess.TimeoutExpired:
            log.warning("%s did not exit %g s after SIGTERM: killing it", self.replica_id, timeout_s)
            proc.kill()
            return proc.wait(10)

    def kill_process(self) -> None:
        """SIGKILL the process (a crash, for tests): the supervisor restarts it."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
