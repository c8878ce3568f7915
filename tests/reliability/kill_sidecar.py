"""Child process for test_sidecar_kill.py: one sidecar (real reconcile loop, proxy and engine port) that kills
itself with SIGKILL at a named step of applying a named version.

Importing torch and the sidecar takes seconds of CPU, so this script is a *zygote*: it imports and warms up
the codec's kernels once, then forks one life per JSON line read from stdin::

    {"board": DIR, "run": RUN, "log": FILE, "engine": "vllm" | "torch", "url": ENGINE_URL (vllm),
     "specs": {name: [shape, dtype]} (vllm), "kill": "STEP@VERSION" | "STEP" | null}

Every line on stdout starts with a process id: ``PID FORKED``, then from the life ``PID URL PROXY_URL
[WEIGHTS_URL]`` (the torch engine also serves its weights) and ``PID KILL STEP vN`` right before it kills
itself, and from the zygote ``PID EXIT signal=N|code=N`` once it is gone. The hooks live here, in wrappers
around the real engine, transport and replica; nothing in ``src/`` knows about them. Steps:

- ``before_load``, ``after_load``: around ``engine.load_view`` (a keyframe);
- ``before_stage``, ``during_stage`` (after the workers answered the gather of old bits), ``after_stage``;
- ``before_commit`` (the gate is closed and drained), ``commit_one_tensor`` / ``commit_one_rank`` (the apply
  reached rank 0 only, with one write or all of them: what is left when rank 1 fails and the sidecar dies
  before its undo), ``after_commit`` (written, not verified);
- ``after_verify`` (verified, not reported), ``after_report`` (reported).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Mapping
from typing import Any

import torch
from fastapi import FastAPI, Response
from safetensors.torch import save

from flipsync.board.reader import BoardReader, Step
from flipsync.codec import Patch, apply_patch, diff_views
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.base import Engine
from flipsync.engines.torch.engine import TorchEngine
from flipsync.engines.torch.models import build_model, preset_config
from flipsync.engines.torch.openai_server import create_engine_app
from flipsync.engines.vllm.engine import VllmEngine
from flipsync.engines.vllm.rpc_transports import HttpTransport
from flipsync.engines.vllm.tensor_specs import TensorSpec
from flipsync.serving import ServerThread
from flipsync.sidecar.gate import CommitMode
from flipsync.sidecar.proxy import ProxyConfig, create_proxy_app
from flipsync.sidecar.replica import Replica, ReplicaConfig
from flipsync.stores import open_store

log = logging.getLogger("kill_sidecar")


class Killer:
    """SIGKILLs this process at one step, optionally only while applying one version."""

    def __init__(self, spec: str | None) -> None:
        step, _, target = (spec or "").partition("@")
        self.step = step or None
        self.target = int(target) if target else None
        self.current: int | None = None  # the version being applied

    def armed(self, step: str) -> bool:
        return step == self.step and (self.target is None or self.target == self.current)

    def at(self, step: str) -> None:
        if self.armed(step):
            say(f"KILL {step} v{self.current}")
            os.kill(os.getpid(), signal.SIGKILL)


class KillingTransport:
    """HttpTransport with kill points inside the commit's RPC."""

    def __init__(self, inner: HttpTransport, killer: Killer) -> None:
        self.inner = inner
        self.killer = killer

    def call(self, request: Mapping[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        op = request.get("op")
        k = self.killer
        if op == "apply" and (k.armed("commit_one_tensor") or k.armed("commit_one_rank")):
            writes = request["per_rank"].get("0", [])
            partial = {**request, "per_rank": {"0": writes[:1] if k.armed("commit_one_tensor") else writes}}
            self.inner.call(partial, timeout_s)
            k.at("commit_one_tensor")
            k.at("commit_one_rank")
        answers = self.inner.call(request, timeout_s)
        if op == "gather":
            k.at("during_stage")
        return answers

    def health(self) -> bool:
        return self.inner.health()

    def close(self) -> None:
        self.inner.close()


class KillingEngine(Engine):
    """Delegates to a real engine, with kill points around each call of the port."""

    def __init__(self, inner: Engine, killer: Killer) -> None:
        self.inner = inner
        self.killer = killer
        self.name = inner.name  # type: ignore[misc]

    @property
    def table(self) -> FingerprintTable:
        return self.inner.table

    @property
    def adoptable(self) -> bool:
        return self.inner.adoptable

    def load_view(self, view: Mapping[str, torch.Tensor]) -> None:
        self.killer.at("before_load")
        self.inner.load_view(view)
        self.killer.at("after_load")

    def stage(self, patch: Patch) -> Any:
        self.killer.at("before_stage")
        staged = self.inner.stage(patch)
        self.killer.at("after_stage")
        return staged

    def commit(self, staged: Any) -> Any:
        self.killer.at("before_commit")
        undo = self.inner.commit(staged)
        self.killer.at("after_commit")
        return undo

    def rollback(self, undo: Any) -> None:
        self.inner.rollback(undo)

    def recompute_table(self) -> FingerprintTable:
        return self.inner.recompute_table()

    def health(self) -> bool:
        return self.inner.health()

    def close(self) -> None:
        self.inner.close()


class KillingReplica(Replica):
    """Knows which version it applies; kill points between verification and report."""

    killer: Killer

    def _apply(self, step: Step, fetch_s: float) -> None:
        self.killer.current = step.target_version
        super()._apply(step, fetch_s)

    def _set_version(self, version: int | None, view_fp: str | None) -> None:
        applying = version is not None and version == self.killer.current
        if applying:
            self.killer.at("after_verify")
        super()._set_version(version, view_fp)
        if applying:
            self.killer.at("after_report")


def torch_engine() -> tuple[Engine, ServerThread, FastAPI]:
    """The in-process torch engine (the tiny preset), its OpenAI server, and a route serving its weights."""
    engine = TorchEngine(build_model(preset_config("tiny", max_positions=256), seed=123), served_format="bf16")
    server = ServerThread(create_engine_app(engine, max_concurrency=2)).start()
    test_app = FastAPI()

    @test_app.get("/held")
    def held() -> Response:
        return Response(save({k: v.contiguous() for k, v in engine.served.items()}))

    return engine, server, test_app


def say(line: str) -> None:
    """One line to the parent, tagged with this process's id (lives share the zygote's stdout)."""
    os.write(1, f"{os.getpid()} {line}\n".encode())


def life(cfg: dict[str, Any]) -> None:
    """One sidecar, until SIGTERM (a graceful stop) or SIGKILL."""
    killer = Killer(cfg.get("kill"))
    extra: list[ServerThread] = []
    inner: Engine
    if cfg["engine"] == "vllm":
        specs = {n: TensorSpec(tuple(shape), dtype) for n, (shape, dtype) in cfg["specs"].items()}
        inner = VllmEngine(KillingTransport(HttpTransport(cfg["url"]), killer), specs)
        upstream = cfg["url"]
    else:
        inner, engine_server, test_app = torch_engine()
        extra += [engine_server, ServerThread(test_app).start()]
        upstream = engine_server.url
    engine = KillingEngine(inner, killer)
    config = ReplicaConfig(commit_mode=CommitMode.QUIESCE, poll_interval_s=0.05, max_backoff_s=0.2, jitter=0.0)
    replica = KillingReplica(BoardReader(open_store(cfg["board"]), cfg["run"]), engine, config=config)
    replica.killer = killer
    proxy = ServerThread(create_proxy_app(replica, ProxyConfig(upstream, admit_timeout_s=10.0))).start()
    say(" ".join(["URL", proxy.url, *(s.url for s in extra[1:])]))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    replica.start()
    while not stop.wait(0.5):
        pass
    replica.stop()
    proxy.stop()
    for s in extra:
        s.stop()
    engine.close()


def warm_up() -> None:
    """Run the codec's compiled kernels once, so that every forked life starts with them loaded."""
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(64, 64, generator=g).to(torch.bfloat16)}
    b = {"w": (a["w"].float() + 1e-2 * torch.randn(64, 64, generator=g)).to(torch.bfloat16)}
    patch, table = diff_views(a, b)
    held = {"w": a["w"].clone()}
    apply_patch(held, Patch.from_bytes(patch.to_bytes()), FingerprintTable.of(held))
    assert FingerprintTable.of(held).view_fp() == table.view_fp()


def zygote() -> None:
    """Import and warm up once, then fork one life per config line; report each life's end."""
    lives: set[int] = set()

    def reap(*_: object) -> None:
        while True:  # every child that ended, even one that ended before it was added to ``lives``
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            lives.discard(pid)
            how = f"signal={os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"code={os.WEXITSTATUS(status)}"
            os.write(1, f"{pid} EXIT {how}\n".encode())

    torch.set_num_threads(1)
    warm_up()
    signal.signal(signal.SIGCHLD, reap)
    os.write(1, f"{os.getpid()} READY\n".encode())
    for line in sys.stdin:
        cfg = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the life: its own log, default signals, and never back into this loop
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = 1
            try:
                log_fd = os.open(cfg["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log_fd, 2)
                logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
                logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per RPC and status poll otherwise
                life(cfg)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        lives.add(pid)
        os.write(1, f"{pid} FORKED\n".encode())
    for pid in list(lives):  # the parent went away: end what is left of ours
        os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    zygote()
