"""What an island process shares with its parent and the board: its `IslandSpec`, the `Meters` the parent
reads, the `MeteredStore` that is its "WAN link", the command loop over its pipe (`serve_commands`), and, for a
flipsync island in the fleet, its member record (`join_fleet`). Both kinds of island (`island`, `control`) use it.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from typing import Any

from flipsync.board.throttle import ThrottledStore
from flipsync.engines.base import Engine
from flipsync.sidecar.heartbeat import MembershipConfig
from flipsync.sidecar.service import Sidecar
from flipsync.stores import Store, open_store

BEAT_S = 0.5  # the islands' heartbeat
TTL_S = 3.0  # a killed island leaves the gateway's view this long after its last heartbeat


def join_fleet(sidecar: Sidecar, spec: IslandSpec) -> None:
    """In an island's process: keep its member record on the board (plain store: not the metered link)."""
    sidecar.join(
        MembershipConfig(
            public_url=sidecar.url, replica_id=spec.name, island=spec.name, interval_s=BEAT_S, ttl_s=TTL_S
        ),
        store=open_store(spec.board),
    )


@dataclass(frozen=True)
class IslandSpec:
    name: str
    board: str  # the board URL (flipsync islands) or the checkpoint folder's URL (the control island)
    run: str
    model: str  # a model folder with config.json (and, for vllm, the tokenizer and the first version's weights)
    served_format: str
    bandwidth_bytes_per_s: float | None
    seed: int
    max_concurrency: int = 8
    engine: str = "torch"  # torch | vllm
    control: bool = False  # reloads full checkpoints instead of following the board
    fleet: bool = False  # joins the fleet: a member record on the board, under the island's name
    binding: dict[str, str] = field(default_factory=dict)  # a vLLM server's CPUs on this shared host (run.py)


@dataclass
class Meters:
    """Counters an island process shares with the parent."""

    bytes_read: Synchronized[int] = field(default_factory=lambda: mp.get_context("spawn").Value("q", 0))
    held_step: Synchronized[int] = field(default_factory=lambda: mp.get_context("spawn").Value("q", -1))


class MeteredStore(ThrottledStore):
    """A `ThrottledStore` (or, without a limit, a plain pass-through) that counts its bytes in `Meters`."""

    def __init__(self, inner: Store, bytes_per_s: float | None, meters: Meters) -> None:
        # Without a limit the bucket's rate is so high that nothing ever waits.
        super().__init__(inner, bytes_per_s or 1e15)
        self.meters = meters

    def _pay(self, n: int) -> None:
        super()._pay(n)
        with self.meters.bytes_read.get_lock():
            self.meters.bytes_read.value += n


def serve_commands(conn: Connection, audit: Callable[[bool], dict[str, Any]]) -> None:
    """Answer the parent's commands until it says ``stop`` or goes away; ``audit(tensors)`` answers ``audit``."""
    try:
        while True:
            command, arg = conn.recv()
            if command == "stop":
                return
            if command == "audit":
                conn.send(("audit", audit(bool(arg))))
    except EOFError:
        pass  # the parent went away


def engine_audit(engine: Engine, version: Callable[[], int | None]) -> Callable[[bool], dict[str, Any]]:
    """An island's audit: the version it reports, the fingerprint recomputed from the weights the engine holds
    (not its bookkeeping) and, when asked, the torch engine's tensors (vLLM's stay in its workers)."""

    def audit(tensors: bool) -> dict[str, Any]:
        table = engine.recompute_table()
        served = getattr(engine, "served", None)
        held = {k: v.detach().cpu().clone() for k, v in served.items()} if tensors and served else None
        return {"version": version(), "view_fp": table.view_fp(), "tensors": held}

    return audit
