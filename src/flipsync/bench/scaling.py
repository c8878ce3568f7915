"""``flipsync bench scaling``: how each step of an update grows with the size of the tensor.

One bf16 tensor of N(0, 0.02^2) values, 0.3% of them moved by one bit-pattern step at random positions;
N grows from 10M elements (quick: 10M, 40M; full: 10M, 100M, 400M, the most that fits comfortably in 24 GiB
with the copies the steps need). Steps, each timed once per size (best of ``repeat``):

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

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from flipsync.codec import DiffEngine, FingerprintTable, Patch, diff_views
from flipsync.codec import commit as codec_commit
from flipsync.codec import stage as codec_stage
from flipsync.codec.bits import int_view

FRACTION = 0.003


@dataclass(frozen=True)
class Setup:
    sizes: tuple[int, ...]
    repeat: int


QUICK = Setup((10_000_000, 40_000_000), repeat=2)
FULL = Setup((10_000_000, 100_000_000, 400_000_000), repeat=2)


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


def run(console: Console, quick: bool = False) -> dict[str, Any]:
    setup = QUICK if quick else FULL
    rows = []
    table = Table(title=f"bf16, {FRACTION:.1%} changed; ms (ns per byte or per changed value)")
    for col in ("elements", "changed", "patch kB", *(c[0] for c in COLUMNS), "verified"):
        table.add_column(col, justify="right")
    with DiffEngine() as engine:
        for n in setup.sizes:
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
    return {"fraction": FRACTION, "rows": rows}


def markdown(result: dict[str, Any]) -> str:
    head = ["elements", "changed", "patch kB", *(c[0] for c in COLUMNS), "verified"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        cells = [f"{r['elements']:,}", f"{r['changed']:,}", f"{r['patch_bytes'] / 1e3:.0f}", *_cells(r)]
        lines.append("| " + " | ".join([*cells, "yes" if r["verified"] else "NO"]) + " |")
    return "\n".join(lines)
