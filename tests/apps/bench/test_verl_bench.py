"""``flipsync bench verl``: its numbers are counted, not assumed (the delta_sharded rule, the board's bytes)."""

from __future__ import annotations

import pytest
from rich.console import Console

from flipsync_apps.bench import verl as verl_bench
from flipsync_apps.synthetic import Shape


def test_verl_bench_counts_both_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verl_bench, "QUICK", Shape(hidden=64, intermediate=128, layers=1, vocab=256))
    monkeypatch.setattr(verl_bench, "real_masters", lambda: iter(()))
    result = verl_bench.run(Console(width=200, record=True), quick=True)
    rows = result["rows"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0 < r["changed"] < r["elements"]
        assert r["delta_sharded_bytes"] == 6 * r["changed"]
        assert 0 < r["flipsync_bytes"] < r["delta_sharded_bytes"]
        assert r["ratio"] == pytest.approx(r["delta_sharded_bytes"] / r["flipsync_bytes"])
    md = verl_bench.markdown(result)
    assert "| workload | step | changed % | flipsync bytes |" in md and "delta_sharded" in md
