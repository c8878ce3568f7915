"""Helpers for the sidecar tests: a trainer that publishes real patches of a tiny model, fault-injecting
engines and stores, loopback servers."""

from __future__ import annotations

import collections
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from flipsync.board.signing import Signer
from flipsync.board.writer import BoardWriter
from flipsync.codec import Patch, diff_views
from flipsync.codec.bits import int_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.domain.manifest import Manifest
from flipsync.engines.base import Engine
from flipsync.engines.torch.engine import TorchEngine
from flipsync.engines.torch.models import build_model, preset_config
from flipsync.errors import EngineError, EngineUnavailableError, PermanentStoreError, StoreError
from flipsync.formats import served_view
from flipsync.serving import ServerThread
from flipsync.sidecar.gate import CommitMode
from flipsync.sidecar.replica import Replica, ReplicaConfig
from flipsync.sidecar.service import Sidecar
from flipsync.stores import ObjectInfo, Store, StoreOptions

TINY = preset_config("tiny", max_positions=256)


FAST = StoreOptions(
    connect_timeout_s=2.0, request_timeout_s=10.0, max_retries=1, retry_timeout_s=2.0, allow_metadata_credentials=False
)


def fast_replica(mode: CommitMode = CommitMode.IN_PLACE, **kw: float) -> ReplicaConfig:
    """Short polls and backoffs, so faults and recoveries take milliseconds."""
    return ReplicaConfig(
        commit_mode=mode,
        poll_interval_s=kw.get("poll", 0.05),
        max_backoff_s=kw.get("max_backoff", 0.2),
        drain_timeout_s=kw.get("drain_timeout", 10.0),
        jitter=0.0,
    )


@dataclass
class Stack:
    """A torch engine behind its OpenAI server, and a sidecar (reconcile loop + proxy) in front of it."""

    engine: Engine
    torch_engine: TorchEngine
    engine_server: ServerThread
    sidecar: Sidecar
    client: httpx.Client

    @property
    def replica(self) -> Replica:
        return self.sidecar.replica


StackFactory = Callable[..., Stack]


def tiny_masters(seed: int = 0) -> dict[str, torch.Tensor]:
    model = build_model(TINY, seed=seed, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def tiny_engine(fmt: str = "bf16", seed: int = 123) -> TorchEngine:
    """A torch engine with weights unrelated to the trainer's (the board must bring them)."""
    return TorchEngine(build_model(TINY, seed=seed), served_format=fmt)


def same_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Bitwise equality of two views, through integer views (NaN payloads, -0 and fp8 included)."""
    if set(a) != set(b):
        return False
    return all(torch.equal(int_view(a[k].contiguous()), int_view(b[k].contiguous())) for k in a)


class Trainer:
    """Publishes a tiny model's served view as v0, then a real codec patch per ``step()``.

    Each step nudges a fraction of the masters by a relative ``lr``, so a few percent of the served values
    change: real patches, small enough that tests run in milliseconds.
    """

    def __init__(
        self,
        store: Store,
        *,
        run: str = "run",
        fmt: str = "bf16",
        seed: int = 0,
        signer: Signer | None = None,
        publisher_id: str = "trainer-0",
    ) -> None:
        self.store = store
        self.run = run
        self.fmt = fmt
        self.masters = tiny_masters(seed)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.view = served_view(self.masters, fmt)
        self.table = FingerprintTable.of(self.view)
        self.views: dict[int, dict[str, torch.Tensor]] = {0: self.view}
        self.fps: dict[int, str] = {0: self.table.view_fp()}
        self.pub = BoardWriter(store, run, publisher_id=publisher_id, signer=signer)
        self.pub.publish_snapshot(self.view, version=0, view_fp=self.fps[0], served_format=fmt)
        self.version = 0
        self.patches: dict[int, bytes] = {}

    def next_view(self, lr: float = 0.05, fraction: float = 0.05) -> dict[str, torch.Tensor]:
        for m in self.masters.values():
            mask = torch.rand(m.shape, generator=self.gen) < fraction
            m.add_(lr * m.abs().clamp_min(1e-3) * torch.randn(m.shape, generator=self.gen) * mask)
        return served_view(self.masters, self.fmt)

    def make_patch(self, new_view: Mapping[str, torch.Tensor]) -> tuple[Patch, FingerprintTable]:
        return diff_views(
            self.view,
            new_view,
            old_table=self.table,
            base_version=self.version,
            target_version=self.version + 1,
            served_format=self.fmt,
        )

    def step(self, *, lr: float = 0.05, fraction: float = 0.05, parts: Sequence[bytes] | None = None) -> Manifest:
        """Publish version n+1; ``parts`` overrides the patch bytes (to publish garbage on purpose)."""
        new_view = self.next_view(lr, fraction)
        patch, new_table = self.make_patch(new_view)
        data = patch.to_bytes()
        m = self.pub.publish_patch(
            list(parts) if parts is not None else [data],
            base_version=self.version,
            target_version=self.version + 1,
            base_view_fp=self.table.view_fp(),
            target_view_fp=new_table.view_fp(),
            served_format=self.fmt,
        )
        self.version += 1
        self.view, self.table = dict(new_view), new_table
        self.views[self.version] = self.view
        self.fps[self.version] = new_table.view_fp()
        self.patches[self.version] = data
        return m

    def keyframe(self) -> Manifest:
        return self.pub.publish_keyframe(
            self.view, version=self.version, view_fp=self.fps[self.version], served_format=self.fmt
        )


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class FaultyEngine(Engine):
    """Wraps an engine and injects faults: refused commits, a lying table, death and rebirth."""

    name = "faulty"

    def __init__(self, inner: TorchEngine) -> None:
        self.inner = inner
        self.fail_commits = 0
        self.fail_loads = 0
        self.corrupt_after_commit = 0
        self.dead = False
        self.lock = threading.Lock()

    @property
    def table(self) -> FingerprintTable:
        return self.inner.table

    def _alive(self) -> None:
        if self.dead:
            raise EngineUnavailableError("injected: the engine is dead")

    def load_view(self, view: Mapping[str, torch.Tensor]) -> None:
        self._alive()
        if self.fail_loads:
            self.fail_loads -= 1
            raise EngineError("injected: load refused")
        self.inner.load_view(view)

    def stage(self, patch: Patch) -> Any:
        self._alive()
        return self.inner.stage(patch)

    def commit(self, staged: Any) -> Any:
        self._alive()
        if self.fail_commits:
            self.fail_commits -= 1
            raise RuntimeError("injected: the engine refused the commit")
        undo = self.inner.commit(staged)
        if self.corrupt_after_commit:
            # A torn write the engine did not notice: the table now disagrees with the board's target.
            self.corrupt_after_commit -= 1
            name = sorted(staged.touched)[0]  # a touched tensor, so the rollback restores its entry
            tid = self.inner.table[name]
            self.inner.table[name] = type(tid)(tid.dtype, tid.shape, tid.fp ^ 1)
        return undo

    def rollback(self, undo: Any) -> None:
        self._alive()
        self.inner.rollback(undo)

    def recompute_table(self) -> FingerprintTable:
        self._alive()
        return self.inner.recompute_table()

    def health(self) -> bool:
        return not self.dead

    def label_version(self, view_fp: str, version: int) -> None:
        self.inner.label_version(view_fp, version)

    def scramble(self) -> None:
        """What a restarted engine holds: other weights (and a table that describes them)."""
        fresh = tiny_engine(self.inner.served_format, seed=999)
        self.inner.load_view({k: v.clone() for k, v in fresh.served.items()})


class FlakyStore:
    """A Store whose reads fail with StoreError while ``down`` is set (PermanentStoreError, as a revoked
    permission, while ``refused`` is), can be slow, and counts reads by path."""

    def __init__(self, inner: Store, *, get_delay_s: float = 0.0) -> None:
        self.inner = inner
        self.url = f"flaky+{inner.url}"
        self.down = False
        self.refused = False
        self.get_delay_s = get_delay_s
        self.gets: collections.Counter[str] = collections.Counter()
        self.heads: collections.Counter[str] = collections.Counter()
        self.exist_checks: collections.Counter[str] = collections.Counter()

    def _check(self) -> None:
        if self.refused:
            raise PermanentStoreError(f"get {self.url} was refused: HTTP 403 AccessDenied (injected); grant access")
        if self.down:
            raise StoreError(f"{self.url} is unreachable (injected)")

    def put(self, path: str, data: bytes | bytearray | memoryview, *, create_only: bool = False) -> None:
        self._check()
        self.inner.put(path, data, create_only=create_only)

    def get(self, path: str, *, size: int | None = None) -> bytes:
        self._check()
        self.gets[path] += 1
        time.sleep(self.get_delay_s)  # a slow WAN: concurrent readers overlap
        return self.inner.get(path, size=size)

    def get_range(self, path: str, start: int, end: int) -> bytes:
        self._check()
        return self.inner.get_range(path, start, end)

    def head(self, path: str) -> ObjectInfo:
        self._check()
        self.heads[path] += 1
        return self.inner.head(path)

    def exists(self, path: str) -> bool:
        self._check()
        self.exist_checks[path] += 1
        return self.inner.exists(path)

    def list(self, prefix: str) -> list[ObjectInfo]:
        self._check()
        return self.inner.list(prefix)

    def list_dirs(self, prefix: str) -> list[str]:
        self._check()
        return self.inner.list_dirs(prefix)

    def delete(self, paths: Sequence[str]) -> None:
        self._check()
        self.inner.delete(paths)

    def make_durable(self, paths: Sequence[str]) -> None:
        self.inner.make_durable(paths)

    def close(self) -> None:
        self.inner.close()


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 15.0) -> int:
    """SIGTERM ``proc`` if it still runs and wait ``timeout_s`` for it (then kill it); its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode
