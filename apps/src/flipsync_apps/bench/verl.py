"""``flipsync bench verl``: bytes per weight sync, flipsync's checkpoint engine beside verl's ``delta_sharded``.

The same masters (the benchmarks' llm-like weights, then every real-weight package installed) take three Adam
steps at lr 1e-6. Each sync's weights go through `flipsync.integrations.named.StepPublisher` (what the verl
engine's actor rank 0 runs) onto a board in memory; its bytes are the version's patch part plus its manifest,
what a rollout worker downloads. verl's ``delta_sharded`` sends each changed value as an int32 position and
the raw bf16 value (``_assemble_flush``: 4 + 2 bytes per changed value), plus a JSON spec per flush; its
count here is that rule, which tests/integrations/test_verl.py checks against verl's own encoder (run on
verl's FSDP export of a small Llama) on every run with verl installed. Both diff the same bf16 views, so
they change the same values.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from flipsync.board import open_store
from flipsync.board.catalog import Catalog
from flipsync.codec.bits import int_view
from flipsync.formats import served_view
from flipsync.integrations.named import StepPublisher
from flipsync.trainer import PublisherConfig
from flipsync_apps.bench.report import md_table
from flipsync_apps.bench.workload import FULL, QUICK, real_masters
from flipsync_apps.synthetic import AdamSteps, llm_like_masters

LR = 1e-6
STEPS = 3
DELTA_SHARDED_BYTES_PER_VALUE = 4 + 2  # int32 position + raw bf16 value


def workloads(quick: bool) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    shape = QUICK if quick else FULL
    yield f"llm-like ({shape.hidden} hidden, {shape.layers} layers)", llm_like_masters(shape)
    yield from real_masters()


def one(name: str, masters: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    store = open_store("memory://")
    pub = StepPublisher(store, run="bench", config=PublisherConfig(background=False, spans=False))
    steps = AdamSteps(masters, LR)
    rows = []
    prev = None
    current = masters
    for g in range(STEPS + 1):
        if g:
            current = steps.step()
        view = served_view(current, "bf16")
        published = pub.publish(current, g)
        if prev is not None:
            changed = sum(int((int_view(view[k]) != int_view(prev[k])).sum()) for k in view)
            manifest = len(store.get(Catalog(store, "bench").layout.version_manifest(published.version)))
            ours = published.part_bytes + manifest
            theirs = DELTA_SHARDED_BYTES_PER_VALUE * changed
            rows.append(
                {
                    "workload": name,
                    "step": g,
                    "elements": sum(v.numel() for v in view.values()),
                    "changed": changed,
                    "flipsync_bytes": ours,
                    "delta_sharded_bytes": theirs,
                    "ratio": theirs / ours if ours else float("nan"),
                }
            )
        prev = view
    pub.close()
    return rows


def run(console: Console, quick: bool = False) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for name, masters in workloads(quick):
        rows += one(name, masters)
    table = Table(title=f"bytes per sync, BF16, lr {LR:g} (flipsync engine vs verl delta_sharded)")
    for col in ("workload", "step", "changed %", "flipsync B", "B/value", "delta_sharded B", "B/value", "ratio"):
        table.add_column(col, justify="left" if col == "workload" else "right")
    for r in rows:
        table.add_row(*_cells(r))
    console.print(table)
    return {"lr": LR, "steps": STEPS, "rows": rows}


def _cells(r: dict[str, Any]) -> list[str]:
    n = r["changed"] or 1
    return [
        r["workload"],
        str(r["step"]),
        f"{100 * r['changed'] / r['elements']:.2f}",
        f"{r['flipsync_bytes']:,}",
        f"{r['flipsync_bytes'] / n:.2f}",
        f"{r['delta_sharded_bytes']:,}",
        f"{r['delta_sharded_bytes'] / n:.2f}",
        f"{r['ratio']:.1f}x",
    ]


def markdown(result: dict[str, Any]) -> str:
    head = ("workload", "step", "changed %", "flipsync bytes", "per changed value", "delta_sharded bytes",
            "per changed value", "delta_sharded / flipsync")  # fmt: skip
    return "\n\n".join(
        [
            "The flipsync verl checkpoint engine (docs/integrations/verl.md) against verl's own delta engine, "
            "`delta_sharded`, on the same weight syncs: the masters take three Adam steps at lr "
            f"{result['lr']:g}, each sync's weights published through the engine's `StepPublisher` (one "
            "version per sync, patch part + manifest: what a rollout worker downloads) and counted as "
            "`delta_sharded` sends them (int32 position + raw bf16 value per changed value; its JSON spec per "
            "flush, a few KB, left out). That count is verl's encoder's: `tests/integrations/test_verl.py` runs "
            "verl 0.9.1's `DeltaShardedCheckpointEngine` on verl's FSDP export of a small Llama and checks its "
            "flushes hold exactly 6 bytes per changed value. Both diff the same bf16 views.",
            md_table(head, (_cells(r) for r in result["rows"])),
        ]
    )
