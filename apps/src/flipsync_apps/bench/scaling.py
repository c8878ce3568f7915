"""``flipsync bench scaling``: how each step of an update grows with the size of the tensor.

One bf16 tensor of N(0, 0.02^2) values, 0.3% of them moved by one bit-pattern step at random positions;
N grows from 10M elements (quick: 10M, 40M; full: 10M, 100M, 400M and 1B; a size whose working set, about
four copies of the tensor, does not fit in the memory available at the time is skipped and reported).
Steps, each timed once per size (best of ``repeat``):

- **diff**: ``DiffEngine.changed_positions_many``, a scan of both tensors: O(bytes);
- **encode**: ``diff_views`` (diff, fingerprints, digests, coding): O(bytes) + O(changed);
- **decode**: ``Patch.from_bytes(...).changes()``: O(changed);
- **stage** + **commit**: ``codec.stage`` (decode, base check) and ``codec.commit`` (in-place scatter,
  incremental fingerprint update and target check): O(changed);
- **fingerprint**: ``FingerprintTable.of`` of the whole tensor, what a full audit costs: O(bytes).

Reported as ns per byte of the view (diff, encode, fingerprint) and ns per changed value (decode, stage,
commit): flat columns mean linear scaling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from flipsync.codec import DiffEngine, Patch, diff_views
from flipsync.codec import commit as codec_commit
from flipsync.codec import stage as codec_stage
from flipsync.codec.bits import int_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync_apps.bench.report import Figures, md_table, pyplot, save_figure

FRACTION = 0.003
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Setup:
    sizes: tuple[int, ...]
    repeat: int


QUICK = Setup((10_000_000, 40_000_000), repeat=2)
FULL = Setup((10_000_000, 100_000_000, 400_000_000, 1_000_000_000), repeat=2)
WORKING_SET = 4  # copies of the tensor alive at once: old, new, target, staging (measured: ~3.2 at 1B)


def make_pair(n: int, fraction: float = FRACTION, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    old = torch.empty(n, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=g)
    new = old.clone()
    pos = torch.from_numpy(np.unique(rng.integers(0, n, size=max(1, round(fraction * n)), dtype=np.int64)))
    step = torch.from_numpy(rng.integers(0, 2, size=pos.numel()).astype(np.int16) * 2 - 1)
    flat = int_view(new)
    flat[pos] = flat[pos] + step
    return old, new


def _best(fn: Callable[[], object], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(n: int, repeat: int, engine: DiffEngine) -> dict[str, Any]:
    old, new = make_pair(n)
    nbytes = n * old.element_size()
    view0, view1 = {"w": old}, {"w": new}
    table0 = FingerprintTable.of(view0)
    changed = int(engine.changed_positions_many([(old, new)])[0].size)
    diff_s = _best(lambda: engine.changed_positions_many([(old, new)]), repeat)
    encode_s = _best(lambda: diff_views(view0, view1, old_table=table0, engine=engine, served_format="bf16"), repeat)
    patch, table1 = diff_views(view0, view1, old_table=table0, engine=engine, served_format="bf16")
    data = patch.to_bytes()
    decode_s = _best(lambda: list(Patch.from_bytes(data).changes()), repeat)
    fingerprint_s = _best(lambda: FingerprintTable.of(view1), repeat)
    stage_s = commit_s = float("inf")
    target = {"w": old.clone()}
    ok = True
    for _ in range(repeat):
        table = FingerprintTable.of(view0)
        int_view(target["w"]).copy_(int_view(old))
        t0 = time.perf_counter()
        staged = codec_stage(target, patch, table)
        t1 = time.perf_counter()
        codec_commit(target, staged, table)
        t2 = time.perf_counter()
        stage_s, commit_s = min(stage_s, t1 - t0), min(commit_s, t2 - t1)
        ok = ok and table.view_fp() == table1.view_fp()
    return {
        "elements": n,
        "bytes": nbytes,
        "changed": changed,
        "patch_bytes": len(data),
        "diff_s": diff_s,
        "encode_s": encode_s,
        "decode_s": decode_s,
        "stage_s": stage_s,
        "commit_s": commit_s,
        "fingerprint_s": fingerprint_s,
        "verified": ok,
    }


COLUMNS = (
    ("diff", "diff_s", "bytes"),
    ("encode", "encode_s", "bytes"),
    ("fingerprint", "fingerprint_s", "bytes"),
    ("decode", "decode_s", "changed"),
    ("stage", "stage_s", "changed"),
    ("commit", "commit_s", "changed"),
)


def _cells(r: dict[str, Any]) -> list[str]:
    out = []
    for _, key, per in COLUMNS:
        unit = "B" if per == "bytes" else "chg"
        out.append(f"{r[key] * 1e3:.1f} ms ({r[key] * 1e9 / r[per]:.2f} ns/{unit})")
    return out


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def run(console: Console, quick: bool = False, *, setup: Setup | None = None) -> dict[str, Any]:
    setup = setup or (QUICK if quick else FULL)
    rows = []
    skipped: list[int] = []
    table = Table(title=f"bf16, {FRACTION:.1%} changed; ms (ns per byte or per changed value)")
    for col in ("elements", "changed", "patch kB", *(c[0] for c in COLUMNS), "verified"):
        table.add_column(col, justify="right")
    with DiffEngine() as engine, console.status("scaling bench") as status:
        for n in setup.sizes:
            free = available_bytes()
            if free is not None and WORKING_SET * 2 * n > free:
                log.warning(
                    "scaling: skipping %d elements: about %.1f GB needed, %.1f GB available",
                    n,
                    WORKING_SET * 2 * n / 1e9,
                    free / 1e9,
                )
                skipped.append(n)
                continue
            status.update(f"scaling bench: {n:,} elements")
            r = measure(n, setup.repeat, engine)
            rows.append(r)
            table.add_row(
                f"{n:,}",
                f"{r['changed']:,}",
                f"{r['patch_bytes'] / 1e3:.0f}",
                *_cells(r),
                "yes" if r["verified"] else "NO",
            )
    console.print(table)
    return {"fraction": FRACTION, "rows": rows, "skipped": skipped}


ABOUT = (
    "One BF16 tensor of N(0, 0.02^2) values with {pct} of them moved by one step of their bit pattern at "
    "random positions, at growing sizes. Steps, each the best of {repeat} runs: **diff** "
    "(`DiffEngine.changed_positions_many`, a scan of both tensors), **encode** (`diff_views`: diff, fingerprints, "
    "digests and coding), **fingerprint** (`FingerprintTable.of` of the whole tensor: what a full audit costs), "
    "**decode** (`Patch.from_bytes(...).changes()`), **stage** (`codec.stage`: decode and base check) and "
    "**commit** (`codec.commit`: the in-place scatter, incremental fingerprint update and target check). "
    "Whole-tensor steps are shown in ns per byte of the tensor, per-change steps in ns per changed value: a "
    "flat column means linear scaling (in bytes, or in changed values)."
)


def markdown(result: dict[str, Any], figures: Figures | None = None, *, repeat: int = 2) -> str:
    head = ["elements", "bytes", "changed", "patch kB", *(c[0] for c in COLUMNS), "verified"]
    rows = []
    for r in result["rows"]:
        cells = [
            f"{r['elements']:,}",
            f"{r['bytes'] / 1e9:.2f} GB",
            f"{r['changed']:,}",
            f"{r['patch_bytes'] / 1e3:,.0f}",
        ]
        rows.append([*cells, *_cells(r), "yes" if r["verified"] else "NO"])
    parts = [ABOUT.format(pct=f"{100 * result['fraction']:.1f}%", repeat=repeat), md_table(head, rows, left=0)]
    if result.get("skipped"):
        sizes = ", ".join(f"{n:,}" for n in result["skipped"])
        parts.append(f"Skipped for lack of free memory at the time of the run: {sizes} elements.")
    if figures is not None and result["rows"]:
        parts.append(figures.link(plot(result, figures.path("scaling.png")).name, "scaling"))
    return "\n\n".join(parts)


def plot(result: dict[str, Any], path: Path) -> Path:
    """ns per byte (whole-tensor steps) and ns per changed value (per-change steps) against elements."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["elements"] for r in result["rows"]]
    for ax, per, unit in ((left, "bytes", "ns per byte"), (right, "changed", "ns per changed value")):
        for name, key, p in COLUMNS:
            if p == per:
                ax.plot(xs, [r[key] * 1e9 / r[p] for r in result["rows"]], "-o", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("elements (bf16)")
        ax.set_ylabel(unit)
        ax.set_ylim(bottom=0)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path)
