"""The trainer bench runs end to end on a micro setup and reports what docs/trainer.md quotes."""

from __future__ import annotations

import io

from rich.console import Console

from flipsync_apps.bench import trainer


def test_bench_reports_added_time_and_peak_memory() -> None:
    micro = trainer.Setup(hidden=32, intermediate=64, layers=1, vocab=128, seq=8, batch=2, rounds=1, block=2)
    out = trainer.run(Console(width=200, file=io.StringIO()), setup=micro)
    assert set(out["configs"]) == {"background", "background, no spans", "inline"}
    for row in out["configs"].values():
        assert {"added", "peak_view_multiple", "versions", "steps"} <= set(row)
        assert 1.0 <= row["peak_view_multiple"] <= 4.0
    assert out["configs"]["inline"]["versions"] == out["configs"]["inline"]["steps"] + 1  # v0 + one per step
    assert out["publish_cpu_s"] > 0 and out["train_cpu_s"] > 0
