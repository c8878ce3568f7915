"""``flipsync bench fused``: the publisher's fused cast-and-diff pass beside a cast then a compare.

On the same synthetic masters moved by real Adam steps (`flipsync.synthetic`), every floating tensor's new
served view is computed and compared with the previous one three ways, timed back to back in one process
(best of a few interleaved repeats, so load from elsewhere hits all alike):

- *fused*: `flipsync.formats.fused.FusedCaster.cast_diff` (one pass: cast, compare, changed positions with
  old and new bits), into reused buffers, on ``threads`` pool threads;
- *torch cast + flatnonzero*: ``master.to(dtype)`` then ``np.flatnonzero(old != new)`` on integer views
  (torch with ``threads`` intra-op threads; numpy on one);
- *cast + DiffEngine* (what the publisher did before): `cast_master` into reused buffers, then
  `flipsync.codec.DiffEngine.changes` on ``threads`` threads.

Costs are nanoseconds per served byte (the new view's bytes); the ratios are the baselines' time over the
fused pass's. All three must find the same changed positions (checked).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from flipsync.bench.report import md_table
from flipsync.bench.workload import FULL, QUICK, AdamSteps, llm_like_masters
from flipsync.codec import DiffEngine
from flipsync.formats.base import cast_master
from flipsync.formats.fused import FusedCaster

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LR = 1e-6


@dataclass(frozen=True)
class FusedRow:
    format: str
    threads: int
    served_bytes: int
    changed_pct: float
    fused_ns_per_byte: float
    torch_flatnonzero_ns_per_byte: float
    cast_diffengine_ns_per_byte: float

    @property
    def vs_flatnonzero(self) -> float:
        return self.torch_flatnonzero_ns_per_byte / self.fused_ns_per_byte

    @property
    def vs_diffengine(self) -> float:
        return self.cast_diffengine_ns_per_byte / self.fused_ns_per_byte


def _ints(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.int16).numpy()


def measure(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], fmt: str, threads: int, repeat: int
) -> FusedRow:
    """One row: the three methods on every tensor of ``after`` against the served view of ``before``."""
    dtype = DTYPES[fmt]
    names = [n for n, t in after.items() if t.is_floating_point()]
    prev = {n: before[n].to(dtype) for n in names}
    prev_ints = {n: _ints(prev[n]) for n in names}
    bufs = {n: torch.empty(after[n].shape, dtype=dtype) for n in names}
    served = sum(t.numel() * t.element_size() for t in prev.values())
    counts: dict[str, int] = {}
    old_threads = torch.get_num_threads()
    with FusedCaster(threads) as caster, DiffEngine(threads) as engine:

        def fused() -> None:
            counts["fused"] = sum(caster.cast_diff(n, after[n], dtype, prev[n], bufs[n])[1].size for n in names)

        def torch_flatnonzero() -> None:
            counts["torch"] = sum(np.flatnonzero(prev_ints[n] != _ints(after[n].to(dtype))).size for n in names)

        def cast_diffengine() -> None:
            counts["engine"] = sum(
                engine.changes(prev[n], cast_master(n, after[n], dtype, bufs[n])).size for n in names
            )

        methods: list[Callable[[], None]] = [fused, torch_flatnonzero, cast_diffengine]
        best = [float("inf")] * len(methods)
        try:
            torch.set_num_threads(threads)
            for method in methods:  # untimed: page faults of fresh buffers, kernels compiled
                method()
            for _ in range(repeat):
                for i, method in enumerate(methods):
                    t0 = time.perf_counter()
                    method()
                    best[i] = min(best[i], time.perf_counter() - t0)
        finally:
            torch.set_num_threads(old_threads)
    if len(set(counts.values())) != 1:
        raise AssertionError(f"the methods found different numbers of changes: {counts}")
    elements = served // 2
    ns = [b / served * 1e9 for b in best]
    return FusedRow(fmt, threads, served, 100 * counts["fused"] / elements, *ns)


def run(console: Console, quick: bool = False, threads: tuple[int, ...] = (1, 2)) -> dict[str, Any]:
    """Measure and print; returns the rows."""
    masters = llm_like_masters(QUICK if quick else FULL)
    steps = AdamSteps(masters, LR)
    steps.step()  # Adam's first step moves every weight by lr: take two later, typical ones
    before = steps.step()
    after = steps.step()
    rows = []
    with console.status("fused bench") as status:
        for fmt in DTYPES:
            for n in threads:
                status.update(f"fused bench: {fmt}, {n} thread(s)")
                rows.append(measure(before, after, fmt, n, repeat=3 if quick else 5))
    console.print(table(rows))
    return {"lr": LR, "rows": [asdict(r) | {"vs_flatnonzero": r.vs_flatnonzero} for r in rows]}


def _cells(r: FusedRow) -> tuple[str, ...]:
    return (
        r.format,
        str(r.threads),
        f"{r.served_bytes / 1e6:.0f} MB",
        f"{r.changed_pct:.2f}%",
        f"{r.fused_ns_per_byte:.3f}",
        f"{r.torch_flatnonzero_ns_per_byte:.3f}",
        f"{r.cast_diffengine_ns_per_byte:.3f}",
        f"{r.vs_flatnonzero:.2f}x",
        f"{r.vs_diffengine:.2f}x",
    )


HEAD = (
    "format",
    "threads",
    "served",
    "changed",
    "fused ns/B",
    "torch cast + flatnonzero ns/B",
    "cast + DiffEngine ns/B",
    "fused vs flatnonzero",
    "fused vs DiffEngine",
)


def table(rows: list[FusedRow]) -> Table:
    t = Table(title=f"Served view + changes, per served byte: fused pass vs cast then compare (Adam lr {LR:g})")
    for i, col in enumerate(HEAD):
        t.add_column(col, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*_cells(r))
    return t


def markdown(result: dict[str, Any]) -> str:
    rows = [FusedRow(**{k: v for k, v in r.items() if k != "vs_flatnonzero"}) for r in result["rows"]]
    return md_table(HEAD, [_cells(r) for r in rows])
