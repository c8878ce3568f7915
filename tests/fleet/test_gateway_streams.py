"""5,000 concurrent streams through one gateway (a ``flipsync gateway`` process) to 4 stub replicas (another
process): every stream stays open until all of them are (a barrier in the stubs), and all complete."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import httpx

from flipsync.fleet.stub_replica import RawResponse, concurrent_streams, gateway_process
from tests.sidecar.sidecar_helpers import stop_process

STREAMS = 5000


def test_5000_concurrent_streams_through_one_gateway_all_complete(tmp_path: Path) -> None:
    import asyncio

    # Each stream is a client socket here, two in the gateway and one in a stub: raise the open-file limits
    # (the processes started below inherit them).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * STREAMS + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    cmd = [sys.executable, "-m", "flipsync.fleet.stub_replica", "--replicas", "4", "--barrier", str(STREAMS)]
    stubs = subprocess.Popen(cmd, stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert stubs.stdout is not None
        urls = [stubs.stdout.readline().decode().strip() for _ in range(4)]
        assert all(u.startswith("http://") for u in urls), urls
        extra = ("--max-connections", str(STREAMS + 1000), "--connect-timeout", "60", "--hold", "60")
        with gateway_process(urls, *extra) as port:
            results = asyncio.run(concurrent_streams(port, STREAMS))
        failed = [r for r in results if not isinstance(r, RawResponse) or r.status != 200]
        assert not failed, (len(failed), failed[:3])
        assert all(isinstance(r, RawResponse) and r.body.endswith(b"data: [DONE]\n\n") for r in results)
        assert all(isinstance(r, RawResponse) and r.body.count(b"data: {") == 3 for r in results)
        counts = [httpx.get(f"{u}/flipsync/status", timeout=30).json()["stub"] for u in urls]
        assert counts[0]["all_started"] == STREAMS  # every stream was open at once: none passed the barrier early
        assert sum(c["barrier_timeouts"] for c in counts) == 0
        assert all(c["streams_started"] > 0 for c in counts)
    finally:
        stop_process(stubs)
