"""``flipsync bench sidecar``: the engine pause measured against the patch size (no timing is asserted)."""

from __future__ import annotations

import io

from rich.console import Console

from flipsync_apps.bench import sidecar as bench


def test_bench_measures_pause_against_patch_size() -> None:
    setup = bench.Setup("tiny", (1e-3, 3e-2), repeat=1, formats=("bf16",), audit_sizes=((64, 128),))
    res = bench.run(Console(file=io.StringIO()), setup=setup)
    rows = res["formats"]["bf16"]["rows"]
    assert [r["fraction"] for r in rows] == [1e-3, 3e-2]
    assert rows[0]["changed"] < rows[1]["changed"] and rows[0]["patch_bytes"] < rows[1]["patch_bytes"]
    assert all(r["pause_s"] > 0 and r["stage_s"] > 0 for r in rows)
    assert res["bf16_scaling"]["changed_ratio"] > 10
    (row,) = res["audit"]["rows"]  # the kernel-state audit's cost per touched layer, beside the reload's
    audited = [row[m]["audited_layers"] for m in ("off", "sample", "every")]
    assert audited[0] == 0 < audited[1] <= audited[2] == 2 * res["audit"]["layers"], audited
    assert row["every"]["audit_per_layer_s"] > 0 and row["sample"]["audit_per_layer_s"] > 0
    assert all(row[m]["reload_per_layer_s"] > 0 for m in ("off", "sample", "every"))
