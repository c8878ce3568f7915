"""``flipsync bench optimizers``: a smoke run (tiny synthetic masters), its table, JSON and plots."""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console

from flipsync_apps.bench import optimizers


def test_bench_optimizers_quick(tmp_path: Path) -> None:
    console = Console(file=io.StringIO(), width=100, record=True)
    doc = optimizers.run(console, quick=True, out=tmp_path)
    (comp,) = doc["comparisons"]
    assert [(r["optimizer"], r["match"]) for r in comp["runs"]] == [("adam", "lr"), ("muon", "lr"), ("muon", "rms")]
    assert json.loads((tmp_path / "optimizers.json").read_text())["comparisons"][0]["workload"] == "llm-like"
    for name in ("change-vs-magnitude.png", "change-by-kind.png"):
        assert (tmp_path / name).stat().st_size > 5000
    text = console.export_text()
    assert "muon@rms" in text and "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 100
