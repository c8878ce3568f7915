"""The terminal tables of ``flipsync bench codec``, each within 100 columns: patch size against the bounds, the
peers, speed, stage and the apply cost, with the cell formats the markdown section shares.
"""

from __future__ import annotations

from rich.table import Table

from flipsync_apps.bench.codec_records import ApplyRow, CodecReport, CodecRow
from flipsync_apps.bench.workload import short_name


def apply_table(rows: list[ApplyRow]) -> Table:
    t = Table(title="Apply into one bf16 tensor: stage (decode, off the pause) and commit (in-place scatter)")
    for col in ("elements", "changed %", "stage ms", "commit ms", "full copy ms", "commit / copy"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(*apply_cells(r))
    return t


def apply_cells(r: ApplyRow) -> tuple[str, ...]:
    return (
        f"{r.elements:,}",
        f"{r.changed_pct:.2f}",
        f"{r.stage_ms:.1f}",
        f"{r.commit_ms:.2f}",
        f"{r.copy_ms:.1f}",
        f"{r.commit_vs_copy:.3f}",
    )


def row_label(r: CodecRow) -> str:
    """A row's workload as the terminal shows it: the short name, ``/muon`` for a Muon row."""
    return short_name(r.workload) + ("" if r.optimizer == "adam" else f"/{r.optimizer}")


def _table(title: str, head: tuple[str, ...], rows: list[tuple[str, ...]], left: int = 2, caption: str = "") -> Table:
    t = Table(title=title, caption=caption or None)
    for i, col in enumerate(head):
        t.add_column(col, justify="left" if i < left else "right", no_wrap=True)
    for r in rows:
        t.add_row(*r)
    return t


def cell(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else f"{x:{fmt}}"


# The peers' columns: (key, terminal header, markdown header)
PEER_COLUMNS = (
    ("slime_xor", "xor", "slime 0.4.0 / miles xor+zstd-1 (with its safetensors container and index)"),
    ("slime_overwrite", "ovw", "slime 0.4.0 / miles overwrite"),
    ("slime_deltas_zstd", "#1806", "slime #1806 deltas_zstd"),
    ("trl_gap_delta", "gap", "TRL #5937 gap_delta (its default)"),
    ("trl_raw", "raw", "TRL #5937 raw"),
    ("vllm_sparse", "vLLM", "vLLM 0.32.0 sparse_nccl (int32 + values)"),
    ("verl_delta_sharded", "verl", "verl 0.9 delta_sharded (int32 + values)"),
)


def terminal_tables(report: CodecReport) -> list[Table]:
    """The codec tables as a terminal shows them, each within 100 columns: size against the bounds, the peers,
    speed, stage, then the apply cost. Every figure, and the ratios, are in the JSON and the markdown."""
    rows = report.rows
    row_id = [(row_label(r), r.format, f"{r.lr:g}") for r in rows]
    size = _table(
        "Patch size, bytes per changed value",
        ("workload", "format", "lr", "chg %", "bound", "cond", "ours", "plain", "ours/cond"),
        [
            (
                *ident,
                f"{r.changed_pct:.3f}",
                f"{r.bound_bpc:.3f}",
                f"{r.cond_bound_bpc:.3f}",
                f"{r.ours_bpc:.3f}",
                f"{r.plain_bpc:.3f}",
                f"{r.ours_bpc / r.cond_bound_bpc:.3f}",
            )
            for ident, r in zip(row_id, rows, strict=True)
        ],
        left=3,
        caption="bound: positions as equally likely; cond: conditioned on the base value's exponent class; "
        "ours: the whole patch; plain: without base-coded positions",
    )
    peer_tab = _table(
        "The peers as they ship, bytes per changed value (each decoded back bit for bit)",
        ("workload", "format", "lr", "ours", *(h for _, h, _ in PEER_COLUMNS)),
        [
            (*ident, f"{r.ours_bpc:.2f}", *(cell(r.peer(k), ".2f") for k, _, _ in PEER_COLUMNS))
            for ident, r in zip(row_id, rows, strict=True)
        ],
        left=3,
        caption="xor, ovw: slime 0.4.0 / miles disk delta; #1806: slime deltas_zstd; gap, raw: TRL #5937; "
        "vLLM 0.32.0 sparse_nccl; verl 0.9 delta_sharded; -: does not apply to this view",
    )
    speed = _table(
        "Speed",
        ("workload", "format", "lr", "ours", "xor", "vLLM", "decode", "diff x", "commit"),
        [
            (
                *ident,
                f"{r.encode_mb_s:.0f}",
                f"{r.slime_xor_mb_s:.0f}",
                f"{r.vllm_sparse_mb_s:.0f}",
                f"{r.decode_mpos_s:.1f}",
                f"{r.diff_speedup:.2f}",
                f"{r.apply_vs_copy:.3f}",
            )
            for ident, r in zip(row_id, rows, strict=True)
        ],
        left=3,
        caption="ours, xor (slime), vLLM: MB/s of served view through each encoder; decode: M changed values/s; "
        "diff x: our diff over np.flatnonzero(a != b); commit: in-place commit / copying the view",
    )
    stage_tab = _table(
        "Stage (what a receiver does off the pause)",
        ("workload", "format", "lr", "ns/chg", "plain", "ratio", "ns/B", "plain/B", "index", "hdr B"),
        [
            (
                *ident,
                f"{r.stage_ns:.0f}",
                f"{r.stage_plain_ns:.0f}",
                f"{r.stage_ns / r.stage_plain_ns:.2f}",
                f"{r.stage_ns_b:.2f}",
                f"{r.stage_plain_ns_b:.2f}",
                f"{r.index_ns_b:.2f}",
                f"{r.header_bpt:.0f}",
            )
            for ident, r in zip(row_id, rows, strict=True)
        ],
        left=3,
        caption="codec.stage per changed value (ns/chg) and per base byte (ns/B), the patch and its plain twin "
        "(no base-coded positions); index: building the class index, ns/B; hdr B: bytes outside the coded sections "
        "per changed tensor",
    )
    return [size, peer_tab, speed, stage_tab, apply_table(report.apply)]


def table(rows: list[CodecRow]) -> Table:
    """The size table alone (what ``terminal_tables`` shows first)."""
    return terminal_tables(CodecReport(rows, []))[0]
