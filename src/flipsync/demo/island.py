"""One rollout island of the demo: a separate process with its own torch engine and sidecar.

The island reads the board through a bandwidth-limited store (its "WAN link"), keeps its engine at HEAD,
and serves the version-aware proxy on loopback. The parent talks to it over a pipe: the proxy URL once it
is up, then commands (``audit``: fingerprints recomputed from the weights the engine holds, and optionally
the served tensors themselves; ``stop``).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from flipsync.board.store import Store, open_store
from flipsync.board.throttle import ThrottledStore
from flipsync.sidecar.replica import ReplicaConfig
from flipsync.sidecar.service import Sidecar, start_torch_engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IslandSpec:
    name: str
    board: str
    run: str
    model: str
    served_format: str
    bandwidth_bytes_per_s: float | None
    seed: int
    max_concurrency: int = 8


def island_main(spec: IslandSpec, conn: Connection) -> None:
    """The island process: start engine and sidecar, report the proxy URL, then serve commands."""
    torch.set_num_threads(1)  # two cores are shared by the trainer and every island
    logging.basicConfig(level=logging.WARNING)
    store: Store = open_store(spec.board)
    if spec.bandwidth_bytes_per_s:
        store = ThrottledStore(store, spec.bandwidth_bytes_per_s)
    handle = start_torch_engine(spec.model, spec.served_format, seed=spec.seed, max_concurrency=spec.max_concurrency)
    sidecar = Sidecar(store, spec.run, handle.engine, handle.url, replica_config=ReplicaConfig(poll_interval_s=0.05))
    sidecar.start()
    conn.send(("ready", sidecar.url))
    try:
        while True:
            command, arg = conn.recv()
            if command == "stop":
                break
            if command == "audit":
                table = handle.engine.recompute_table()
                tensors = {k: v.detach().cpu().clone() for k, v in handle.engine.served.items()} if arg else None
                conn.send(("audit", {"version": handle.engine.version, "view_fp": table.view_fp(), "tensors": tensors}))
    except EOFError:
        pass  # the parent went away
    finally:
        sidecar.stop()
        handle.stop()
        conn.close()


class Island:
    """The parent's handle on one island process."""

    def __init__(self, spec: IslandSpec) -> None:
        self.spec = spec
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=island_main, args=(spec, child), name=f"flipsync-{spec.name}", daemon=True)
        self.url: str | None = None

    def start(self) -> Island:
        self.process.start()
        return self

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"island {self.spec.name} did not start within {timeout_s} s")
        kind, url = self._conn.recv()
        assert kind == "ready"
        self.url = url
        return url

    def audit(self, *, tensors: bool = False, timeout_s: float = 120.0) -> dict[str, Any]:
        self._conn.send(("audit", tensors))
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"island {self.spec.name} did not answer the audit within {timeout_s} s")
        return self._conn.recv()[1]

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.process.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self._conn.send(("stop", None))
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def board_url(path: Path) -> str:
    return path.resolve().as_uri()
