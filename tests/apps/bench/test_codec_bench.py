"""``flipsync bench codec``: a smoke run, side by side with the peers' encodings (no timing is asserted)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from flipsync_apps.bench import codec as codec_bench
from flipsync_apps.bench import codec_markdown
from flipsync_apps.bench.codec_records import CodecReport, CodecRow
from flipsync_apps.bench.codec_tables import terminal_tables
from flipsync_apps.bench.peers import PEER_KEYS
from flipsync_apps.synthetic import Shape, llm_like_masters


@pytest.fixture(scope="module")
def quick_report() -> CodecReport:
    return codec_bench.run(Console(file=io.StringIO()), quick=True, formats=("bf16",), lrs=(1e-6,), real=False)


def test_codec_bench_runs_side_by_side(quick_report: CodecReport) -> None:
    """A smoke run of the benchmark (no timing is asserted: speed is measured by the bench itself)."""
    report = quick_report
    (row,) = report.rows
    assert row.optimizer == "adam" and set(row.peers_bpc) == set(PEER_KEYS) and row.peers_verified
    # the peers' index + value layouts cost their index width plus the raw element, a little more for headers
    assert 6.0 < row.peer("vllm_sparse") < row.peer("trl_raw") < 6.2
    assert 6.0 < row.peer("verl_delta_sharded") < 6.2
    assert row.changed > 0 and row.ours_bpc < row.peer("slime_xor") < row.peer("trl_gap_delta")
    assert row.xor_zstd_bpc < row.peer("slime_xor")  # slime's container costs something over the bare payload
    # version 1 coders cannot beat the bound that treats positions as equally likely; ctx cannot beat the one
    # conditioned on the base value's class (the model it codes with), and it never makes a patch bigger
    assert row.plain_bpc >= row.bound_bpc * 0.99
    assert row.ours_bpc >= row.cond_bound_bpc * 0.99
    assert row.ours_bpc <= row.plain_bpc
    md = codec_markdown.markdown(report)
    assert "| llm-like (quick) | adam | bf16 |" in md
    assert "vLLM 0.32.0 sparse_nccl (int32 + values) B/chg" in md and "int64+val" not in md


def test_terminal_tables_fit_100_columns(quick_report: CodecReport) -> None:
    """Every table `flipsync bench codec` prints fits a 100-column terminal, headers and cells whole."""
    row = quick_report.rows[0]
    report = CodecReport([row], quick_report.apply)
    # the longest labels a run can have: a real model's Muon row
    wide = CodecRow(
        **{**row.__dict__, "workload": "SmolLM2-135M blocks 0-7 (Q4_1, dequantized)", "format": "fp8-block"}
    )
    wide.optimizer = "muon"
    wide.peers_bpc = dict.fromkeys(wide.peers_bpc, 11.451)  # what slime's xor spends on SmolLM2's FP4 views
    report.rows.append(wide)
    console = Console(file=io.StringIO(), width=100, record=True)
    tables = terminal_tables(report)
    assert len(tables) == 5
    for t in tables:
        console.print(t)
    text = console.export_text()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "SmolLM2/muon" in text


def test_muon_rows_and_contexts_on_real_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """With real weights (here stand-ins: the quick workload under a real model's name) the bench adds Muon rows
    and measures the position contexts of their BF16 views."""
    from flipsync_apps.bench import codec

    fake = llm_like_masters(Shape(hidden=128, intermediate=256, layers=1, vocab=512))
    monkeypatch.setattr(codec, "real_masters", lambda: iter([("all-MiniLM-L6-v2", fake)]))
    monkeypatch.setattr(codec, "QUICK", Shape(hidden=64, intermediate=128, layers=1, vocab=256))
    report = codec.run(Console(file=io.StringIO()), quick=True, formats=("bf16", "mxfp4"), lrs=(1e-5,))
    kinds = [(r.workload, r.optimizer, r.format) for r in report.rows]
    assert ("all-MiniLM-L6-v2", "muon", "bf16") in kinds and ("all-MiniLM-L6-v2", "muon", "mxfp4") not in kinds
    muon = next(r for r in report.rows if r.optimizer == "muon")
    assert muon.contexts_bpc is not None and muon.contexts_bpc["exponent"] > 0
    assert all(v > 0 for v in muon.contexts_bpc.values())
    assert report.reference is not None and report.reference.lr == codec.REFERENCE_LR
    md = codec_markdown.markdown(report)
    assert "Position contexts under Muon" in md and "Reproducing the peers' own figures" in md
