"""The fused bench runs end to end on a micro setup: every method finds the same changes; no timings."""

from __future__ import annotations

import io

from rich.console import Console

from flipsync_apps.bench import fused
from flipsync_apps.synthetic import Shape


def test_fused_bench_reports_every_method_and_phase() -> None:
    micro = Shape(hidden=64, intermediate=128, layers=1, vocab=256)
    out = fused.run(Console(width=250, file=io.StringIO()), threads=(1, 2), shape=micro)
    assert [(r["format"], r["threads"]) for r in out["rows"]][:4] == [
        ("bf16", 1),
        ("bf16", 2),
        ("fp16", 1),
        ("fp16", 2),
    ]
    assert {r["format"] for r in out["rows"]} == {"bf16", "fp16", *fused.QUANTIZED}
    for r in out["rows"]:
        assert 0 < r["changed_pct"] < 100 and r["served_bytes"] > 0
        assert r["fused_ns_per_byte"] > 0 and r["torch_flatnonzero_ns_per_byte"] > 0 and r["vs_flatnonzero"] > 0
        # the memory floor is timed for the element-wise casts only
        assert (r["floor_ns_per_byte"] > 0) == (r["format"] in fused.DTYPES)
        assert (r["floor_vs_flatnonzero"] is not None) == (r["format"] in fused.DTYPES)
    for phases in out["publish_ns_per_byte"].values():
        assert set(phases) == {"fused", "separate"}
        for p in phases.values():
            assert set(p) == {*fused.PHASES, "total"} and p["total"] > 0
    assert "|" in fused.markdown(out)
