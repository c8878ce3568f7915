"""The board benchmark runs end to end in quick mode (local filesystem and moto S3 on 127.0.0.1)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from flipsync_apps.bench.board import run


@pytest.mark.network_services
def test_board_bench_quick() -> None:
    out = io.StringIO()
    r = run(Console(file=out, width=160), quick=True)
    assert set(r["throughput"]) == {"file", "s3-moto"}
    for t in r["throughput"].values():
        assert t["publish_mb_s"] > 0 and t["catchup_mb_s"] > 0
    rows = r["catchup"]["rows"]
    assert [row["behind"] for row in rows] == [1, 4, 16, 63]
    for row in rows:  # the planner never downloads more than any single strategy
        assert row["planned_bytes"] <= min(row["chain_bytes"], row["spans_bytes"], row["keyframe_bytes"])
    assert r["catchup"]["keyframes_written"] >= 1
    assert "Catch-up download" in out.getvalue()
