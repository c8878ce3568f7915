"""``flipsync bench gateway``: what the fleet's front door costs, and what heartbeats cost at fleet size.

1. Added latency: one sidecar (the torch engine, ``tiny`` preset, one token per request) and one gateway,
   each a ``flipsync`` process on loopback as deployed; this process sends the same request straight to the
   sidecar and through the gateway, alternating (ABBA order), sequentially on kept-alive connections.
   The gateway's cost is the difference of the two latency distributions (p50, p99), measured side by side.
2. Membership at fleet size: N member records on a real S3 API (moto on 127.0.0.1), read by the gateway's
   `MemberReader`: a cold scan (every record downloaded), a scan where nothing changed (one LIST), and a
   scan after a fifth of the records were rewritten (what one second brings at the default heartbeat), with
   the store requests each one made. Then the arithmetic for S3 at the default heartbeat and TTL.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from flipsync.board.membership import MemberReader, MemberWriter
from flipsync.board.writer import BoardWriter
from flipsync.domain.fleet import MemberRecord
from flipsync.domain.manifest import utc_now_iso
from flipsync.sidecar.heartbeat import DEFAULT_INTERVAL_S, DEFAULT_TTL_S
from flipsync.stores import ObjectInfo, Store, StoreWrapper, open_store
from flipsync_apps.bench import gateway_load
from flipsync_apps.bench.board import local_s3
from flipsync_apps.bench.report import md_table

# S3 Standard request prices (us-east-1, per 1,000 requests) used for the cost lines; PUT and LIST are one
# class, GET another.
S3_PUT_PER_1000 = 0.005
S3_GET_PER_1000 = 0.0004
S3_PUT_PER_PREFIX_S = 3500  # S3's documented request rates per partitioned prefix
S3_GET_PER_PREFIX_S = 5500
GATEWAY_REFRESH_S = 1.0  # flipsync gateway --refresh default


@dataclass(frozen=True)
class Setup:
    pairs: int
    warmup: int
    replicas: int
    rate_seconds: float = 5.0  # per phase of the 1,000 requests/s run (gateway_load.added_latency)
    streams: int = 5000  # concurrent streams through one gateway (gateway_load.streams)


QUICK = Setup(pairs=150, warmup=20, replicas=200, rate_seconds=1.0, streams=1000)
FULL = Setup(pairs=1500, warmup=100, replicas=1000)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def publish_tiny(board: str) -> None:
    """v0 of the ``tiny`` preset in bf16: what a ``--model tiny`` sidecar serves."""
    import torch

    from flipsync.codec.fingerprint import FingerprintTable
    from flipsync.engines.torch.models import build_model, preset_config
    from flipsync.formats import served_view

    model = build_model(preset_config("tiny"), seed=0, dtype=torch.float32)
    view = served_view({k: v.detach() for k, v in model.state_dict().items()}, "bf16")
    store = open_store(board)
    BoardWriter(store, "bench", publisher_id="bench").publish_snapshot(
        view, version=0, view_fp=FingerprintTable.of(view).view_fp(), served_format="bf16"
    )
    store.close()


@contextmanager
def _processes(board: str, log_dir: Path) -> Iterator[tuple[str, str, list[int]]]:
    """A sidecar and a gateway as ``flipsync`` processes; yields their URLs (and process ids) once the gateway
    routes."""
    sidecar_port, gateway_port = _free_port(), _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    sidecar_url = f"http://127.0.0.1:{sidecar_port}"
    gateway_url = f"http://127.0.0.1:{gateway_port}"
    commands = [
        [
            *(sys.executable, "-m", "flipsync.cli.sidecar", "sidecar", "--board", board, "--run", "bench"),
            *("--listen", f"127.0.0.1:{sidecar_port}", "--public-url", sidecar_url, "--threads", "1"),
            *("--poll", "0.5", "--heartbeat", "1", "--member-ttl", "5"),
        ],
        [
            *(sys.executable, "-m", "flipsync.cli.gateway", "gateway", "--board", board),
            *("--listen", f"127.0.0.1:{gateway_port}", "--refresh", "0.5"),
        ],
    ]
    procs = []
    try:
        for i, cmd in enumerate(commands):
            with (log_dir / f"proc-{i}.log").open("wb") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + 180
        while True:
            for p in procs:
                if p.poll() is not None:
                    logs = "".join((log_dir / f"proc-{i}.log").read_text() for i in range(len(procs)))
                    raise RuntimeError(f"a bench process exited early: {logs[-2000:]}")
            try:
                if httpx.get(f"{gateway_url}/flipsync/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the bench's sidecar and gateway did not come up within 180 s")
            time.sleep(0.2)
        yield sidecar_url, gateway_url, [p.pid for p in procs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _time_one(client: httpx.Client, url: str, body: dict[str, Any], stream: bool) -> tuple[float, float]:
    """(seconds to the first byte of the body, seconds to its end) of one request."""
    t = time.perf_counter()
    first = None
    with client.stream("POST", url, json=body) as r:
        for _ in r.iter_bytes():
            first = first if first is not None else time.perf_counter() - t
        ok = r.status_code == 200
    total = time.perf_counter() - t
    if not ok:
        raise RuntimeError(f"{url} answered {r.status_code}")
    return (first if first is not None else total), total


CASES = (
    ("completion, 1 token", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "temperature": 0}, False),
    (
        "chat, streamed, 4 tokens",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
        True,
    ),
)


def _stats(name: str, what: str, direct: list[float], via: list[float]) -> dict[str, Any]:
    diffs = [b - a for a, b in zip(direct, via, strict=True)]
    return {
        "case": name,
        "measure": what,
        "pairs": len(direct),
        "direct_p50_ms": 1e3 * _quantile(direct, 0.5),
        "direct_p99_ms": 1e3 * _quantile(direct, 0.99),
        "gateway_p50_ms": 1e3 * _quantile(via, 0.5),
        "gateway_p99_ms": 1e3 * _quantile(via, 0.99),
        "added_p50_ms": 1e3 * (_quantile(via, 0.5) - _quantile(direct, 0.5)),
        "added_p99_ms": 1e3 * (_quantile(via, 0.99) - _quantile(direct, 0.99)),
        "paired_median_ms": 1e3 * statistics.median(diffs),
    }


def _cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used so far; None where /proc cannot say."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _latency(sidecar: str, gateway: str, setup: Setup, pids: list[int]) -> list[dict[str, Any]]:
    rows = []
    with httpx.Client(timeout=30) as client:
        for name, path, body, stream in CASES:
            direct: list[tuple[float, float]] = []
            via: list[tuple[float, float]] = []
            cpu0 = [_cpu_s(p) for p in pids]
            for i in range(setup.warmup + setup.pairs):
                order = [(sidecar, direct), (gateway, via)]
                if i % 2:
                    order.reverse()  # ABBA: drift and warm caches hit both alike
                for base, out in order:
                    dt = _time_one(client, base + path, body, stream)
                    if i >= setup.warmup:
                        out.append(dt)
            cpu1 = [_cpu_s(p) for p in pids]
            n = setup.warmup + setup.pairs
            # CPU per request of each process: the sidecar served 2n requests, the gateway n.
            cpu = [None if a is None or b is None else (b - a) for a, b in zip(cpu0, cpu1, strict=True)]
            sidecar_ms = None if cpu[0] is None else 1e3 * cpu[0] / (2 * n)
            gateway_ms = None if cpu[1] is None else 1e3 * cpu[1] / n
            if stream:
                rows.append(_stats(name, "first byte", [d[0] for d in direct], [v[0] for v in via]))
            rows.append(
                {
                    **_stats(name, "whole response", [d[1] for d in direct], [v[1] for v in via]),
                    "sidecar_cpu_ms": sidecar_ms,
                    "gateway_cpu_ms": gateway_ms,
                }
            )
    return rows


class _CountingStore(StoreWrapper):
    """Counts the store requests made through it, by kind."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.url = inner.url
        self.calls: Counter[str] = Counter()

    def get(self, path: str, *, size: int | None = None) -> bytes:
        self.calls["GET"] += 1
        return super().get(path, size=size)

    def list(self, prefix: str) -> list[ObjectInfo]:
        self.calls["LIST"] += math.ceil(max(1, len(result := super().list(prefix))) / 1000)  # pages of 1,000
        return result

    def list_dirs(self, prefix: str) -> list[str]:
        self.calls["LIST"] += 1
        return super().list_dirs(prefix)

    def put(self, path: str, data: bytes | bytearray | memoryview, *, create_only: bool = False) -> None:
        self.calls["PUT"] += 1
        super().put(path, data, create_only=create_only)


def _record(i: int, version: int) -> MemberRecord:
    now = utc_now_iso()
    return MemberRecord(
        replica=f"replica-{i:05d}",
        run="bench",
        island=f"island-{i % 8}",
        url=f"http://10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:8100",
        engine="vllm",
        served_format="bf16",
        model="Qwen/Qwen3-8B",
        version=version,
        view_fp=f"{version:032x}",
        head=version,
        state="idle",
        serving=True,
        in_flight=i % 5,
        heartbeat=now,
        ttl_s=DEFAULT_TTL_S,
        started=now,
        seq=version,
    )


def membership_scans(store: Store, replicas: int) -> dict[str, Any]:
    writer = MemberWriter(store, "bench")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: writer.put(_record(i, 1)), range(replicas)))
    record_bytes = len(_record(0, 1).to_json())
    counting = _CountingStore(store)
    reader = MemberReader(counting, runs=("bench",))
    scans = []
    changed = max(1, round(replicas * GATEWAY_REFRESH_S / DEFAULT_INTERVAL_S))
    for name, rewrite in (("cold (every record read)", 0), ("nothing changed", 0), (f"{changed} rewritten", changed)):
        if rewrite:
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(lambda i: writer.put(_record(i, 2)), range(rewrite)))
        counting.calls.clear()
        t = time.perf_counter()
        scan = reader.scan(datetime.now(UTC))
        scans.append(
            {
                "scan": name,
                "seconds": time.perf_counter() - t,
                "live": len(scan.live),
                "gets": counting.calls["GET"],
                "lists": counting.calls["LIST"],
            }
        )
    reader.close()
    return {"replicas": replicas, "record_bytes": record_bytes, "scans": scans, **s3_costs(1000)}


def s3_costs(
    replicas: int, interval_s: float = DEFAULT_INTERVAL_S, refresh_s: float = GATEWAY_REFRESH_S
) -> dict[str, Any]:
    """Store requests and their S3 price for ``replicas`` sidecars at the default heartbeat, per gateway."""
    puts_s = replicas / interval_s
    gets_s = replicas / interval_s  # a gateway downloads each record once per rewrite
    lists_s = math.ceil(replicas / 1000) / refresh_s
    return {
        "cost_replicas": replicas,
        "interval_s": interval_s,
        "ttl_s": DEFAULT_TTL_S,
        "refresh_s": refresh_s,
        "puts_per_s": puts_s,
        "puts_per_h": puts_s * 3600,
        "put_usd_per_h": puts_s * 3600 / 1000 * S3_PUT_PER_1000,
        "gateway_gets_per_s": gets_s,
        "gateway_lists_per_s": lists_s,
        "gateway_usd_per_h": (gets_s * S3_GET_PER_1000 + lists_s * S3_PUT_PER_1000) * 3600 / 1000,
        "put_share_of_prefix_limit": puts_s / S3_PUT_PER_PREFIX_S,
    }


def run(console: Console, quick: bool = False) -> dict[str, Any]:
    """Run the gateway benchmark; print tables and return the numbers."""
    setup = QUICK if quick else FULL
    results: dict[str, Any] = {"quick": quick}
    with (
        console.status("benchmarking the gateway") as status,
        tempfile.TemporaryDirectory(prefix="flipsync-gw-") as tmp,
    ):
        board = str(Path(tmp) / "board")
        publish_tiny(board)
        status.update("gateway bench: starting a sidecar and a gateway")
        with _processes(board, Path(tmp)) as (sidecar, gateway, pids):
            status.update("gateway bench: direct and through the gateway, alternating")
            results["latency"] = _latency(sidecar, gateway, setup, pids)
        status.update("gateway bench: affinity, 1,000 requests/s and concurrent streams against stub replicas")
        results["load"] = {
            "affinity": gateway_load.affinity(),
            "rate": gateway_load.added_latency(1000.0, setup.rate_seconds),
            "streams": gateway_load.streams(setup.streams),
        }
        status.update(f"gateway bench: {setup.replicas} member records on S3 (moto)")
        with local_s3() as make_s3:
            if make_s3 is not None:
                store = make_s3()
                results["membership"] = membership_scans(store, setup.replicas)
                store.close()
            else:
                results["membership"] = {**s3_costs(1000), "scans": [], "replicas": 0}
    t = Table(title="Gateway: added latency on loopback (sidecar + torch engine, tiny model)")
    for col in ("request", "until", "pairs", "direct p50", "direct p99", "gateway p50", "gateway p99", "added p50"):
        t.add_column(col, justify="left" if col in ("request", "until") else "right")
    for r in results["latency"]:
        t.add_row(
            r["case"],
            r["measure"],
            str(r["pairs"]),
            *(f"{r[k]:.2f} ms" for k in ("direct_p50_ms", "direct_p99_ms", "gateway_p50_ms", "gateway_p99_ms")),
            f"{r['added_p50_ms']:+.2f} ms",
        )
    console.print(t)
    load = results["load"]
    a, rt, st = load["affinity"], load["rate"], load["streams"]
    console.print(
        f"affinity: {a['sessions']} {a['turns']}-turn sessions over {a['replicas']} replicas: "
        f"{100 * a['hit_rate']:.1f}% of turns 2-{a['turns']} on turn 1's replica, busiest "
        f"{a['busiest_over_mean']:.2f}x the mean; at {rt['rate']:.0f} requests/s the gateway adds "
        f"{rt['added_p50_ms']:+.2f} ms p50, {rt['added_p99_ms']:+.2f} ms p99 ({rt['errors']} errors); "
        f"{st['completed']}/{st['streams']} concurrent streams completed in {st['seconds']:.1f} s"
    )
    m = results["membership"]
    if m["scans"]:
        t = Table(title=f"Membership scans of {m['replicas']} records on S3 (moto on 127.0.0.1)")
        for col in ("scan", "seconds", "live", "GETs", "LISTs"):
            t.add_column(col, justify="left" if col == "scan" else "right")
        for s in m["scans"]:
            t.add_row(s["scan"], f"{s['seconds']:.2f}", str(s["live"]), str(s["gets"]), str(s["lists"]))
        console.print(t)
    console.print(
        f"{m['cost_replicas']} replicas at a {m['interval_s']:g} s heartbeat: {m['puts_per_s']:.0f} PUT/s, "
        f"{m['puts_per_h']:,.0f} PUT/h (${m['put_usd_per_h']:.2f}/h on S3); each gateway "
        f"{m['gateway_gets_per_s']:.0f} GET/s + {m['gateway_lists_per_s']:.0f} LIST/s (${m['gateway_usd_per_h']:.2f}/h)"
    )
    return results


def markdown(result: dict[str, Any]) -> str:
    """The gateway section: added latency, membership scans at size, and the S3 arithmetic."""
    lat = result["latency"]
    m = result["membership"]
    parts = [
        "The sidecar (the torch engine, `tiny` preset, behind its version-aware proxy) and the gateway run as "
        "`flipsync sidecar` and `flipsync gateway` processes on loopback, as deployed; the benchmark process "
        "sends each request straight to the sidecar and through the gateway, alternating in ABBA order on "
        f"kept-alive connections, {lat[0]['pairs']} pairs per case after a warm-up; a streamed answer is timed to its "
        "first byte and to its end. *Added* is the gateway's percentile minus the direct one; *paired median* the "
        "median of the per-pair differences.",
        "",
        md_table(
            (
                "request",
                "until",
                "direct p50",
                "direct p99",
                "gateway p50",
                "gateway p99",
                "added p50",
                "added p99",
                "paired median",
            ),
            (
                (
                    r["case"],
                    r["measure"],
                    f"{r['direct_p50_ms']:.2f} ms",
                    f"{r['direct_p99_ms']:.2f} ms",
                    f"{r['gateway_p50_ms']:.2f} ms",
                    f"{r['gateway_p99_ms']:.2f} ms",
                    f"{r['added_p50_ms']:+.2f} ms",
                    f"{r['added_p99_ms']:+.2f} ms",
                    f"{r['paired_median_ms']:+.2f} ms",
                )
                for r in lat
            ),
            left=2,
        ),
        "",
    ]
    load = result.get("load")
    if load:
        a, rt, st = load["affinity"], load["rate"], load["streams"]
        parts += [
            "Under load, against stub replicas (`flipsync.fleet.stub_replica`: microseconds a request, so the "
            "gateway is what is measured; `flipsync_apps.bench.gateway_load`):",
            "",
            md_table(
                ("run", "result"),
                [
                    (
                        f"affinity: {a['sessions']} {a['turns']}-turn sessions at once, {a['replicas']} replicas",
                        f"{100 * a['hit_rate']:.1f}% of turns 2-{a['turns']} on turn 1's replica; busiest replica "
                        f"{a['busiest_over_mean']:.2f}x the mean",
                    ),
                    (
                        f"{rt['rate']:.0f} requests/s, open loop ({rt['requests']} through the gateway)",
                        f"direct p50 {rt['direct_p50_ms']:.2f} / p99 {rt['direct_p99_ms']:.2f} ms, through the gateway "
                        f"p50 {rt['gateway_p50_ms']:.2f} / p99 {rt['gateway_p99_ms']:.2f} ms: added "
                        f"{rt['added_p50_ms']:+.2f} ms p50, {rt['added_p99_ms']:+.2f} ms p99 ({rt['errors']} errors)",
                    ),
                    (
                        f"{st['streams']:,} concurrent streams, one gateway, 4 stubs",
                        f"{st['completed']:,} completed in {st['seconds']:.1f} s"
                        + (", all open at once" if st["all_open_at_once"] else ""),
                    ),
                ],
            ),
            "",
        ]
    cpu = next((r for r in lat if r.get("gateway_cpu_ms") is not None), None)
    if cpu is not None:
        parts += [
            f"CPU per request ({cpu['case']}, from /proc, the same runs): the gateway {cpu['gateway_cpu_ms']:.2f} ms, "
            f"the sidecar {cpu['sidecar_cpu_ms']:.2f} ms (its proxy, its engine's HTTP server and one generated "
            f"token): a gateway hop costs {cpu['gateway_cpu_ms'] / cpu['sidecar_cpu_ms']:.2f}x a sidecar's request. "
            "On a loaded machine the added latency grows with the wait for a core, which both hops share.",
            "",
        ]
    if m["scans"]:
        parts += [
            f"A gateway's view of {m['replicas']:,} replicas: their member records ({m['record_bytes']} bytes "
            "each) on an S3 API server on loopback (moto), read by `MemberReader` as the gateway does every "
            "`--refresh`: listing the run's `members/` folder, downloading only the records whose listing "
            f"(size, time, ETag) changed, {32} at a time. Moto answers in well under a millisecond; S3 takes "
            "tens, so the real scan time is about (GETs / 32) x the GET latency.",
            "",
            md_table(
                ("scan", "seconds", "live records", "GETs", "LIST pages"),
                (
                    (s["scan"], f"{s['seconds']:.2f}", str(s["live"]), str(s["gets"]), str(s["lists"]))
                    for s in m["scans"]
                ),
            ),
            "",
        ]
    parts += [
        f"**Heartbeats of {m['cost_replicas']:,} replicas on S3** at the defaults (a record written every "
        f"{m['interval_s']:g} s, TTL {m['ttl_s']:g} s; gateways read every {m['refresh_s']:g} s), priced at S3 "
        f"Standard's ${S3_PUT_PER_1000} per 1,000 PUT/LIST and ${S3_GET_PER_1000} per 1,000 GET:",
        "",
        md_table(
            ("who", "requests/s", "requests/hour", "cost/hour"),
            [
                (
                    "sidecars (PUT)",
                    f"{m['puts_per_s']:.0f}",
                    f"{m['puts_per_h']:,.0f}",
                    f"${m['put_usd_per_h']:.2f}",
                ),
                (
                    "each gateway (GET changed records + LIST)",
                    f"{m['gateway_gets_per_s']:.0f} + {m['gateway_lists_per_s']:.0f}",
                    f"{(m['gateway_gets_per_s'] + m['gateway_lists_per_s']) * 3600:,.0f}",
                    f"${m['gateway_usd_per_h']:.2f}",
                ),
            ],
        ),
        "",
        "How it holds at that size: the writes are "
        f"{100 * m['put_share_of_prefix_limit']:.0f}% of the {S3_PUT_PER_PREFIX_S:,} PUT/s S3 sustains per "
        "prefix (one run's `members/` folder), with no coordination between writers (one key each, no "
        "compare-and-swap); a gateway's reads grow with the rewrites, not with its refresh rate (an unchanged "
        "record is never downloaded again), and its LIST with one page per 1,000 replicas. What does not hold "
        "for free: a killed replica stays in the view for up to the TTL (the gateway fails its requests over "
        "at once and skips it until it writes again), a version change reaches gateways within a heartbeat "
        "gap plus a refresh, and past about ten thousand replicas per run the records would need sharding "
        "across prefixes (one folder per island) to stay under S3's per-prefix rate.",
    ]
    return "\n".join(parts)
