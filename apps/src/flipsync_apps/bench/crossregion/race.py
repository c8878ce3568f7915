"""The crossregion race: one measured step, published by a real trainer, followed by N replicas over links.

The clock starts when ``optimizer.step()`` returns and stops when the last replica holds v1 with its
fingerprint verified. For patches the trainer publisher (``flipsync.trainer.Publisher``, background mode) is
attached and warmed by versions of unchanged weights; for full checkpoints the trainer writes the whole
served view as a snapshot. Replicas are real reconcile loops over `MemoryEngine`s, each reading the board
through its own throttled link (or one relay per island). Also here: the receivers' own costs
(``apply_seconds``, ``load_seconds``) that the cost model is fitted from.
"""

from __future__ import annotations

import math
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from flipsync.board.ahead import FetchAhead
from flipsync.board.reader import BoardReader
from flipsync.board.throttle import ThrottledStore, TokenBucket
from flipsync.board.writer import BoardWriter
from flipsync.codec import Patch
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.memory import MemoryEngine
from flipsync.errors import VerificationError
from flipsync.formats import served_view
from flipsync.relay.server import RelayCache, RelayConfig, create_relay_app
from flipsync.serving import ServerThread
from flipsync.sidecar.replica import Replica, ReplicaConfig
from flipsync.stores import HttpStore, Store, StoreWrapper, open_store
from flipsync.trainer import Publisher, PublisherConfig
from flipsync_apps.bench.crossregion.trained import FMT, Trained, same_bits

RUN = "bench"
RELAY_WATCH_S = 0.01  # the relay checks the board for a waited-for manifest this often (direct replicas: 2 ms)
FETCH_AHEAD_S = 0.01  # replicas list the next version's folder this often while they wait
CHUNK_BYTES = 16 << 10  # the trainer streams its part in chunks of this size (the default 8 MiB is for GB patches)
WHOLE = 1 << 62  # a chunk size no part fills: the part goes up whole, after the diff
WARM_STEPS = 2  # versions a patch trainer publishes before the measured step (its buffers then get reused)
UNLIMITED = 1e12
METHODS = ("patch", "relay", "full")
METHOD_LABEL = {"patch": "patch", "relay": "patch + relay", "full": "full checkpoint"}


def _follow_to(replica: Replica, version: int, deadline: float, done: list[float], i: int) -> None:
    while time.monotonic() < deadline:
        replica.sync_once()
        if replica.version == version:
            done[i] = time.perf_counter()
            return
        if not replica.wait_for_next(0.5):  # it watches the next version's folder (and a relay waits)
            time.sleep(0.002)


def _ahead(store: Store) -> FetchAhead:
    """A replica's store that watches the next version's folder, so it downloads a patch's chunks while the
    trainer is still coding the rest (`flipsync.board.ahead`)."""
    return FetchAhead(store, interval_s=FETCH_AHEAD_S)


def _boot(store: Store, engine: MemoryEngine, head: int, timeout_s: float) -> Replica:
    replica = Replica(BoardReader(store, RUN), engine, config=ReplicaConfig(poll_interval_s=0.01, jitter=0.0))
    deadline = time.monotonic() + timeout_s
    while replica.version != head:
        if time.monotonic() > deadline:
            raise TimeoutError(f"a replica did not boot at v{head}")
        replica.sync_once()
    return replica


@dataclass
class Outcome:
    seconds: float  # optimizer.step() returned -> last replica verified
    publish_s: float  # optimizer.step() returned -> the trainer's v1 on the board
    bitwise: bool
    wan_bytes: int
    phases: Mapping[str, float] = field(default_factory=dict)  # the trainer publisher's, by phase (patches)
    published_bytes: int = 0  # what the trainer put on the board for the version (patches)


@dataclass(frozen=True)
class Fired:
    """One measured step: when the clock started, when the version was committed, the publisher's phases."""

    start: float
    published: float
    phases: Mapping[str, float] = field(default_factory=dict)
    part_bytes: int = 0


Fire = Callable[[], Fired]  # runs the step and the publication


@dataclass
class Trainer:
    """A trainer ready to take the measured step: the board's HEAD holds v0's weights, as version ``head``."""

    fire: Fire
    close: Callable[[], None]
    head: int


def _race(
    replicas: list[Replica], fire: Fire, target: int, v1: Mapping[str, torch.Tensor], timeout_s: float
) -> Outcome:
    done = [0.0] * len(replicas)
    deadline = time.monotonic() + timeout_s
    threads = [
        threading.Thread(target=_follow_to, args=(r, target, deadline, done, i), daemon=True)
        for i, r in enumerate(replicas)
    ]
    for t in threads:
        t.start()
    fired = fire()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 1)
    if not all(done):
        raise TimeoutError(f"not every replica reached v{target} within {timeout_s:g} s")
    ok = all(isinstance(r.engine, MemoryEngine) and same_bits(r.engine.tensors, v1) for r in replicas)
    return Outcome(max(done) - fired.start, fired.published - fired.start, ok, 0, fired.phases, fired.part_bytes)


def _masters_of(params: Mapping[str, torch.nn.Parameter]) -> Callable[[], dict[str, torch.Tensor]]:
    return lambda: {k: p.detach() for k, p in params.items()}


class _ManifestClock(StoreWrapper):
    """Notes when the newest version manifest's write began: the moment a version is committed to the board.

    Taken inside the trainer's own write, so no replica can have seen the version earlier (the time at which
    the publishing call returns can come after replicas verified it, when the caller is descheduled)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.committed_at = 0.0

    def put(self, path: str, data: bytes | bytearray | memoryview, *, create_only: bool = False) -> None:
        if "/versions/" in path and path.endswith("/manifest.json"):  # not keyframes' or spans' manifests
            self.committed_at = time.perf_counter()
        super().put(path, data, create_only=create_only)


def _trainer_patch_fire(tr: Trained, root: str, chunk_bytes: int) -> Trainer:
    """The real trainer publisher attached to Adam, in its steady state: v0 is published (a snapshot), then
    WARM_STEPS versions of the same weights (empty patches), so that the measured step reuses the publisher's
    buffers as every step of a training run does, instead of paying a first step's allocations."""
    params, opt = tr.fresh()
    store = _ManifestClock(open_store(root))
    pub = Publisher(
        _masters_of(params),
        store,
        format=FMT,
        run=RUN,
        optimizer=opt,
        config=PublisherConfig(publisher_id="bench-trainer", chunk_bytes=chunk_bytes),
    )
    pub.flush()
    for _ in range(WARM_STEPS):
        pub.step()
        pub.flush()

    def fire() -> Fired:
        tr.step(params, opt)  # the publisher's post-step hook runs inside
        t0 = time.perf_counter()
        published = pub.flush()
        if published is None:
            return Fired(t0, store.committed_at)
        return Fired(t0, store.committed_at, dict(published.timings), published.part_bytes)

    return Trainer(fire, pub.close, WARM_STEPS)


def _trainer_full_fire(tr: Trained, root: str) -> Trainer:
    """A full-checkpoint trainer: v1 is the whole served view, written as a snapshot."""
    params, opt = tr.fresh()
    store = _ManifestClock(open_store(root))
    board = BoardWriter(store, RUN, publisher_id="bench-trainer")
    board.publish_snapshot(tr.v0, version=0, view_fp=tr.fp0, served_format=FMT)

    def fire() -> Fired:
        tr.step(params, opt)
        t0 = time.perf_counter()
        view = served_view(_masters_of(params)(), FMT)
        board.publish_snapshot(view, version=1, view_fp=FingerprintTable.of(view).view_fp(), served_format=FMT)
        return Fired(t0, store.committed_at)

    return Trainer(fire, lambda: None, 0)


def run_method(method: str, tr: Trained, n: int, rate: float, timeout_s: float, *, stream: bool = True) -> Outcome:
    """One run of ``method`` ("patch", "relay" or "full") with ``n`` replicas behind links of ``rate`` B/s.
    ``stream=False``: the trainer uploads its part whole and direct replicas do not fetch ahead."""
    with tempfile.TemporaryDirectory(prefix="flipsync-xr-") as root:
        if method == "full":
            trainer = _trainer_full_fire(tr, root)
        else:
            trainer = _trainer_patch_fire(tr, root, CHUNK_BYTES if stream else WHOLE)
        head = trainer.head
        try:
            if method != "relay":
                stores = [ThrottledStore(open_store(root), UNLIMITED) for _ in range(n)]
                readers = [_ahead(s) if stream else s for s in stores]
                replicas = [
                    _boot(r, MemoryEngine(tr.v0, tr.table0, served_format=FMT), head, timeout_s) for r in readers
                ]
                for s in stores:
                    s.bucket, s.bytes_read = TokenBucket(rate), 0
                out = _race(replicas, trainer.fire, head + 1, tr.v1, timeout_s)
                out.wan_bytes = sum(s.bytes_read for s in stores)
                return out
            upstream = ThrottledStore(open_store(root), UNLIMITED)
            cache = RelayCache(upstream, RelayConfig(watch_interval_s=RELAY_WATCH_S))
            server = ServerThread(create_relay_app(cache)).start()
            https: list[HttpStore] = []
            try:
                url = f"http://127.0.0.1:{server.port}"
                https = [HttpStore(url, timeout_s=timeout_s) for _ in range(n)]
                replicas = [_boot(h, MemoryEngine(tr.v0, tr.table0, served_format=FMT), head, timeout_s) for h in https]
                upstream.bucket, upstream.bytes_read = TokenBucket(rate), 0
                out = _race(replicas, trainer.fire, head + 1, tr.v1, timeout_s)
                out.wan_bytes = upstream.bytes_read
                return out
            finally:
                for h in https:
                    h.close()
                server.stop()
                cache.close()
        finally:
            trainer.close()


def apply_seconds(tr: Trained, repeat: int = 3) -> float:
    """Stage + commit of the patch on one engine (a replica's CPU per update); best of ``repeat`` after a
    warm-up that compiles the kernels."""
    best = math.inf
    for i in range(repeat + 1):
        engine = MemoryEngine(tr.v0, served_format=FMT)
        t0 = time.perf_counter()
        engine.commit(engine.stage(Patch.from_bytes(tr.patch)))
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def load_seconds(tr: Trained, repeat: int = 2) -> float:
    """Read a full v1 snapshot from a local board, load it into an engine and fingerprint it (a replica's CPU
    for a full checkpoint); best of ``repeat``."""
    with tempfile.TemporaryDirectory(prefix="flipsync-xr-") as root:
        board = BoardWriter(open_store(root), RUN, publisher_id="bench-trainer")
        board.publish_snapshot(tr.v0, version=0, view_fp=tr.fp0, served_format=FMT)
        board.publish_snapshot(tr.v1, version=1, view_fp=tr.fp1, served_format=FMT)
        engine = MemoryEngine(tr.v0, served_format=FMT)
        best = math.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            engine.load_view(BoardReader(open_store(root), RUN).load_keyframe(1))
            if engine.table.view_fp() != tr.fp1:
                raise VerificationError("the loaded snapshot is not v1")
            best = min(best, time.perf_counter() - t0)
        return best
