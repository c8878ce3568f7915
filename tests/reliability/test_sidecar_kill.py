"""SIGKILL the sidecar at every step of applying a version, and at random moments.

The engine runs in a process of its own and outlives its sidecars, as ``vllm serve`` does: two tensor-parallel
fake vLLM workers behind the ``/collective_rpc`` contract (``vllm_engine_server.py``). Each sidecar life is a
child process (``kill_sidecar.py``) with the real ``Replica``, proxy, ``VllmEngine`` and ``HttpTransport``,
which kills itself at a named step of applying a named version. After every kill the next life must converge
to HEAD; it adopts what the engine holds when that is a published version, and loads a keyframe when it is
not (a commit cut short between tensors or ranks). Throughout, a client sends completions through whichever
sidecar is up (quiesce mode: no commit overlaps a request), and the engine answers with the fingerprint of
the view it served them on: every served answer must be exactly the version the proxy stamped on it. After
every life, the board is byte for byte what the trainer wrote.

The in-process torch engine dies with its sidecar: a restart boots from the board and must hold HEAD bitwise.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load

from flipsync.board.writer import BoardWriter
from flipsync.codec import diff_views
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.vllm.tensor_specs import specs_of
from flipsync.stores import open_store
from tests.engines.fake_vllm import checkpoint, step
from tests.sidecar.sidecar_helpers import Trainer, same_bits

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CHILD = HERE / "kill_sidecar.py"
ENGINE_SERVER = HERE / "vllm_engine_server.py"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
WAIT_S = 90.0  # generous bounds on waits; nothing asserts how long anything took

# Where a kill at each step leaves the engine: at the base of the version applied, at its target, or neither
# (a partial write, which the next life must not adopt).
LEAVES = {
    "before_stage": "base",
    "during_stage": "base",
    "after_stage": "base",
    "before_commit": "base",
    "commit_one_tensor": "partial",
    "commit_one_rank": "partial",
    "after_commit": "target",
    "after_verify": "target",
    "after_report": "target",
}


class Board:
    """The trainer side: version k's view is a pure function of k; remembers every view and the board's bytes."""

    def __init__(self, root: Path, run: str = "run") -> None:
        self.root, self.run = root, run
        self.pub = BoardWriter(open_store(str(root)), run, publisher_id="trainer")
        v0 = checkpoint(0)
        self.views = {0: v0}
        self.tables = {0: FingerprintTable.of(v0)}
        self.fps = {0: self.tables[0].view_fp()}
        self.pub.publish_snapshot(v0, version=0, view_fp=self.fps[0], served_format="bf16")
        self.head = 0
        self.files = self.snapshot()

    def snapshot(self) -> dict[str, str]:
        return {
            str(p.relative_to(self.root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(self.root.rglob("*"))
            if p.is_file()
        }

    def untouched(self) -> bool:
        """Nothing the sidecars did added, removed or changed a byte of the board."""
        return self.snapshot() == self.files

    def publish(self) -> int:
        assert self.untouched()
        k = self.head
        new = step(self.views[k], seed=k + 1)
        patch, table = diff_views(self.views[k], new, old_table=self.tables[k], base_version=k, target_version=k + 1)
        self.pub.publish_patch(
            [patch.to_bytes()],
            base_version=k,
            target_version=k + 1,
            base_view_fp=self.tables[k].view_fp(),
            target_view_fp=table.view_fp(),
            served_format="bf16",
        )
        self.views[k + 1], self.tables[k + 1], self.fps[k + 1] = new, table, table.view_fp()
        self.head = k + 1
        self.files = self.snapshot()
        return self.head


class Prober(threading.Thread):
    """Sends completions through whichever sidecar is up and checks each served one against the board."""

    def __init__(self, fps: dict[int, str]) -> None:
        super().__init__(daemon=True)
        self.fps = fps
        self.url: str | None = None
        self.done = threading.Event()
        self.served: collections.Counter[int] = collections.Counter()
        self.refused: collections.Counter[int] = collections.Counter()  # by HTTP status
        self.statuses = 0
        self.bad: list[str] = []

    def run(self) -> None:
        with httpx.Client(timeout=10.0) as client:
            while not self.done.wait(0.05):
                url = self.url
                if url is None:
                    continue
                try:
                    r = client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1})
                    s = client.get(f"{url}/flipsync/status")
                except httpx.HTTPError:
                    continue  # that sidecar was killed
                if r.status_code == 200:
                    body = r.json()
                    start, end = body["weight_version"]["start"], body["weight_version"]["end"]
                    if start != end or body["held_view_fp"] != self.fps.get(start):
                        self.bad.append(f"served as v{start}..v{end} on view {body['held_view_fp']}")
                    else:
                        self.served[start] += 1
                else:
                    self.refused[r.status_code] += 1  # 503 while no version is verified: allowed
                if s.status_code == 200:
                    st = s.json()
                    self.statuses += 1
                    if st["version"] is not None and st["view_fp"] != self.fps.get(st["version"]):
                        self.bad.append(f"status v{st['version']} with view {st['view_fp']}")


class Zygote:
    """``kill_sidecar.py``: imports once, forks a sidecar life per config; its output, sorted by process id."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.log = (tmp / "zygote.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD)],
            env=ENV,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.lines: dict[int, queue.Queue[str]] = collections.defaultdict(queue.Queue)
        self.forked: queue.Queue[int] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.n = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            pid, _, rest = line.strip().partition(" ")
            if rest == "FORKED":
                self.lines[int(pid)]  # its queue exists before anyone else looks it up
                self.forked.put(int(pid))
            else:
                self.lines[int(pid)].put(rest)

    def start(self, cfg: dict[str, Any]) -> Life:
        assert self.proc.stdin is not None
        log = self.tmp / f"life-{self.n}.log"
        self.n += 1
        self.proc.stdin.write(json.dumps({**cfg, "log": str(log)}) + "\n")
        self.proc.stdin.flush()
        return Life(self.forked.get(timeout=WAIT_S), self.lines, log)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # the zygote kills what is left of its lives and exits
        self.proc.wait(WAIT_S)
        self.log.close()


class Life:
    """One sidecar process, forked by the zygote."""

    def __init__(self, pid: int, lines: dict[int, queue.Queue[str]], log: Path) -> None:
        self.pid, self.queue, self.log = pid, lines[pid], log
        self.said: list[str] = []
        self.urls: list[str] = []

    def next(self) -> str:
        line = self.queue.get(timeout=WAIT_S)
        self.said.append(line)
        return line

    def begin(self) -> list[str]:
        first = self.next()
        assert first.startswith("URL "), f"the sidecar did not start: {first!r} (see {self.log})"
        self.urls = first.split()[1:]
        return self.urls

    def end(self) -> str:
        """Wait until the zygote reports this life gone; how it ended."""
        while not (line := self.next()).startswith("EXIT "):
            pass
        return line.removeprefix("EXIT ")

    def killed(self) -> str:
        """Wait for the life to kill itself; the step it named."""
        assert self.end() == f"signal={signal.SIGKILL.value}", f"{self.said} (see {self.log})"
        kills = [line for line in self.said if line.startswith("KILL ")]
        assert len(kills) == 1, self.said
        return kills[0]

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        assert self.end() == f"signal={signal.SIGKILL.value}"

    def terminate(self) -> str:
        os.kill(self.pid, signal.SIGTERM)
        return self.end()


class Lives:
    """Starts sidecar lives one after another and points the prober at the current one."""

    def __init__(self, tmp: Path, base_cfg: dict[str, Any], prober: Prober | None) -> None:
        self.zygote = Zygote(tmp)
        self.base_cfg, self.prober = base_cfg, prober

    def start(self, kill: str | None) -> Life:
        life = self.zygote.start({**self.base_cfg, "kill": kill})
        life.begin()
        if self.prober is not None:
            self.prober.url = life.urls[0]
        return life

    def close(self) -> None:
        self.zygote.close()


def converge(url: str, head: int, fps: dict[int, str]) -> dict[str, Any]:
    """Wait until the sidecar reports HEAD; its status then."""
    deadline = time.monotonic() + WAIT_S
    st: dict[str, Any] = {}
    with httpx.Client(timeout=10.0) as client:
        while time.monotonic() < deadline:
            st = client.get(f"{url}/flipsync/status").json()
            if st["version"] == head:
                assert st["view_fp"] == fps[head]
                return st
            time.sleep(0.05)
    raise AssertionError(f"the sidecar did not reach v{head}: {st}")


def held(url: str) -> dict[str, torch.Tensor]:
    r = httpx.get(url, timeout=30.0)
    r.raise_for_status()
    return load(r.content)


@contextmanager
def engine_server(seed: int) -> Iterator[str]:
    proc = subprocess.Popen([sys.executable, str(ENGINE_SERVER), str(seed)], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http"), "the engine server did not start"
        yield url
    finally:
        proc.kill()
        proc.wait(WAIT_S)


def peek(url: str) -> str:
    """What a life was doing just before it is killed (for the report only): its state and how it booted."""
    try:
        st = httpx.get(f"{url}/flipsync/status", timeout=5.0).json()
    except httpx.HTTPError:
        return "no answer"
    booted = "adopted" if st["adopted"] else "keyframe" if st["updates"] else "booting"
    return f"{st['state']} ({booted})"


def recovery(st: dict[str, Any]) -> str:
    """How a life got its first version: it adopted what the engine held, or it loaded a keyframe."""
    return f"adopt v{st['adopted']['version']}" if st["adopted"] else "keyframe"


def run_kills(tmp_path: Path, random_kills: int, seed: int) -> dict[str, Any]:
    board = Board(tmp_path / "board")
    board.publish()
    board.publish()
    specs = {n: [list(s.shape), s.dtype] for n, s in specs_of(board.views[0]).items()}
    report: dict[str, Any] = {
        "kills": collections.Counter(),
        "recoveries": collections.Counter(),
        "random_kill_states": collections.Counter(),
    }
    prober = Prober(board.fps)
    prober.start()
    # The engine boots from other weights than the board's, so the first lives must load a keyframe.
    with engine_server(seed=7) as engine_url:
        cfg = {"board": str(board.root), "run": board.run, "engine": "vllm", "url": engine_url, "specs": specs}
        lives = Lives(tmp_path, cfg, prober)
        try:

            def check_held(st: dict[str, Any]) -> None:
                assert same_bits(held(f"{engine_url}/test/held"), board.views[st["version"]])
                assert board.untouched()

            def died(life: Life, step_name: str) -> None:
                assert life.killed().startswith(f"KILL {step_name} ")
                report["kills"][step_name] += 1
                assert board.untouched()

            # keyframe loads: killed before anything was written, then after the whole view was
            died(lives.start("before_load"), "before_load")
            died(lives.start("after_load"), "after_load")
            expect = "adopt v0"  # the keyframe (v0) was loaded whole
            for step_name, leaves in LEAVES.items():
                target = board.head + 1
                life = lives.start(f"{step_name}@{target}")
                st = converge(life.urls[0], board.head, board.fps)
                check_held(st)
                assert recovery(st) == expect, (step_name, st)
                report["recoveries"][expect.split()[0]] += 1
                board.publish()
                died(life, step_name)
                expect = {"base": f"adopt v{target - 1}", "target": f"adopt v{target}", "partial": "keyframe"}[leaves]
            # killed while idle at HEAD
            life = lives.start(None)
            st = converge(life.urls[0], board.head, board.fps)
            check_held(st)
            assert recovery(st) == expect
            life.kill()
            report["kills"]["idle"] += 1
            # killed at random moments while versions keep coming
            rng = random.Random(seed)
            for _ in range(random_kills):
                # work waiting at boot (0-3 versions), maybe one more version mid-life, a kill within 0.6 s:
                # while attaching, adopting, fetching, staging, committing or idle
                for _ in range(rng.randint(0, 3)):
                    board.publish()
                life = lives.start(None)
                t0, kill_at = time.monotonic(), rng.uniform(0.0, 0.6)
                if rng.random() < 0.5:
                    time.sleep(rng.uniform(0.0, kill_at))
                    board.publish()
                time.sleep(max(0.0, kill_at - (time.monotonic() - t0)))
                report["random_kill_states"][peek(life.urls[0])] += 1
                life.kill()
                report["kills"]["random"] += 1
                assert board.untouched()
            # a last, clean life converges and exits on SIGTERM
            board.publish()
            life = lives.start(None)
            st = converge(life.urls[0], board.head, board.fps)
            check_held(st)
            report["recoveries"][recovery(st).split()[0]] += 1
            prober.url = None
            assert life.terminate() == "code=0"
        finally:
            prober.done.set()
            prober.join(30)
            lives.close()
    assert not prober.bad, prober.bad[:5]
    assert set(prober.refused) <= {503}, prober.refused
    assert sum(prober.served.values()) > 0 and len(prober.served) > 3
    report |= {"served": dict(sorted(prober.served.items())), "refused": dict(prober.refused), "head": board.head}
    print(f"\nsidecar kills: {json.dumps(report, default=dict)}")
    return report


def test_sidecar_killed_at_every_step_with_an_engine_that_outlives_it(tmp_path: Path) -> None:
    report = run_kills(tmp_path, random_kills=3, seed=1)
    assert report["kills"]["idle"] == 1 and all(report["kills"][s] == 1 for s in LEAVES)


@pytest.mark.slow
def test_sidecar_killed_at_random_moments_many_times(tmp_path: Path) -> None:
    report = run_kills(tmp_path, random_kills=40, seed=99)
    assert report["kills"]["random"] == 40


def test_in_process_sidecar_killed_mid_commit_boots_from_the_board(tmp_path: Path) -> None:
    """The torch engine lives in the sidecar's process: killed after the engine wrote a patch but before the
    replica verified it, everything in memory is gone, and the next life boots from the board."""
    board = tmp_path / "board"
    store = open_store(str(board))
    trainer = Trainer(store, run="run")
    trainer.step()
    cfg = {"board": str(board), "run": "run", "engine": "torch"}
    lives = Lives(tmp_path, cfg, None)
    try:
        life = lives.start(f"after_commit@{trainer.version + 1}")
        converge(life.urls[0], trainer.version, trainer.fps)
        trainer.step()
        assert life.killed() == f"KILL after_commit v{trainer.version}"
        trainer.step()
        n_files = len(list(board.rglob("*")))
        life = lives.start(None)
        st = converge(life.urls[0], trainer.version, trainer.fps)
        assert same_bits(held(f"{life.urls[1]}/held"), trainer.views[trainer.version])
        assert st["adopted"] is None  # a new engine in a new process: nothing to adopt, a keyframe
        assert life.terminate() == "code=0"
        assert len(list(board.rglob("*"))) == n_files  # the sidecars wrote nothing to the board
    finally:
        lives.close()
        store.close()
