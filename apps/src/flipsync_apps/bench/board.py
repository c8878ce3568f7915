"""``flipsync bench board``: publish and catch-up throughput, and what a lagging replica downloads.

1. Throughput: publish N patches (random bytes, two parts each) and catch a new replica up over them,
   against the local filesystem and a real S3 API server on 127.0.0.1 (moto's ThreadedMotoServer).
2. Catch-up bytes: a run shaped like an RL fine-tune (a bf16 view of P parameters, a fraction f of them
   changing per step) with patches, power-of-two squashed spans and keyframes on the adaptive cadence.
   For a replica k versions behind: the bytes and downloads of the patch chain alone, of the best plan with
   spans, of the newest keyframe plus the patches after it, and of the planner's choice (the minimum).

Patch sizes follow the codec's measured rates: about 1.45 bytes per changed element for one step (positions
plus base-relative values), 1.6 bytes for a squashed span (mixed values). Changes concentrate on a "hot"
share h of the elements (small-magnitude weights flip their bf16 bits far more often than large ones), so a
span over n steps changes h * (1 - (1 - f/h)^n) of the view. This is a model: the numbers show how the
planner trades chain, spans and keyframes, not a measurement of a particular training run.
"""

from __future__ import annotations

import os
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table

from flipsync.board.cadence import KeyframePolicy, SpanPolicy
from flipsync.board.catalog import content_hash
from flipsync.board.follow import Follower
from flipsync.board.reader import BoardReader, Step
from flipsync.board.writer import BoardWriter
from flipsync.domain.catchup import plan_catchup
from flipsync.domain.manifest import Kind, Manifest
from flipsync.stores import ObstoreStore, StoreOptions, open_store
from flipsync_apps.bench.report import md_table

MiB = 1 << 20
PATCH_BYTES_PER_CHANGE = 1.45
SPAN_BYTES_PER_CHANGE = 1.6


@dataclass(frozen=True)
class Setup:
    patch_mib: float  # throughput: size of one published patch
    patches: int
    params: int  # catch-up model: elements of the served view (bf16)
    change: float  # fraction of elements changed per step
    hot: float  # share of the elements those changes fall on
    versions: int
    behind: tuple[int, ...]


QUICK = Setup(patch_mib=4, patches=4, params=2_000_000, change=0.02, hot=0.25, versions=64, behind=(1, 4, 16, 63))
FULL = Setup(
    patch_mib=32, patches=8, params=16_000_000, change=0.02, hot=0.25, versions=256, behind=(1, 4, 16, 64, 255)
)


def _fp(v: int) -> str:
    return content_hash(f"bench-view-{v}".encode())[:32]


@contextmanager
def local_s3() -> Iterator[Callable[[], ObstoreStore] | None]:
    """A moto S3 server on 127.0.0.1 (None when moto is not installed)."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        yield None
        return
    import logging
    import socket

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"

    def make() -> ObstoreStore:
        bucket = f"bench-{uuid.uuid4().hex[:10]}"
        with urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=10):
            pass
        cfg = {"endpoint": endpoint, "access_key_id": "bench", "secret_access_key": "bench", "region": "us-east-1"}
        return open_store(f"s3://{bucket}/board", StoreOptions(config=cfg, allow_metadata_credentials=False))

    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield make
    finally:
        server.stop()


def _throughput(store: ObstoreStore, setup: Setup) -> dict[str, float]:
    """Publish ``setup.patches`` patches of random bytes, then catch a replica up over all of them."""
    import torch

    size = int(setup.patch_mib * MiB)
    pub = BoardWriter(store, "bench", publisher_id="bench")
    pub.publish_snapshot({"w": torch.zeros(16)}, version=0, view_fp=_fp(0), served_format="bf16")
    payloads = [[os.urandom(size // 2), os.urandom(size - size // 2)] for _ in range(setup.patches)]
    t0 = time.perf_counter()
    for v, parts in enumerate(payloads, start=1):
        pub.publish_patch(
            parts,
            base_version=v - 1,
            target_version=v,
            base_view_fp=_fp(v - 1),
            target_view_fp=_fp(v),
            served_format="bf16",
        )
    publish_s = time.perf_counter() - t0
    total = size * setup.patches
    got: list[Step] = []
    t0 = time.perf_counter()
    f = Follower(BoardReader(store, "bench"), version=0, view_fp=_fp(0))
    f.sync(got.append)
    catchup_s = time.perf_counter() - t0
    assert f.version == setup.patches and f.bytes_downloaded == total
    return {
        "bytes": total,
        "publish_s": publish_s,
        "publish_mb_s": total / publish_s / 1e6,
        "catchup_s": catchup_s,
        "catchup_mb_s": total / catchup_s / 1e6,
    }


def _catchup_model(setup: Setup) -> dict[str, Any]:
    """Publish a modelled run to a local board; measure what a replica k behind downloads per strategy."""
    import torch

    kf_bytes = 2 * setup.params
    patch_size = int(setup.params * setup.change * PATCH_BYTES_PER_CHANGE)

    def span_size(n: int) -> int:
        changed = setup.hot * (1 - (1 - setup.change / setup.hot) ** n)
        return int(setup.params * changed * SPAN_BYTES_PER_CHANGE)

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="flipsync-bench-") as tmp:
        store = open_store(tmp)
        pub = BoardWriter(
            store,
            "model",
            publisher_id="bench",
            keyframe_policy=KeyframePolicy(chain_fraction=0.5, max_interval=10_000),
            span_policy=SpanPolicy(min_level=1, max_level=10),
            max_shard_bytes=kf_bytes,
        )
        # A keyframe holds a bf16 view; its size, not its values, matters here.
        view = {"w": torch.zeros(setup.params, dtype=torch.bfloat16)}
        pub.publish_snapshot(view, version=0, view_fp=_fp(0), served_format="bf16")
        keyframes = 0
        for v in range(1, setup.versions + 1):
            pub.publish_patch(
                [os.urandom(patch_size)],
                base_version=v - 1,
                target_version=v,
                base_view_fp=_fp(v - 1),
                target_view_fp=_fp(v),
                served_format="bf16",
            )
            for a, b in pub.spans_due(v):
                pub.publish_span(
                    [os.urandom(span_size(b - a))],
                    base_version=a,
                    target_version=b,
                    base_view_fp=_fp(a),
                    target_view_fp=_fp(b),
                    served_format="bf16",
                )
            if pub.keyframe_due():
                pub.publish_keyframe(view, version=v, view_fp=_fp(v), served_format="bf16")
                keyframes += 1
        head = setup.versions
        reader = BoardReader(store, "model")
        for k in setup.behind:
            start = head - k
            arts = reader.artifacts(start, head)
            chain = [m for m in arts if m.kind is Kind.PATCH]
            no_kf = [m for m in arts if m.kind is not Kind.KEYFRAME]
            kf_route = [m for m in reader.artifacts(None, head) if m.kind is not Kind.SPAN]
            best_kf = _plan_bytes(None, head, kf_route)
            f = Follower(reader, version=start, view_fp=_fp(start))
            t0 = time.perf_counter()
            f.sync(lambda _s: None)
            took = time.perf_counter() - t0
            rows.append(
                {
                    "behind": k,
                    "chain_bytes": _plan_bytes(start, head, chain)[0],
                    "chain_downloads": _plan_bytes(start, head, chain)[1],
                    "spans_bytes": _plan_bytes(start, head, no_kf)[0],
                    "spans_downloads": _plan_bytes(start, head, no_kf)[1],
                    "keyframe_bytes": best_kf[0],
                    "keyframe_downloads": best_kf[1],
                    "planned_bytes": f.bytes_downloaded,
                    "planned_s": took,
                }
            )
        new_replica = Follower(reader)
        new_replica.sync(lambda _s: None)
        store.close()
    return {
        "params": setup.params,
        "change": setup.change,
        "hot": setup.hot,
        "keyframe_bytes": kf_bytes,
        "patch_bytes": patch_size,
        "versions": setup.versions,
        "keyframes_written": keyframes,
        "new_replica_bytes": new_replica.bytes_downloaded,
        "rows": rows,
    }


def _plan_bytes(start: int | None, goal: int, arts: list[Manifest]) -> tuple[int, int]:
    plan = plan_catchup(start, goal, arts)
    return plan.total_bytes, plan.downloads


def run(console: Console, quick: bool = False) -> dict[str, Any]:
    """Run the board benchmark; print tables and return the numbers."""
    setup = QUICK if quick else FULL
    results: dict[str, Any] = {"quick": quick, "throughput": {}}
    with console.status("benchmarking the board") as status:
        with tempfile.TemporaryDirectory(prefix="flipsync-bench-") as tmp:
            status.update("board bench: local filesystem")
            store = open_store(tmp)
            results["throughput"]["file"] = _throughput(store, setup)
            store.close()
        with local_s3() as make_s3:
            if make_s3 is not None:
                status.update("board bench: S3 (moto on 127.0.0.1)")
                store = make_s3()
                results["throughput"]["s3-moto"] = _throughput(store, setup)
                store.close()
        status.update("board bench: catch-up bytes")
        results["catchup"] = _catchup_model(setup)

    t = Table(title=f"Board throughput ({setup.patches} patches of {setup.patch_mib:g} MiB, 2 parts each)")
    for col in ("store", "publish MB/s", "catch-up MB/s"):
        t.add_column(col, justify="right" if col != "store" else "left")
    for name, r in results["throughput"].items():
        t.add_row(name, f"{r['publish_mb_s']:.0f}", f"{r['catchup_mb_s']:.0f}")
    console.print(t)
    c = results["catchup"]
    t = Table(
        title=(
            f"Catch-up download from k versions behind ({c['params'] / 1e6:.0f}M bf16 params, "
            f"{100 * c['change']:.0f}% changed/step within a hot {100 * c['hot']:.0f}%: "
            f"patch {c['patch_bytes'] / MiB:.2f} MiB, "
            f"keyframe {c['keyframe_bytes'] / MiB:.0f} MiB, {c['keyframes_written']} keyframes in "
            f"{c['versions']} versions)"
        )
    )
    for col in ("k", "chain MiB (n)", "with spans MiB (n)", "newest keyframe + after MiB (n)", "planned MiB"):
        t.add_column(col, justify="right")
    for r in c["rows"]:
        t.add_row(
            str(r["behind"]),
            f"{r['chain_bytes'] / MiB:.2f} ({r['chain_downloads']})",
            f"{r['spans_bytes'] / MiB:.2f} ({r['spans_downloads']})",
            f"{r['keyframe_bytes'] / MiB:.2f} ({r['keyframe_downloads']})",
            f"{r['planned_bytes'] / MiB:.2f}",
        )
    console.print(t)
    console.print(f"new replica: {c['new_replica_bytes'] / MiB:.2f} MiB")
    return results


def markdown(result: dict[str, Any]) -> str:
    """The board section: throughput per store, then catch-up bytes against versions behind."""
    setup = QUICK if result.get("quick") else FULL
    tp = md_table(
        ("store", "publish MB/s", "catch-up MB/s"),
        (
            (
                {"file": "local directory", "s3-moto": "S3 API (moto on 127.0.0.1)"}.get(name, name),
                f"{r['publish_mb_s']:.0f}",
                f"{r['catchup_mb_s']:.0f}",
            )
            for name, r in result["throughput"].items()
        ),
    )
    c = result["catchup"]
    cu = md_table(
        (
            "k behind",
            "patch chain MiB (downloads)",
            "with spans MiB (downloads)",
            "keyframe + after MiB (downloads)",
            "planner's choice MiB",
        ),
        (
            (
                str(r["behind"]),
                f"{r['chain_bytes'] / MiB:.2f} ({r['chain_downloads']})",
                f"{r['spans_bytes'] / MiB:.2f} ({r['spans_downloads']})",
                f"{r['keyframe_bytes'] / MiB:.2f} ({r['keyframe_downloads']})",
                f"**{r['planned_bytes'] / MiB:.2f}**",
            )
            for r in c["rows"]
        ),
        left=0,
    )
    return "\n\n".join(
        [
            f"Throughput: {setup.patches} patches of {setup.patch_mib:g} MiB (random bytes, two parts each) "
            "published, then read back by a new replica catching up, against a local directory and a real S3 API "
            "server on loopback (moto's `ThreadedMotoServer`; skipped when moto is not installed).",
            tp,
            f"Catch-up from k versions behind, on a modelled run: {c['params'] / 1e6:.0f}M BF16 parameters, "
            f"{100 * c['change']:.0f}% of a hot {100 * c['hot']:.0f}% changing per step, patch "
            f"{c['patch_bytes'] / MiB:.2f} MiB, keyframe {c['keyframe_bytes'] / MiB:.0f} MiB, adaptive keyframes "
            f"({c['keyframes_written']} in {c['versions']} versions) and power-of-two squashed spans. The board is "
            "real (manifests, catalog, planner); the patch sizes follow the codec's rates. Columns: the bytes "
            "(and downloads) of the patch chain alone, of the best plan with spans, of the newest keyframe plus "
            f"what follows, and what the planner picks. A new replica downloads {c['new_replica_bytes'] / MiB:.2f} "
            "MiB.",
            cu,
        ]
    )
