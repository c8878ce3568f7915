"""``flipsync bench gateway``, the fleet's front door under load, against stub replicas
(`flipsync.fleet.stub_replica`, microseconds a request, so the gateway is what is measured):

1. Affinity: 50 five-turn sessions at once over 4 replicas (each answer 50 ms): the share of turns 2-5 that
   reached turn 1's replica, and the busiest replica's requests against the mean.
2. Added latency at a fixed rate (1,000 requests/s, open loop, timed from each request's scheduled start): a stub
   and a ``flipsync gateway`` process; the same schedule straight to the stub and through the gateway, in
   alternating phases; the gateway's cost is the difference of the percentiles.
3. Concurrency: N streams through one gateway process to 4 stubs that hold every stream open until all N are.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from flipsync.fleet.stub_replica import (
    RawClient,
    RawResponse,
    StreamCount,
    StubReplica,
    concurrent_streams,
    gateway_process,
    raise_open_files,
)
from flipsync.serving import free_port


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


@contextmanager
def stub_process() -> Iterator[str]:
    port = free_port("127.0.0.1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flipsync.fleet.stub_replica", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/flipsync/status", timeout=2)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the bench's stub replica did not start within 60 s") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


def affinity(sessions: int = 50, turns: int = 5, replicas: int = 4) -> dict[str, Any]:
    """Sessions through an in-process gateway over stub replicas: affinity hit rate and balance."""
    from flipsync.fleet.gateway import Gateway
    from flipsync.fleet.pool import StaticPool
    from flipsync.fleet.routing import GatewayConfig
    from flipsync.serving import ServerThread

    stubs = [StubReplica(delay_s=0.05).start() for _ in range(replicas)]
    pool = StaticPool([s.url for s in stubs])
    gateway = Gateway(pool, GatewayConfig(refresh_s=0.2))
    server = ServerThread(gateway.app).start()
    try:
        deadline = time.monotonic() + 60
        while gateway.ready_replicas() < replicas and time.monotonic() < deadline:
            time.sleep(0.05)

        async def run() -> dict[str, list[str]]:
            out: dict[str, list[str]] = {}
            limits = httpx.Limits(max_connections=sessions)
            async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:

                async def one(s: str) -> None:
                    for t in range(turns):
                        body = {"prompt": f"turn {t} of {s}", "max_tokens": 4}
                        r = await client.post("/v1/completions", json=body, headers={"X-Flipsync-Session": s})
                        r.raise_for_status()
                        out.setdefault(s, []).append(r.headers["x-flipsync-replica"])

                await asyncio.gather(*(one(f"s{i}") for i in range(sessions)))
            return out

        seen = asyncio.run(run())
    finally:
        server.stop()
        pool.close()
        for s in stubs:
            s.stop()
    later = [(reps[0], rep) for reps in seen.values() for rep in reps[1:]]
    served = Counter(rep for reps in seen.values() for rep in reps)
    mean = sum(served.values()) / replicas
    return {
        "sessions": sessions,
        "turns": turns,
        "replicas": replicas,
        "hit_rate": sum(a == b for a, b in later) / len(later),
        "busiest_over_mean": max(served.values()) / mean,
    }


async def _open_loop(port: int, rate: float, seconds: float, connections: int) -> tuple[list[float], int]:
    """Requests at ``rate`` per second for ``seconds``, each timed from its scheduled start; (latencies, errors)."""
    idle: asyncio.Queue[RawClient] = asyncio.Queue()
    for _ in range(connections):
        idle.put_nowait(await RawClient("127.0.0.1", port).connect())
    latencies: list[float] = []
    errors = 0
    body = {"prompt": "hi", "max_tokens": 1}

    async def one(due: float) -> None:
        nonlocal errors
        client = await idle.get()
        try:
            r: RawResponse = await client.post("/v1/completions", body)
            if r.status != 200:
                errors += 1
            latencies.append(time.perf_counter() - due)
        finally:
            idle.put_nowait(client)

    tasks = []
    start = time.perf_counter()
    n = int(rate * seconds)
    for i in range(n):
        due = start + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(due)))
    await asyncio.gather(*tasks)
    while not idle.empty():
        await idle.get_nowait().close()
    return latencies, errors


def added_latency(rate: float = 1000.0, seconds: float = 2.0, rounds: int = 2) -> dict[str, Any]:
    """The gateway's added latency at ``rate`` requests/s against a stub, direct and through, alternating."""
    direct: list[float] = []
    via: list[float] = []
    errors = 0
    with stub_process() as stub, gateway_process([stub], "--no-affinity") as port:
        stub_port = int(stub.rsplit(":", 1)[1])
        asyncio.run(_open_loop(port, rate, 0.5, 32))  # warm-up: connections, caches
        asyncio.run(_open_loop(stub_port, rate, 0.5, 32))
        for i in range(rounds):
            order = [(stub_port, direct), (port, via)]
            if i % 2:
                order.reverse()
            for target, out in order:
                lat, err = asyncio.run(_open_loop(target, rate, seconds, 32))
                out += lat
                errors += err
    return {
        "rate": rate,
        "requests": len(via),
        "errors": errors,
        "direct_p50_ms": 1e3 * _quantile(direct, 0.5),
        "direct_p99_ms": 1e3 * _quantile(direct, 0.99),
        "gateway_p50_ms": 1e3 * _quantile(via, 0.5),
        "gateway_p99_ms": 1e3 * _quantile(via, 0.99),
        "added_p50_ms": 1e3 * (_quantile(via, 0.5) - _quantile(direct, 0.5)),
        "added_p99_ms": 1e3 * (_quantile(via, 0.99) - _quantile(direct, 0.99)),
    }


def streams(n: int, replicas: int = 4) -> dict[str, Any]:
    """``n`` concurrent streams through one gateway process to stubs that hold them until all are open."""
    raise_open_files(4 * n + 1024)
    shared = StreamCount()
    stubs = [StubReplica(barrier=n, shared=shared, barrier_timeout_s=300).start() for _ in range(replicas)]
    try:
        extra = ("--max-connections", str(n + 1000), "--connect-timeout", "60")
        with gateway_process([s.url for s in stubs], *extra) as port:
            t = time.perf_counter()
            results = asyncio.run(concurrent_streams(port, n))
            seconds = time.perf_counter() - t
    finally:
        for s in stubs:
            s.stop()
    ok = sum(1 for r in results if isinstance(r, RawResponse) and r.status == 200 and r.body.endswith(b"[DONE]\n\n"))
    return {
        "streams": n,
        "completed": ok,
        "all_open_at_once": shared.started == n and not any(s.barrier_timeouts for s in stubs),
        "seconds": seconds,
    }
