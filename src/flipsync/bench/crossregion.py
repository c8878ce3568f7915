"""``flipsync bench crossregion``: from ``optimizer.step()`` returning to the last replica verified, over WAN links.

**Trainer.** FP32 masters (four Llama-sized ``(rows, 1024)`` matrices, N(0, 0.02^2)) trained by
``torch.optim.Adam`` (lr 1e-6, betas 0.9/0.999) on Gaussian-noise gradients; a few warm-up steps, then one
measured step. The state after the warm-up and the measured step's gradient are kept, and every run restores
them: every method and every repeat publishes the same v0 -> v1 (checked bit for bit at every replica).
The served view is bf16; what changes in it comes from real Adam absorption at that learning rate.

**Clock.** It starts when ``optimizer.step()`` returns, and stops when the last replica holds v1 with its
fingerprint verified. For patches the step runs with the real trainer publisher attached
(``flipsync.trainer.Publisher``, background mode: the post-step hook hands the masters to the view thread,
then diff, encode and upload run on the worker), warmed by two versions of unchanged weights first so that
the measured step is a steady-state one (pooled buffers); for full checkpoints the trainer casts the masters to bf16,
fingerprints them and writes them as a snapshot (``board.Publisher.publish_snapshot``). Both therefore include
the trainer's own work, the board write (a local directory), the replicas' polling, download, decode,
apply and verification.

**Replicas.** N real reconcile loops (``Replica`` + ``BoardReader``) over a light in-memory engine
(``DictEngine``: a dict of tensors kept current by ``codec.stage``/``codec.commit``, fingerprint checked), so 16
fit in memory; all in this process, sharing this machine's cores. Their engines start holding v0, which they
find on the board.

**Links.** Each replica reads the board through its own link, ``ThrottledStore(open_store(dir), B)``: a token
bucket in the store client (``flipsync.board.throttle``) charges every byte read, refills at B bytes/s and
holds at most 50 ms of traffic. It models bandwidth only (no latency, no loss); writes are not limited.

**Methods.** *patch*: every replica fetches the patch over its own link. *patch + relay*: one relay per island
(``flipsync relay``: a read-through cache over HTTP); only the relay's upstream is limited, so the WAN
carries each object once (WAN bytes = the relay's upstream bytes). *full*: the trainer publishes the whole
served view and every replica downloads and loads it over its own link.

**Cost model.** Per-unit costs fitted from separate measurements: trainer seconds per byte of served view
(from the N=1 runs' step-to-published time), wire seconds per byte (1/B), receiver seconds per changed value
(stage + commit on one engine) or per byte (keyframe read + load + fingerprint), and a fixed per-update
latency (polling, manifests: the unlimited-link run minus its trainer and receiver parts). Receivers share
the machine's cores: their CPU terms scale by max(1, N / cores). The model then extrapolates to a 500 GB
bf16 served view.
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from rich.console import Console
from rich.table import Table

from flipsync.bench.report import Figures, md_table, pyplot, save_figure
from flipsync.board.ahead import FetchAhead
from flipsync.board.reader import BoardReader
from flipsync.board.store import Store, StoreWrapper, open_store
from flipsync.board.throttle import ThrottledStore, TokenBucket, parse_bandwidth
from flipsync.board.writer import BoardWriter
from flipsync.codec import FingerprintTable, Patch, StagedWrite, UndoRecord, diff_views, int_view
from flipsync.codec import commit as codec_commit
from flipsync.codec import stage as codec_stage
from flipsync.engines.base import Engine
from flipsync.errors import BaseMismatchError, EngineError, VerificationError
from flipsync.formats import served_view
from flipsync.relay.client import HttpStore
from flipsync.relay.server import RelayCache, RelayConfig, create_relay_app
from flipsync.sidecar.replica import Replica, ReplicaConfig
from flipsync.sidecar.server import ServerThread
from flipsync.trainer import Publisher as TrainerPublisher
from flipsync.trainer.commit import DEFAULT_CHUNK_BYTES

RUN = "bench"
RELAY_WATCH_S = 0.01  # the relay checks the board for a waited-for manifest this often (direct replicas: 2 ms)
FETCH_AHEAD_S = 0.01  # replicas list the next version's folder this often while they wait
CHUNK_BYTES = 16 << 10  # the trainer streams its part in chunks of this size (the default 8 MiB is for GB patches)
WHOLE = 1 << 62  # a chunk size no part fills: the part goes up whole, after the diff
STREAM_CHECK = "20mbit"  # the link of the streaming on/off check: the wire outweighs the trainer there
CALIBRATION_RUNS = 3  # odd: each calibration median is one run's, so a single slow run cannot move it
WARM_STEPS = 2  # versions a patch trainer publishes before the measured step (its buffers then get reused)
FMT = "bf16"
UNLIMITED = 1e12
TARGET_BYTES = 500e9  # the extrapolation: a 500 GB served view
COLS = 1024
METHODS = ("patch", "relay", "full")
METHOD_LABEL = {"patch": "patch", "relay": "patch + relay", "full": "full checkpoint"}
# The parallel model's assumptions: the trainer's view is diffed by this many shards at once (e.g. 8 nodes
# x 8 GPUs, each diffing its own slice), and each receiver stages on this many cores.
TRAINER_SHARDS = 64
RECEIVER_CORES = 32


@dataclass(frozen=True)
class Setup:
    elements: int
    replicas: tuple[int, ...]
    bandwidths: tuple[str, ...]
    repeats: int
    lr: float = 1e-6
    warmup: int = 2
    timeout_s: float = 300.0


QUICK = Setup(2 << 20, (1, 4), ("100mbit", "1gbit", "10gbit"), repeats=1)
FULL = Setup(16 << 20, (1, 4, 16), ("100mbit", "1gbit", "10gbit"), repeats=3)


@dataclass
class DictStaged:
    writes: list[StagedWrite]
    target_view: str


class DictEngine(Engine):
    """An engine that is only its served view: a dict of tensors kept current by codec stage/commit."""

    name: ClassVar[str] = "dict"

    def __init__(self, view: Mapping[str, torch.Tensor], table: FingerprintTable | None = None) -> None:
        """``table``: the view's fingerprints when the caller has them (16 replicas need not hash v0 16 times)."""
        self._served = {k: v.clone() for k, v in view.items()}
        self._table = table.copy() if table is not None else FingerprintTable.of(self._served)
        self._lock = threading.Lock()

    @property
    def table(self) -> FingerprintTable:
        return self._table

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._served

    def load_view(self, view: Mapping[str, torch.Tensor]) -> None:
        if set(view) != set(self._served):
            raise EngineError("the view does not have this engine's tensors")
        with self._lock:
            for k, src in view.items():
                int_view(self._served[k]).copy_(int_view(src.contiguous()))
            self._table = FingerprintTable.of(self._served)

    def stage(self, patch: Patch) -> DictStaged:
        fmt = patch.header.served_format
        if fmt is not None and fmt != FMT:
            raise BaseMismatchError(f"the patch is for {fmt!r}, this engine serves {FMT!r}")
        return DictStaged(codec_stage(self._served, patch, self._table), patch.header.target.view)

    def commit(self, staged: Any) -> UndoRecord:
        if not isinstance(staged, DictStaged):
            raise EngineError(f"commit expects what DictEngine.stage returned, not {type(staged).__name__}")
        with self._lock:
            record = codec_commit(self._served, staged.writes, self._table)
            if self._table.view_fp() != staged.target_view:
                record.rollback(self._served, self._table)
                raise VerificationError("after the commit the engine does not hold the patch's target; rolled back")
        return record

    def rollback(self, undo: Any) -> None:
        if not isinstance(undo, UndoRecord):
            raise EngineError(f"rollback expects an UndoRecord, not {type(undo).__name__}")
        with self._lock:
            undo.rollback(self._served, self._table)

    def recompute_table(self) -> FingerprintTable:
        with self._lock:
            return FingerprintTable.of(self._served)


class Trained:
    """Masters after ``warmup`` Adam steps, Adam's state and the measured step's gradient.

    ``fresh()`` rebuilds the parameters and optimizer from them, so every run takes the same step.
    """

    def __init__(self, elements: int, lr: float, warmup: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        rows = max(1, elements // 4 // COLS)
        params = {
            f"model.layers.{i}.mlp.weight": torch.nn.Parameter(torch.randn(rows, COLS, generator=g) * 0.02)
            for i in range(4)
        }
        opt = torch.optim.Adam(params.values(), lr=lr, betas=(0.9, 0.999))
        scale = {k: (torch.rand(rows, 1, generator=g) + 0.5) for k in params}

        def noise() -> dict[str, torch.Tensor]:
            return {k: torch.randn(rows, COLS, generator=g) * scale[k] for k in scale}

        for _ in range(warmup):
            for k, grad in noise().items():
                params[k].grad = grad
            opt.step()
        self.lr = lr
        self.masters = {k: p.detach().clone() for k, p in params.items()}
        self.opt_state = copy.deepcopy(opt.state_dict())
        self.grads = noise()
        del params, opt
        self.v0 = served_view(self.masters, FMT)
        p1, o1 = self.fresh()
        self.step(p1, o1)
        self.v1 = served_view({k: p.detach() for k, p in p1.items()}, FMT)
        del p1, o1
        t0 = FingerprintTable.of(self.v0)
        self.table0 = t0
        patch, t1 = diff_views(self.v0, self.v1, old_table=t0, base_version=0, target_version=1, served_format=FMT)
        self.fp0, self.fp1 = t0.view_fp(), t1.view_fp()
        self.patch = patch.to_bytes()
        self.changed = sum(int((int_view(self.v0[k]) != int_view(self.v1[k])).sum()) for k in self.v0)

    @property
    def view_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.v0.values())

    @property
    def elements(self) -> int:
        return sum(t.numel() for t in self.v0.values())

    def fresh(self) -> tuple[dict[str, torch.nn.Parameter], torch.optim.Optimizer]:
        params = {k: torch.nn.Parameter(v.clone()) for k, v in self.masters.items()}
        opt = torch.optim.Adam(params.values(), lr=self.lr, betas=(0.9, 0.999))
        opt.load_state_dict(copy.deepcopy(self.opt_state))
        return params, opt

    def step(self, params: Mapping[str, torch.nn.Parameter], opt: torch.optim.Optimizer) -> None:
        for k, p in params.items():
            p.grad = self.grads[k].clone()
        opt.step()


def same_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(int_view(a[k]), int_view(b[k])) for k in a)


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


def _boot(store: Store, engine: DictEngine, head: int, timeout_s: float) -> Replica:
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


@dataclass(frozen=True)
class Fired:
    """One measured step: when the clock started, when the version was committed, the publisher's phases."""

    start: float
    published: float
    phases: Mapping[str, float] = field(default_factory=dict)


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
    ok = all(isinstance(r.engine, DictEngine) and same_bits(r.engine.tensors, v1) for r in replicas)
    return Outcome(max(done) - fired.start, fired.published - fired.start, ok, 0, fired.phases)


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
    pub = TrainerPublisher(
        _masters_of(params),
        store,
        format=FMT,
        run=RUN,
        optimizer=opt,
        publisher_id="bench-trainer",
        chunk_bytes=chunk_bytes,
    )
    pub.flush()
    for _ in range(WARM_STEPS):
        pub.step()
        pub.flush()

    def fire() -> Fired:
        tr.step(params, opt)  # the publisher's post-step hook runs inside
        t0 = time.perf_counter()
        published = pub.flush()
        return Fired(t0, store.committed_at, dict(published.timings) if published is not None else {})

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
                replicas = [_boot(r, DictEngine(tr.v0, tr.table0), head, timeout_s) for r in readers]
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
                replicas = [_boot(h, DictEngine(tr.v0, tr.table0), head, timeout_s) for h in https]
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
        engine = DictEngine(tr.v0)
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
        engine = DictEngine(tr.v0)
        best = math.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            engine.load_view(BoardReader(open_store(root), RUN).load_keyframe(1))
            if engine.table.view_fp() != tr.fp1:
                raise VerificationError("the loaded snapshot is not v1")
            best = min(best, time.perf_counter() - t0)
        return best


@dataclass(frozen=True)
class CostModel:
    """Per-unit costs; ``predict`` adds them up for one update."""

    trainer_patch_s_per_byte: float  # step returned -> patch on the board, per byte of served view
    trainer_full_s_per_byte: float  # step returned -> full view on the board, per byte
    trainer_patch_fixed_s: float  # the same, per publication whatever the size (threads, manifests)
    trainer_full_fixed_s: float
    receiver_s_per_change: float  # stage + commit, per changed value
    receiver_full_s_per_byte: float  # read + load + fingerprint of a full view, per byte
    fixed_s: float  # per update: polling, manifests, request latency
    relay_fixed_s: float  # the same through a relay (one more hop, HTTP)
    cores: int

    def predict(
        self,
        method: str,
        n: int,
        rate: float,
        view_bytes: float,
        changed: float,
        patch_bytes: float,
        *,
        trainer_shards: int = 1,
        receiver_cores: int = 1,
        chunk_bytes: float | None = None,
    ) -> float:
        """Seconds for one update. ``chunk_bytes``: the patch is streamed in chunks of this size (each shard's
        part), so its transfer overlaps the trainer's work; None: one after the other."""
        share = max(1.0, n / self.cores)  # replicas on this machine share its cores
        if method == "full":
            return (
                self.trainer_full_fixed_s
                + self.trainer_full_s_per_byte * view_bytes / trainer_shards
                + self.fixed_s
                + view_bytes / rate
                + self.receiver_full_s_per_byte * view_bytes * share / receiver_cores
            )
        trainer = self.trainer_patch_s_per_byte * view_bytes / trainer_shards
        wire = patch_bytes / rate
        if chunk_bytes is None:
            publish_and_send = trainer + wire
        else:
            # The first chunks leave once each shard has coded one; after the trainer's last section, every
            # shard's last chunk (at most one each) and header still have to cross.
            first = trainer * min(1.0, chunk_bytes * trainer_shards / patch_bytes) if patch_bytes else trainer
            tail = min(patch_bytes, chunk_bytes * trainer_shards) / rate
            publish_and_send = max(first + wire, trainer + tail)
        return (
            self.trainer_patch_fixed_s
            + publish_and_send
            + (self.relay_fixed_s if method == "relay" else self.fixed_s)
            + self.receiver_s_per_change * changed * share / receiver_cores
        )


def _line(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """(fixed, per unit) of the line through two (size, seconds) points; neither below zero (noise)."""
    if b[0] <= a[0]:  # one size only: no fixed part can be told apart
        return 0.0, b[1] / b[0]
    slope = max(0.0, (b[1] - a[1]) / (b[0] - a[0]))
    fixed = max(0.0, b[1] - slope * b[0])
    if fixed == 0.0:  # the points say nothing fixed: all of it per byte, through the larger point
        slope = b[1] / b[0]
    return fixed, slope


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def fmt_s(s: float) -> str:
    if s < 10:
        return f"{s * 1e3:.0f} ms"
    if s < 1000:
        return f"{s:.1f} s"
    return f"{s:,.0f} s"


def fmt_range(st: Mapping[str, float]) -> str:
    if st["max"] <= st["min"] * 1.0005:
        return fmt_s(st["median"])
    return f"{fmt_s(st['median'])} ({fmt_s(st['min'])}-{fmt_s(st['max'])})"


def run(
    console: Console,
    quick: bool = False,
    *,
    setup: Setup | None = None,
    rates: Sequence[tuple[str, float, float]] = (),
) -> dict[str, Any]:
    """Measure every (link, N, method) cell ``setup.repeats`` times, fit the cost model, extrapolate.

    ``rates``: (source, changed fraction, bytes per change) for each 500 GB extrapolation (``bench all`` passes
    the codec section's BF16 lr 1e-6 row of every workload); by default this benchmark's own step.
    """
    setup = setup or (QUICK if quick else FULL)
    with console.status("crossregion bench: warm-up Adam steps"):
        tr = Trained(setup.elements, setup.lr, setup.warmup)
    console.print(
        f"served view {tr.view_bytes / 1e6:.1f} MB bf16, one Adam step at lr {setup.lr:g}: {tr.changed:,} values "
        f"changed ({100 * tr.changed / tr.elements:.2f}%), patch {len(tr.patch) / 1e3:.1f} kB "
        f"({len(tr.patch) / tr.changed:.3f} B/changed)"
    )
    runs: dict[tuple[str, int, str], list[Outcome]] = {}
    calibration: dict[str, list[Outcome]] = {m: [] for m in METHODS}
    with console.status("crossregion bench") as status:
        status.update("crossregion bench: calibration (unlimited link, N=1)")
        apply_s = apply_seconds(tr)
        load_s = load_seconds(tr)
        for _ in range(CALIBRATION_RUNS):
            for m in calibration:
                calibration[m].append(run_method(m, tr, 1, UNLIMITED, setup.timeout_s))
        # A second, smaller view separates the trainer's per-publication cost from its per-byte cost.
        status.update("crossregion bench: calibration, a view 1/8 the size")
        small = Trained(max(1 << 16, setup.elements // 8), setup.lr, setup.warmup)
        small_runs: dict[str, list[Outcome]] = {m: [] for m in ("patch", "full")}
        for _ in range(CALIBRATION_RUNS):
            for m in small_runs:
                small_runs[m].append(run_method(m, small, 1, UNLIMITED, setup.timeout_s))
        status.update(f"crossregion bench: streaming on and off, N=1, {STREAM_CHECK}")
        check_rate = parse_bandwidth(STREAM_CHECK)
        check: dict[bool, list[Outcome]] = {True: [], False: []}
        for _ in range(setup.repeats):
            for on in (True, False):
                check[on].append(run_method("patch", tr, 1, check_rate, setup.timeout_s, stream=on))
        for bw in setup.bandwidths:
            rate = parse_bandwidth(bw)
            for n in setup.replicas:
                for rep in range(setup.repeats):
                    for m in METHODS:  # interleaved, so load from elsewhere hits every method alike
                        status.update(f"crossregion bench: {bw}, N={n}, {METHOD_LABEL[m]}, run {rep + 1}")
                        runs.setdefault((bw, n, m), []).append(run_method(m, tr, n, rate, setup.timeout_s))
    cal_patch = statistics.median(o.seconds - o.publish_s for o in calibration["patch"])
    cal_relay = statistics.median(o.seconds - o.publish_s for o in calibration["relay"])
    one = [o for (_, n, m), os_ in runs.items() if n == 1 and m == "patch" for o in os_] + calibration["patch"]
    one_full = [o for (_, n, m), os_ in runs.items() if n == 1 and m == "full" for o in os_] + calibration["full"]
    trainer_patch = _line(
        (small.view_bytes, statistics.median(o.publish_s for o in small_runs["patch"])),
        (tr.view_bytes, statistics.median(o.publish_s for o in one)),
    )
    trainer_full = _line(
        (small.view_bytes, statistics.median(o.publish_s for o in small_runs["full"])),
        (tr.view_bytes, statistics.median(o.publish_s for o in one_full)),
    )
    model = CostModel(
        trainer_patch_s_per_byte=trainer_patch[1],
        trainer_full_s_per_byte=trainer_full[1],
        trainer_patch_fixed_s=trainer_patch[0],
        trainer_full_fixed_s=trainer_full[0],
        receiver_s_per_change=apply_s / tr.changed,
        receiver_full_s_per_byte=load_s / tr.view_bytes,
        fixed_s=max(0.0, cal_patch - apply_s),
        relay_fixed_s=max(0.0, cal_relay - apply_s),
        cores=os.cpu_count() or 1,
    )
    rows = []
    for bw in setup.bandwidths:
        rate = parse_bandwidth(bw)
        for n in setup.replicas:
            row: dict[str, Any] = {"bandwidth": bw, "bytes_per_s": rate, "replicas": n}
            for m in METHODS:
                os_ = runs[(bw, n, m)]
                row[m] = _stats([o.seconds for o in os_])
                row[m]["runs"] = [o.seconds for o in os_]
                row[m]["model"] = model.predict(
                    m, n, rate, tr.view_bytes, tr.changed, len(tr.patch), chunk_bytes=CHUNK_BYTES
                )
                row[m]["wan_bytes"] = statistics.median(o.wan_bytes for o in os_)
                row[m]["publish_s"] = statistics.median(o.publish_s for o in os_)
            row["bitwise"] = all(o.bitwise for m in METHODS for o in runs[(bw, n, m)])
            rows.append(row)
    streaming: dict[str, Any] = {"bandwidth": STREAM_CHECK, "chunk_bytes": CHUNK_BYTES}
    for on, label in ((True, "streamed"), (False, "whole")):
        streaming[label] = _stats([o.seconds for o in check[on]])
        streaming[label]["bitwise"] = all(o.bitwise for o in check[on])
        streaming[label]["model"] = model.predict(
            "patch", 1, check_rate, tr.view_bytes, tr.changed, len(tr.patch), chunk_bytes=CHUNK_BYTES if on else None
        )
    rates = rates or [("this benchmark's own step", tr.changed / tr.elements, len(tr.patch) / tr.changed)]
    result: dict[str, Any] = {
        "setup": asdict(setup),
        "elements": tr.elements,
        "view_bytes": tr.view_bytes,
        "changed": tr.changed,
        "patch_bytes": len(tr.patch),
        "bytes_per_changed": len(tr.patch) / tr.changed,
        "apply_s": apply_s,
        "load_s": load_s,
        "calibration": {m: [o.seconds for o in os_] for m, os_ in calibration.items()},
        "calibration_small": {
            "view_bytes": small.view_bytes,
            **{m: [o.publish_s for o in os_] for m, os_ in small_runs.items()},
        },
        "model": asdict(model),
        "trainer_phases": _phases_per_byte(one, tr.view_bytes),
        "rows": rows,
        "streaming": streaming,
        "extrapolations": [extrapolate(model, setup.bandwidths, frac, bpc, src) for src, frac, bpc in rates],
    }
    for t in tables(result):
        console.print(t)
    return result


def _phases_per_byte(outcomes: Sequence[Outcome], view_bytes: int) -> dict[str, float]:
    """The trainer publisher's own account of where a patch's time went (medians), in seconds per view byte."""
    timed = [o.phases for o in outcomes if o.phases]
    keys = timed[0].keys() if timed else ()
    return {k: statistics.median(t[k] for t in timed) / view_bytes for k in keys}


def extrapolate(
    model: CostModel, bandwidths: tuple[str, ...], changed_fraction: float, bytes_per_change: float, source: str
) -> dict[str, Any]:
    """The cost model for one replica of a 500 GB bf16 view: this machine as measured, and the parallel model."""
    changed = changed_fraction * TARGET_BYTES / 2
    patch_bytes = bytes_per_change * changed
    rows = []
    for bw in bandwidths:
        rate = parse_bandwidth(bw)
        row: dict[str, Any] = {"bandwidth": bw}
        for label, shards, cores in (("single", 1, 1), ("parallel", TRAINER_SHARDS, RECEIVER_CORES)):
            p = model.predict(
                "patch",
                1,
                rate,
                TARGET_BYTES,
                changed,
                patch_bytes,
                trainer_shards=shards,
                receiver_cores=cores,
                chunk_bytes=DEFAULT_CHUNK_BYTES,
            )
            f = model.predict(
                "full", 1, rate, TARGET_BYTES, changed, patch_bytes, trainer_shards=shards, receiver_cores=cores
            )
            row[label] = {"patch_s": p, "full_s": f, "ratio": f / p}
        row["wire_ratio"] = TARGET_BYTES / patch_bytes
        rows.append(row)
    return {
        "view_bytes": TARGET_BYTES,
        "changed_fraction": changed_fraction,
        "bytes_per_change": bytes_per_change,
        "source": source,
        "changed": changed,
        "patch_bytes": patch_bytes,
        "trainer_shards": TRAINER_SHARDS,
        "receiver_cores": RECEIVER_CORES,
        "chunk_bytes": DEFAULT_CHUNK_BYTES,
        # What streaming the full checkpoint too could save at most: its (parallel) trainer and receiver terms.
        "full_overlap_s": model.trainer_full_fixed_s
        + model.trainer_full_s_per_byte * TARGET_BYTES / TRAINER_SHARDS
        + model.receiver_full_s_per_byte * TARGET_BYTES / RECEIVER_CORES,
        "rows": rows,
    }


def full_over_patch(row: Mapping[str, Any]) -> float:
    """A measured cell's full-checkpoint median over its patch median."""
    return float(row["full"]["median"] / row["patch"]["median"])


def _relay_wan_share(row: Mapping[str, Any], patch_bytes: int) -> float:
    """The relay's upstream (WAN) bytes over what N direct readers would fetch: 1/N means once per island."""
    return float(row["relay"]["wan_bytes"] / (row["replicas"] * patch_bytes))


def tables(result: Mapping[str, Any]) -> list[Table]:
    t = Table(title="optimizer.step() returned -> last replica verified: median (min-max) | cost model")
    for col in ("link", "N", *(METHOD_LABEL[m] for m in METHODS), "full / patch", "relay WAN / (N x patch)", "ok"):
        t.add_column(col, justify="right")
    for r in result["rows"]:
        t.add_row(
            r["bandwidth"],
            str(r["replicas"]),
            *(f"{fmt_range(r[m])} | {fmt_s(r[m]['model'])}" for m in METHODS),
            f"{full_over_patch(r):.1f}x",
            f"{_relay_wan_share(r, result['patch_bytes']):.2f}",
            "yes" if r["bitwise"] else "NO",
        )
    st = result["streaming"]
    y = Table(title=f"streaming on and off: N=1, {st['bandwidth']}, patch: median (min-max) | cost model")
    for col in ("part", "measured", "model", "ok"):
        y.add_column(col, justify="right")
    for label, cells in _streaming_cells(st):
        y.add_row(label, *cells)
    e = result["extrapolations"][0]
    x = Table(
        title=f"model: 500 GB bf16 view, {100 * e['changed_fraction']:.2f}% changed, "
        f"{e['bytes_per_change']:.3f} B/change ({e['source']}), patch {e['patch_bytes'] / 1e9:.2f} GB"
    )
    for col in ("link", "patch (this machine)", "full", "ratio", "patch (parallel model)", "full", "ratio", "wire"):
        x.add_column(col, justify="right")
    for r in e["rows"]:
        x.add_row(*_extrapolation_cells(r))
    return [t, y, x]


def _streaming_cells(st: Mapping[str, Any]) -> list[tuple[str, tuple[str, str, str]]]:
    labels = {"streamed": f"streamed in {st['chunk_bytes'] >> 10} KiB chunks, fetched ahead", "whole": "whole"}
    return [
        (labels[k], (fmt_range(st[k]), fmt_s(st[k]["model"]), "yes" if st[k]["bitwise"] else "NO"))
        for k in ("streamed", "whole")
    ]


def _extrapolation_cells(r: Mapping[str, Any], bold: str = "") -> tuple[str, ...]:
    s, p = r["single"], r["parallel"]
    return (
        r["bandwidth"],
        fmt_s(s["patch_s"]),
        fmt_s(s["full_s"]),
        f"{bold}{s['ratio']:.1f}x{bold}",
        fmt_s(p["patch_s"]),
        fmt_s(p["full_s"]),
        f"{bold}{p['ratio']:.1f}x{bold}",
        f"{r['wire_ratio']:.0f}x",
    )


ABOUT = """**Trainer.** FP32 masters (four `(rows, 1024)` matrices, N(0, 0.02^2)) trained by `torch.optim.Adam`
(lr {lr:g}, betas 0.9/0.999) on Gaussian-noise gradients: {warmup} warm-up steps, then one measured step. Every
run restores the state after the warm-up and takes the same step, so every method and repeat ships the same
v0 -> v1; every replica's tensors are compared bit for bit with the expected v1 (*bitwise*).

**Clock.** From `optimizer.step()` returning to the last replica holding v1 with its fingerprint verified.
*patch* and *patch + relay*: the step runs with the real trainer publisher attached (`flipsync.trainer.Publisher`,
background mode: the post-step hook hands the masters to the view thread; diff, encode and upload run on the
worker), after two versions of unchanged weights, so the measured step is a steady-state one (its buffers are
reused, as in every step of a training run; the replicas start from that HEAD). *full checkpoint*: the trainer
casts the masters to BF16, fingerprints them and writes the whole view as a snapshot
(`board.Publisher.publish_snapshot`). Both include the trainer's work, the board write (a local directory), the
replicas' polling, download, decode, apply and verification.

**Streaming.** The trainer uploads its part in {chunk_kib} KiB chunks while it codes it (`chunk_bytes`; the
default, 8 MiB, is sized for GB patches), and commits the manifest once all are up. Each direct replica watches
the next version's folder every 10 ms (`flipsync.board.ahead.FetchAhead`, `flipsync sidecar --fetch-ahead`) and
downloads the chunks as they land; a relay does the same for its island while its sidecars wait.

**Replicas.** N real reconcile loops (`Replica` + `BoardReader`) over a light in-memory
engine (`DictEngine`: a dict of tensors kept current by `codec.stage`/`codec.commit`, fingerprint checked),
all in this process and sharing this machine's {cores} cores, so above {cores} replicas their CPU work queues.

**Links.** Each replica reads the board through its own link: a token bucket in the store client
(`flipsync.board.throttle.ThrottledStore`) charges every byte read, refills at the link's rate and holds at most
50 ms of traffic. It models bandwidth only (no latency, no loss); writes are not limited. *patch + relay*: one
relay per island (`flipsync relay`, a read-through cache over HTTP); only the relay's upstream is limited, so
the WAN carries each object once (*relay WAN / (N x patch)* is the relay's upstream bytes over what N direct
replicas would fetch).

Each cell ran {repeats} time(s), methods interleaved; shown: median (min-max), then the cost model's
prediction."""

MODEL_ABOUT = """**Cost model.** Per-unit costs, each from its own measurement: *trainer* seconds per publication plus
seconds per byte of served view (the line through the median step-to-published times of the N = 1 runs on
this view and of unlimited-link runs on a view 1/8 its size; the fixed part is not divided among shards); *wire*
1/B per byte at link rate B; *receiver* seconds per changed value (stage + commit of the patch on one engine,
best of 3) or, for a full checkpoint, per byte (read the snapshot from the local board, load it, fingerprint
it); *fixed* seconds per update (polling, manifests: an unlimited-link N = 1 run minus its trainer and
receiver parts, for direct reads and through a relay). A full checkpoint's prediction is trainer + fixed +
bytes / B + receiver x max(1, N / cores) x view bytes. A streamed patch's transfer overlaps the trainer:
trainer + bytes / B becomes max(first + bytes / B, trainer + tail / B), where *first* is the trainer's time to
code its first chunk (trainer x chunk x shards / patch bytes) and *tail* the chunks still to cross when it ends
(at most one per shard); then + fixed + receiver x max(1, N / cores) x changed values. Left out: the relay's own CPU for
serving N replicas over local HTTP, and the cost of N polling Python threads sharing two cores beyond their
share of the decode and apply work; where the measured and model columns part (many replicas, the relay), that
is the gap."""


def _components(result: Mapping[str, Any]) -> str:
    m = result["model"]
    phases = result.get("trainer_phases") or {}
    split = ", ".join(f"{k} {v * 1e9:.2f}" for k, v in phases.items())
    rows = [
        (
            "trainer, patch",
            f"{fmt_s(m['trainer_patch_fixed_s'])} + {m['trainer_patch_s_per_byte'] * 1e9:.3f} ns/B",
            "view, diff, encode, upload"
            + (f" (the publisher's own timings, ns/B of the view: {split}; the view is the CPU cast)" if split else ""),
        ),
        (
            "trainer, full checkpoint",
            f"{fmt_s(m['trainer_full_fixed_s'])} + {m['trainer_full_s_per_byte'] * 1e9:.3f} ns/B",
            "cast, fingerprint, write",
        ),
        ("receiver, patch", f"{m['receiver_s_per_change'] * 1e9:.1f} ns/change", "stage + commit + verify"),
        ("receiver, full checkpoint", f"{m['receiver_full_s_per_byte'] * 1e9:.3f} ns/B", "read + load + fingerprint"),
        ("fixed per update", fmt_s(m["fixed_s"]), "polling and manifests"),
        ("fixed per update, via relay", fmt_s(m["relay_fixed_s"]), "the same plus one local HTTP hop"),
        ("wire", "1 / link rate", "token bucket"),
    ]
    return md_table(("component", "cost", "covers"), rows, left=3)


def _extrapolation_md(e: Mapping[str, Any], *, first: bool = True) -> str:
    rows = [_extrapolation_cells(r, bold="**") for r in e["rows"]]
    head = (
        "link",
        "patch, this machine",
        "full, this machine",
        "full / patch",
        "patch, parallel model",
        "full, parallel model",
        "full / patch",
        "bytes only",
    )
    if not first:
        return "\n\n".join(
            [
                f"The same model with the change rate of {e['source']}: {100 * e['changed_fraction']:.2f}% changed "
                f"at {e['bytes_per_change']:.3f} B per change, patch {e['patch_bytes'] / 1e9:.2f} GB.",
                md_table(head, rows),
            ]
        )
    return "\n\n".join(
        [
            f"**Extrapolation (a model, not a measurement).** One replica of a 500 GB BF16 served view "
            f"({e['changed'] / 1e9:.2f}G of 250G values changed = {100 * e['changed_fraction']:.2f}%, at "
            f"{e['bytes_per_change']:.3f} B per change, from {e['source']}): patch {e['patch_bytes'] / 1e9:.2f} GB "
            "against 500 GB. *This machine*: the per-unit costs as measured here, one trainer process and one "
            f"receiver core. *Parallel model*: assumes the trainer's view is diffed by {e['trainer_shards']} "
            f"shards at once (each rank its own slice, as `flipsync.trainer` does under torch.distributed) and "
            f"each receiver stages on {e['receiver_cores']} cores, with the same per-unit costs; the full "
            "checkpoint gets the same parallelism for its write and load. The patch is streamed in the trainer's "
            f"default {e['chunk_bytes'] >> 20} MiB chunks (the overlap term above); the full checkpoint is "
            "modelled as it is measured, written whole, then read and loaded: were it written and loaded while it "
            f"crosses the wire, it would save at most its trainer and receiver terms, {fmt_s(e['full_overlap_s'])} "
            "under the parallel model. *bytes only* is 500 GB over the patch bytes: the ratio if only the wire "
            "counted.",
            md_table(head, rows),
        ]
    )


def markdown(result: Mapping[str, Any], figures: Figures | None = None) -> str:
    setup = result["setup"]
    head = (
        f"Served view {result['view_bytes'] / 1e6:.1f} MB BF16 ({result['elements']:,} values); the measured step "
        f"changed {result['changed']:,} of them ({100 * result['changed'] / result['elements']:.2f}%); patch "
        f"{result['patch_bytes'] / 1e3:.1f} kB ({result['bytes_per_changed']:.3f} B per change); stage + commit on "
        f"one engine {result['apply_s'] * 1e3:.1f} ms; full snapshot read + load {result['load_s'] * 1e3:.0f} ms."
    )
    cells = []
    for r in result["rows"]:
        cells.append(
            (
                r["bandwidth"],
                str(r["replicas"]),
                *(x for m in METHODS for x in (fmt_range(r[m]), fmt_s(r[m]["model"]))),
                f"**{full_over_patch(r):.1f}x**",
                f"{_relay_wan_share(r, result['patch_bytes']):.2f}",
                "yes" if r["bitwise"] else "**NO**",
            )
        )
    table = md_table(
        (
            "link",
            "N",
            "patch",
            "model",
            "patch + relay",
            "model",
            "full checkpoint",
            "model",
            "full / patch",
            "relay WAN / (N x patch)",
            "bitwise",
        ),
        cells,
    )
    parts = [
        ABOUT.format(
            lr=setup["lr"],
            warmup=setup["warmup"],
            cores=result["model"]["cores"],
            repeats=setup["repeats"],
            chunk_kib=result["streaming"]["chunk_bytes"] >> 10,
        ),
        head,
        table,
        _streaming_md(result["streaming"]),
    ]
    if figures is not None:
        parts.append(figures.link(plot(result, figures.path("crossregion.png")).name, "update latency vs replicas"))
    parts += [MODEL_ABOUT, _components(result)]
    parts += [_extrapolation_md(e, first=i == 0) for i, e in enumerate(result["extrapolations"])]
    return "\n\n".join(parts)


def _streaming_md(st: Mapping[str, Any]) -> str:
    text = (
        f"**Streaming on and off** (N = 1, {st['bandwidth']}, patch, methods interleaved): on a link slow enough "
        "that the wire outweighs the trainer, the same step with the part streamed and fetched ahead, and with the "
        "part uploaded whole after the diff and fetched after the manifest (as before streaming). The model's "
        "overlap term is checked here, where the transfer hides the trainer's work, and in the cells above, "
        "where the trainer's work hides the transfer."
    )
    rows = [(label, *cells) for label, cells in _streaming_cells(st)]
    return "\n\n".join([text, md_table(("part", "measured", "model", "bitwise"), rows)])


def plot(result: Mapping[str, Any], path: Path) -> Path:
    """Latency against N, one panel per link: measured medians with min-max bars, the model dashed."""
    plt = pyplot()
    links = list(dict.fromkeys(r["bandwidth"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(links), figsize=(4.2 * len(links), 3.8), squeeze=False, sharey=True)
    for ax, bw in zip(axes[0], links, strict=True):
        mine = [r for r in result["rows"] if r["bandwidth"] == bw]
        ns = [r["replicas"] for r in mine]
        for i, m in enumerate(METHODS):
            med = [r[m]["median"] for r in mine]
            err = [[r[m]["median"] - r[m]["min"] for r in mine], [r[m]["max"] - r[m]["median"] for r in mine]]
            ax.errorbar(ns, med, yerr=err, fmt="-o", color=f"C{i}", label=METHOD_LABEL[m], capsize=3)
            ax.plot(
                ns, [r[m]["model"] for r in mine], "--", color=f"C{i}", alpha=0.6, label=f"{METHOD_LABEL[m]} (model)"
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_yscale("log")
        ax.set_title(bw, fontsize=10)
        ax.set_xlabel("replicas N")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("step returned -> last replica verified (s)")
    axes[0][-1].legend(fontsize=7)
    return save_figure(fig, path)
