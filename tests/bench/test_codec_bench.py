"""``flipsync bench codec``: a smoke run, side by side with the other methods (no timing is asserted)."""

from __future__ import annotations

import io

from rich.console import Console

from flipsync.bench import codec as codec_bench


def test_codec_bench_runs_side_by_side() -> None:
    """A smoke run of the benchmark (no timing is asserted: speed is measured by the bench itself)."""
    report = codec_bench.run(Console(file=io.StringIO()), quick=True, formats=("bf16",), lrs=(1e-6,), real=False)
    (row,) = report.rows
    assert row.changed > 0 and row.ours_bpc < row.xor_zstd_bpc < row.int32_bpc < row.int64_bpc
    # version 1 coders cannot beat the bound that treats positions as equally likely; ctx cannot beat the one
    # conditioned on the base value's class (the model it codes with), and it never makes a patch bigger
    assert row.v1_bpc >= row.bound_bpc * 0.99
    assert row.ours_bpc >= row.cond_bound_bpc * 0.99
    assert row.ours_bpc <= row.v1_bpc
    assert "| llm-like (quick) | bf16 |" in codec_bench.markdown(report)
