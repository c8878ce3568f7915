"""``flipsync bench crossregion``: how long a policy update takes to reach every replica across a WAN link.

A board lives in a local temp directory; every replica reads it through its own bandwidth-limited link,
``ThrottledStore(open_store(dir), B)``. The limiter is a **token bucket in the store client**
(``flipsync.board.throttle``): each byte read costs a token, tokens refill at B, bursts are capped at 50 ms of
traffic. It models the link's bandwidth only (no latency, no loss), and it runs in the reader's process.

The served view is synthetic bf16 (a few Llama-sized matrices, N(0, 0.02^2)); v1 moves 1% of its values by
one bit-pattern step (the typical change of one Adam step at RL learning rates). Each replica is the real
reconcile loop (``Replica`` + ``BoardReader``) over a light in-memory engine (``DictEngine``: a dict of
tensors, ``codec.stage``/``codec.commit``), so 16 replicas fit in memory. Replicas boot at v0 through an
unlimited bucket, then their links are limited. The clock starts when the publish call starts and stops
when the last replica holds v1 with its fingerprint verified.

Methods: **patch** (every replica fetches the patch over its own link), **patch+relay** (one relay per
island; only the relay's upstream is limited, so the WAN carries each object once; WAN bytes = the relay's
upstream bytes), **full** (every replica downloads the v1 keyframe over its link and loads it).

On a 2-core machine 10 Gbit/s is CPU-bound: loopback reads, decoding and 16 threads compete for 2 cores, so
the measured time there is a floor set by this machine, not by the link.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from flipsync.board.publish import Publisher
from flipsync.board.reader import BoardReader
from flipsync.board.store import open_store
from flipsync.board.throttle import ThrottledStore, TokenBucket, parse_bandwidth
from flipsync.codec import FingerprintTable, Patch, UndoRecord, diff_views
from flipsync.codec import commit as codec_commit
from flipsync.codec import stage as codec_stage
from flipsync.codec.apply import StagedWrite
from flipsync.codec.bits import int_view
from flipsync.errors import BaseMismatchError, EngineError, VerificationError
from flipsync.sidecar.engine import Engine
from flipsync.sidecar.http_store import HttpStore
from flipsync.sidecar.relay import RelayCache, create_relay_app
from flipsync.sidecar.replica import Replica, ReplicaConfig
from flipsync.sidecar.server import ServerThread

RUN = "bench"
FMT = "bf16"
UNLIMITED = 1e12
CHANGED = 0.01
TARGET_BYTES = 500e9  # the extrapolation: a 500 GB served view


@dataclass(frozen=True)
class Setup:
    elements: int
    replicas: tuple[int, ...]
    bandwidths: tuple[str, ...]
    timeout_s: float = 300.0


QUICK = Setup(4 << 20, (1, 4), ("100mbit", "1gbit", "10gbit"))
FULL = Setup(32 << 20, (1, 4, 16), ("100mbit", "1gbit", "10gbit"))


@dataclass
class DictStaged:
    writes: list[StagedWrite]
    target_view: str


class DictEngine(Engine):
    """An engine that is only its served view: a dict of tensors kept current by codec stage/commit."""

    name: ClassVar[str] = "dict"

    def __init__(self, view: Mapping[str, torch.Tensor]) -> None:
        self._served = {k: v.clone() for k, v in view.items()}
        self._table = FingerprintTable.of(self._served)
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


def make_views(elements: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A bf16 view of four equal matrices, and the same view with ``CHANGED`` of its values moved one step."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    cols = 1024
    rows = max(1, elements // 4 // cols)
    v0 = {f"model.layers.{i}.mlp.weight": (torch.randn(rows, cols, generator=g) * 0.02).bfloat16() for i in range(4)}
    v1 = {k: t.clone() for k, t in v0.items()}
    for t in v1.values():
        flat = int_view(t).view(-1)
        k = max(1, round(CHANGED * flat.numel()))
        pos = torch.from_numpy(rng.choice(flat.numel(), size=k, replace=False).astype(np.int64))
        step = torch.from_numpy(rng.integers(0, 2, size=k).astype(np.int64) * 2 - 1).to(flat.dtype)
        flat[pos] = flat[pos] + step
    return v0, v1


@dataclass
class Versions:
    v0: dict[str, torch.Tensor]
    v1: dict[str, torch.Tensor]
    fp0: str
    fp1: str
    patch: bytes
    changed: int

    @property
    def view_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.v0.values())


def prepare(elements: int) -> Versions:
    v0, v1 = make_views(elements)
    t0 = FingerprintTable.of(v0)
    patch, t1 = diff_views(v0, v1, old_table=t0, base_version=0, target_version=1, served_format=FMT)
    changed = sum(int((int_view(v0[k]) != int_view(v1[k])).sum()) for k in v0)
    return Versions(v0, v1, t0.view_fp(), t1.view_fp(), patch.to_bytes(), changed)


def same_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(int_view(a[k]), int_view(b[k])) for k in a)


def _follow_to(replica: Replica, version: int, deadline: float, done: list[float], i: int) -> None:
    while time.monotonic() < deadline:
        replica.sync_once()
        if replica.version == version:
            done[i] = time.perf_counter()
            return
        time.sleep(0.002)


def _board(root: str, vs: Versions) -> Publisher:
    pub = Publisher(open_store(root), RUN, publisher_id="bench-trainer")
    pub.publish_snapshot(vs.v0, version=0, view_fp=vs.fp0, served_format=FMT)
    return pub


def _publish_v1(pub: Publisher, vs: Versions) -> None:
    pub.publish_patch(
        [vs.patch], base_version=0, target_version=1, base_view_fp=vs.fp0, target_view_fp=vs.fp1, served_format=FMT
    )


@dataclass
class Outcome:
    seconds: float
    bitwise: bool
    wan_bytes: int


def _race(pub: Publisher, vs: Versions, replicas: list[Replica], timeout_s: float) -> tuple[float, bool]:
    done = [0.0] * len(replicas)
    deadline = time.monotonic() + timeout_s
    t0 = time.perf_counter()
    _publish_v1(pub, vs)
    threads = [
        threading.Thread(target=_follow_to, args=(r, 1, deadline, done, i), daemon=True) for i, r in enumerate(replicas)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 1)
    if not all(done):
        raise TimeoutError(f"not every replica reached v1 within {timeout_s:g} s")
    ok = all(isinstance(r.engine, DictEngine) and same_bits(r.engine.tensors, vs.v1) for r in replicas)
    return max(done) - t0, ok


def _boot(store: Any, engine: DictEngine, timeout_s: float) -> Replica:
    replica = Replica(BoardReader(store, RUN), engine, config=ReplicaConfig(poll_interval_s=0.01, jitter=0.0))
    deadline = time.monotonic() + timeout_s
    while replica.version != 0:
        if time.monotonic() > deadline:
            raise TimeoutError("a replica did not boot at v0")
        replica.sync_once()
    return replica


def run_patch(vs: Versions, n: int, rate: float, timeout_s: float) -> Outcome:
    """Every replica reads the board through its own link of ``rate`` bytes/s."""
    with tempfile.TemporaryDirectory(prefix="flipsync-xr-") as root:
        pub = _board(root, vs)
        stores = [ThrottledStore(open_store(root), UNLIMITED) for _ in range(n)]
        blank = {k: torch.zeros_like(t) for k, t in vs.v0.items()}
        replicas = [_boot(s, DictEngine(blank), timeout_s) for s in stores]
        for s in stores:
            s.bucket, s.bytes_read = TokenBucket(rate), 0
        seconds, ok = _race(pub, vs, replicas, timeout_s)
        return Outcome(seconds, ok, sum(s.bytes_read for s in stores))


def run_relay(vs: Versions, n: int, rate: float, timeout_s: float) -> Outcome:
    """One relay for the island; only its upstream link is limited. WAN bytes = the relay's upstream bytes."""
    with tempfile.TemporaryDirectory(prefix="flipsync-xr-") as root:
        pub = _board(root, vs)
        upstream = ThrottledStore(open_store(root), UNLIMITED)
        cache = RelayCache(upstream)
        server = ServerThread(create_relay_app(cache)).start()
        stores: list[HttpStore] = []
        try:
            url = f"http://127.0.0.1:{server.port}"
            stores = [HttpStore(url, timeout_s=timeout_s) for _ in range(n)]
            blank = {k: torch.zeros_like(t) for k, t in vs.v0.items()}
            replicas = [_boot(s, DictEngine(blank), timeout_s) for s in stores]
            upstream.bucket, upstream.bytes_read = TokenBucket(rate), 0
            seconds, ok = _race(pub, vs, replicas, timeout_s)
            return Outcome(seconds, ok, upstream.bytes_read)
        finally:
            for s in stores:
                s.close()
            server.stop()
            cache.close()


def run_full(vs: Versions, n: int, rate: float, timeout_s: float) -> Outcome:
    """Every replica downloads the v1 keyframe through its own link and loads it."""
    with tempfile.TemporaryDirectory(prefix="flipsync-xr-") as root:
        pub = _board(root, vs)
        stores = [ThrottledStore(open_store(root), rate) for _ in range(n)]
        engines = [DictEngine(vs.v0) for _ in range(n)]
        done = [0.0] * n
        errors: list[BaseException] = []

        def fetch(i: int) -> None:
            try:
                engines[i].load_view(BoardReader(stores[i], RUN).load_keyframe(1))
                if engines[i].table.view_fp() == vs.fp1:
                    done[i] = time.perf_counter()
            except Exception as e:  # reported below
                errors.append(e)

        t0 = time.perf_counter()
        _publish_v1(pub, vs)
        pub.publish_keyframe(vs.v1, version=1, view_fp=vs.fp1, served_format=FMT)
        threads = [threading.Thread(target=fetch, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        if errors or not all(done):
            raise TimeoutError(f"full download did not finish: {errors[:1]}")
        ok = all(same_bits(e.tensors, vs.v1) for e in engines)
        return Outcome(max(done) - t0, ok, sum(s.bytes_read for s in stores))


def apply_seconds(vs: Versions) -> float:
    """Stage + commit of the patch on one unthrottled engine (the CPU cost of an update, per replica);
    best of three, after a warm-up that compiles the kernels."""
    best = float("inf")
    for i in range(4):
        engine = DictEngine(vs.v0)
        t0 = time.perf_counter()
        engine.commit(engine.stage(Patch.from_bytes(vs.patch)))
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 10 else f"{s:.1f} s"


def run(console: Console, quick: bool = False) -> dict[str, Any]:
    setup = QUICK if quick else FULL
    vs = prepare(setup.elements)
    patch_bytes = len(vs.patch)
    b_per_chg = patch_bytes / vs.changed
    apply_s = apply_seconds(vs)
    console.print(
        f"served view {vs.view_bytes / 1e6:.1f} MB bf16, {vs.changed:,} values changed "
        f"({100 * vs.changed / (vs.view_bytes // 2):.2f}%), patch {patch_bytes / 1e3:.1f} kB "
        f"({b_per_chg:.3f} B/changed), apply {apply_s * 1e3:.1f} ms"
    )
    rows: list[dict[str, Any]] = []
    for bw in setup.bandwidths:
        rate = parse_bandwidth(bw)
        table = Table(title=f"link {bw} per replica (relay: per island)")
        for col in ("N", "patch", "patch+relay", "full", "full / patch", "WAN bytes relay / N x patch", "bitwise"):
            table.add_column(col, justify="right")
        for n in setup.replicas:
            p = run_patch(vs, n, rate, setup.timeout_s)
            r = run_relay(vs, n, rate, setup.timeout_s)
            f = run_full(vs, n, rate, setup.timeout_s)
            ok = p.bitwise and r.bitwise and f.bitwise
            row = {
                "bandwidth": bw,
                "bytes_per_s": rate,
                "replicas": n,
                "patch_s": p.seconds,
                "relay_s": r.seconds,
                "full_s": f.seconds,
                "full_over_patch": f.seconds / p.seconds,
                "patch_wan_bytes": p.wan_bytes,
                "relay_wan_bytes": r.wan_bytes,
                "full_wan_bytes": f.wan_bytes,
                "bitwise": ok,
            }
            rows.append(row)
            table.add_row(
                str(n),
                _fmt_s(p.seconds),
                _fmt_s(r.seconds),
                _fmt_s(f.seconds),
                f"{f.seconds / p.seconds:.1f}x",
                f"{r.wan_bytes / (n * patch_bytes):.2f}",
                "yes" if ok else "NO",
            )
        console.print(table)
    extra = extrapolate(rows, b_per_chg, apply_s / vs.changed, vs.view_bytes)
    t = Table(
        title="extrapolation to a 500 GB bf16 served view, 1% changed, one replica: bytes x measured s/byte of "
        "the N=1 full download on that link (+ measured apply per changed value for the patch)"
    )
    for col in ("link", "patch GB", "patch (est.)", "full (est.)", "full / patch"):
        t.add_column(col, justify="right")
    for e in extra:
        t.add_row(
            e["bandwidth"],
            f"{e['patch_bytes'] / 1e9:.2f}",
            _fmt_s(e["patch_s"]),
            _fmt_s(e["full_s"]),
            f"{e['full_s'] / e['patch_s']:.0f}x",
        )
    console.print(t)
    return {
        "elements": setup.elements,
        "view_bytes": vs.view_bytes,
        "changed": vs.changed,
        "patch_bytes": patch_bytes,
        "bytes_per_changed": b_per_chg,
        "apply_s": apply_s,
        "rows": rows,
        "extrapolation": extra,
    }


def extrapolate(
    rows: list[dict[str, Any]], b_per_chg: float, apply_s_per_chg: float, view_bytes: int
) -> list[dict[str, Any]]:
    """Per link: the full download's measured seconds per byte (N=1) scaled to 500 GB; the patch as
    (bytes per changed value x 1% of 250G values) at the same per-byte cost plus the measured apply per value."""
    out = []
    for r in rows:
        if r["replicas"] != 1:
            continue
        s_per_byte = r["full_s"] / view_bytes
        changed = CHANGED * TARGET_BYTES / 2
        patch_bytes = b_per_chg * changed
        out.append(
            {
                "bandwidth": r["bandwidth"],
                "patch_bytes": patch_bytes,
                "patch_s": patch_bytes * s_per_byte + changed * apply_s_per_chg,
                "full_s": TARGET_BYTES * s_per_byte,
            }
        )
    return out


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Served view {result['view_bytes'] / 1e6:.1f} MB bf16, {result['changed']:,} values changed, patch "
        f"{result['patch_bytes'] / 1e3:.1f} kB ({result['bytes_per_changed']:.3f} B/changed), "
        f"apply {result['apply_s'] * 1e3:.1f} ms.",
        "",
        "| link | N | patch | patch+relay | full | full / patch | relay WAN bytes / (N x patch) | bitwise |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['bandwidth']} | {r['replicas']} | {_fmt_s(r['patch_s'])} | {_fmt_s(r['relay_s'])} | "
            f"{_fmt_s(r['full_s'])} | {r['full_over_patch']:.1f}x | "
            f"{r['relay_wan_bytes'] / (r['replicas'] * result['patch_bytes']):.2f} | "
            f"{'yes' if r['bitwise'] else 'NO'} |"
        )
    lines += [
        "",
        "| link | 500 GB view: patch GB | patch (est.) | full (est.) | full / patch |",
        "|---|---|---|---|---|",
    ]
    for e in result["extrapolation"]:
        lines.append(
            f"| {e['bandwidth']} | {e['patch_bytes'] / 1e9:.2f} | {_fmt_s(e['patch_s'])} | {_fmt_s(e['full_s'])} | "
            f"{e['full_s'] / e['patch_s']:.0f}x |"
        )
    return "\n".join(lines)
