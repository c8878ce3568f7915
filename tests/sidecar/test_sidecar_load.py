"""The version-aware proxy under load: hundreds of concurrent requests (streaming and not, with min and
exact version constraints) while the trainer publishes a new version every second.

Asserts: no request lost (each ends in 200, or 409 when its constraint cannot be met), no request served
on a version that violates its constraint, and every response's start and end versions bound the version
of every token it carries. Loopback only, bounded in
count (FLIPSYNC_LOAD_REQUESTS, default 240) and time.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from typing import Any

import httpx
import pytest

from tests.sidecar.sidecar_helpers import StackFactory, Trainer

REQUESTS = int(os.environ.get("FLIPSYNC_LOAD_REQUESTS", "240"))


async def _one(client: httpx.AsyncClient, i: int, current: int) -> dict[str, Any]:
    stream = i % 2 == 0
    constraint: dict[str, int] = {}
    if i % 5 == 1:
        constraint = {"exact_version": current}
    elif i % 5 == 2:
        constraint = {"min_version": current}
    elif i % 5 == 3:
        constraint = {"min_version": current + 100}  # unsatisfiable: must be a clean 409
    body: dict[str, Any] = {"prompt": f"{i} ", "max_tokens": 4, "temperature": 1.0, "seed": i, "stream": stream}
    if constraint:
        body["weight_version"] = constraint
    out: dict[str, Any] = {"i": i, "constraint": constraint, "stream": stream}
    if not stream:
        r = await client.post("/v1/completions", json=body)
        out["status"] = r.status_code
        if r.status_code == 409:
            out["refusal"] = r.json()["weight_version"]
        elif r.status_code != 200:
            out["body"] = r.text[:300]
        if r.status_code == 200:
            doc = r.json()
            out["span"] = doc["weight_version"]
            out["tokens"] = [v for c in doc["choices"] for v in c["token_versions"]]
        return out
    async with client.stream("POST", "/v1/completions", json=body) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            await r.aread()
            if r.status_code == 409:
                out["refusal"] = r.json()["weight_version"]
            else:
                out["body"] = r.text[:300]
            return out
        events = [json.loads(line[6:]) async for line in r.aiter_lines() if line.startswith("data: {")]
    out["span"] = events[-1]["weight_version"]
    out["tokens"] = [v for e in events if e.get("choices") for v in e["choices"][0].get("token_versions", [])]
    return out


async def _load(url: str, trainer: Trainer) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=REQUESTS, max_keepalive_connections=REQUESTS)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        tasks = [_one(client, i, trainer.version) for i in range(REQUESTS)]
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)


def test_proxy_under_load_while_versions_land(
    trainer: Trainer, make_stack: StackFactory, caplog: pytest.LogCaptureFixture
) -> None:
    s = make_stack(poll=0.05)
    assert s.replica.wait_version(0, 60)  # a readiness wait: minutes of CPU are not what this test measures
    stop = threading.Event()
    published: list[int] = []

    def publish_every_second() -> None:
        while not stop.wait(1.0):
            trainer.step(fraction=0.02)
            published.append(trainer.version)

    publisher = threading.Thread(target=publish_every_second, daemon=True)
    publisher.start()
    started = time.monotonic()
    try:
        results = asyncio.run(_load(s.sidecar.url, trainer))
    finally:
        stop.set()
        publisher.join(10)
    took = time.monotonic() - started

    assert len(results) == REQUESTS  # nothing lost
    statuses = {r["status"] for r in results}
    assert statuses <= {200, 409}, [r for r in results if r["status"] not in (200, 409)][:3]
    for r in results:
        c = r["constraint"]
        if "min_version" in c and c["min_version"] > trainer.version:
            assert r["status"] == 409  # the unsatisfiable ones
            continue
        if r["status"] == 409:  # an exact version the replica had already moved past: refused, not served
            assert "exact_version" in c and r["refusal"]["current"] != c["exact_version"], r
            continue
        start, end = r["span"]["start"], r["span"]["end"]
        assert start <= end
        assert start >= c.get("min_version", 0)
        if "exact_version" in c:
            assert start == c["exact_version"]
            # A pinned request ends on its version, unless a drain ran out of time and the commit went ahead
            # under it (a loaded machine): then it reports both versions, as the gate's warning says.
            assert end == start or any("committing anyway" in rec.getMessage() for rec in caplog.records), r
        tokens = r["tokens"]
        # [start, end] bounds every token's version (start is the version the request was admitted at; an
        # upstream that queues it may begin later, on a newer version), and constraints hold for every token
        assert tokens and all(start <= v <= end for v in tokens)
        assert tokens == sorted(tokens)  # a commit lands between decode steps, never backwards
    crossed = sum(1 for r in results if r["status"] == 200 and r["span"]["start"] != r["span"]["end"])
    print(
        f"{REQUESTS} requests in {took:.1f} s while {len(published)} versions landed; "
        f"{sum(r['status'] == 409 for r in results)} refused (409), {crossed} spanned a commit"
    )
    assert published  # versions really landed during the load
