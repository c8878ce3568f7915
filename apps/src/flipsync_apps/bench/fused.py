"""``flipsync bench fused``: the publisher's one-pass cast-and-diff pass beside a cast then a compare.

On the same synthetic masters moved by real Adam steps (`flipsync_apps.synthetic`), every floating tensor's new
served view is computed and compared with the previous one three ways, timed back to back in one process
(best of a few interleaved repeats, so load from elsewhere hits all alike):

- *fused*: `flipsync.formats.cast_diff.CastDiffer.cast_diff` (one pass: cast, compare, changed positions with
  old and new bits), into reused buffers, on ``threads`` pool threads;
- *torch cast + flatnonzero*: ``master.to(dtype)`` then ``np.flatnonzero(old != new)`` on integer views
  (torch with ``threads`` intra-op threads; numpy on one);
- *cast + DiffEngine* (what the publisher did before): `cast_master` into reused buffers, then
  `flipsync.codec.DiffEngine.changes` on ``threads`` threads.

Costs are nanoseconds per served byte (the new view's bytes); the ratios are the baselines' time over the
fused pass's. All three must find the same changed positions (checked). For bf16 and fp16 a *memory floor*
is timed beside them: a pass that moves the one-pass cast's bytes (reads the master and the previous view, writes
the new view) and computes next to nothing, so no pass over these tensors can be faster on this machine;
*flatnonzero / floor* is the most any such pass could gain over the baseline here. Quantized formats get the same three
rows over their whole served view (`measure_quantized`): the publisher's fused pass (payloads and plain
casts in one pass, scales diffed after), and `served_view` followed by ``np.flatnonzero`` or `DiffEngine`.

Then the whole publication: two inline publishers (``background=False``, no spans, no keyframes) serve the
same masters as bf16 to one in-memory board, one with the one-pass cast and one without (``feed.fuse``),
stepping in turns after every Adam step; the table gives each phase of `Published.timings` (view, diff, code,
publish) per served byte, median over the steps.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from flipsync.board import KeyframePolicy, open_store
from flipsync.codec import DiffEngine
from flipsync.codec.jit import kernel
from flipsync.formats import served_view
from flipsync.formats.base import cast_master
from flipsync.formats.cast_diff import CastDiffer
from flipsync.trainer import Publisher, PublisherConfig
from flipsync.trainer.pieces import Fuse, Piece
from flipsync_apps.bench.report import md_table
from flipsync_apps.bench.workload import FULL, QUICK, AdamSteps, Shape, llm_like_masters

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
QUANTIZED = ("fp8-tensor", "fp8-channel", "fp8-block", "mxfp8", "mxfp4", "nvfp4")
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
    # process CPU time, the same three: on a loaded machine the wall clock also counts time not running
    fused_cpu_ns_per_byte: float = 0.0
    torch_flatnonzero_cpu_ns_per_byte: float = 0.0
    cast_diffengine_cpu_ns_per_byte: float = 0.0
    floor_ns_per_byte: float = 0.0  # the memory floor (bf16/fp16 rows; 0: not measured)

    @property
    def vs_flatnonzero(self) -> float:
        return self.torch_flatnonzero_ns_per_byte / self.fused_ns_per_byte

    @property
    def vs_diffengine(self) -> float:
        return self.cast_diffengine_ns_per_byte / self.fused_ns_per_byte

    @property
    def floor_vs_flatnonzero(self) -> float | None:
        """The most any pass moving these bytes could gain over the baseline here (None: no floor measured)."""
        return self.torch_flatnonzero_ns_per_byte / self.floor_ns_per_byte if self.floor_ns_per_byte else None


def _ints(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.int16).numpy()


@kernel
def _touch(src: np.ndarray, ref: np.ndarray, out: np.ndarray) -> None:
    """The one-pass cast's memory traffic with next to no arithmetic: read a 32-bit master and a 16-bit old value,
    write a 16-bit new one (its top half xor the old: both reads are used, so neither is optimized away)."""
    for i in range(src.shape[0]):
        out[i] = np.uint16(src[i] >> np.uint32(16)) ^ ref[i]


def _floor(
    pool: ThreadPoolExecutor, threads: int, srcs: list[np.ndarray], refs: list[np.ndarray], outs: list[np.ndarray]
) -> None:
    """`_touch` over every tensor, each split into ``threads`` slices run at once on ``pool``."""
    jobs = []
    for src, ref, out in zip(srcs, refs, outs, strict=True):
        cuts = np.linspace(0, src.size, threads + 1).astype(np.int64)
        jobs += [(src[a:b], ref[a:b], out[a:b]) for a, b in itertools.pairwise(cuts)]
    list(pool.map(lambda j: _touch(*j), jobs))


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
    srcs = [after[n].detach().reshape(-1).view(torch.int32).numpy().view(np.uint32) for n in names]
    refs = [prev_ints[n].view(np.uint16) for n in names]
    outs = [_ints(bufs[n]).view(np.uint16) for n in names]
    counts: dict[str, int] = {}
    with CastDiffer(threads) as caster, DiffEngine(threads) as engine, ThreadPoolExecutor(threads) as pool:

        def fused() -> None:
            counts["fused"] = sum(caster.cast_diff(n, after[n], dtype, prev[n], bufs[n])[1].size for n in names)

        def torch_flatnonzero() -> None:
            counts["torch"] = sum(np.flatnonzero(prev_ints[n] != _ints(after[n].to(dtype))).size for n in names)

        def cast_diffengine() -> None:
            counts["engine"] = sum(
                engine.changes(prev[n], cast_master(n, after[n], dtype, bufs[n])).size for n in names
            )

        def floor() -> None:
            _floor(pool, threads, srcs, refs, outs)

        best, cpu = _time_side_by_side([fused, torch_flatnonzero, cast_diffengine, floor], threads, repeat)
    if len(set(counts.values())) != 1:
        raise AssertionError(f"the methods found different numbers of changes: {counts}")
    elements = served // 2
    ns = [b / served * 1e9 for b in (*best[:3], *cpu[:3])]
    return FusedRow(
        fmt, threads, served, 100 * counts["fused"] / elements, *ns, floor_ns_per_byte=best[3] / served * 1e9
    )


def _time_side_by_side(methods: list[Callable[[], None]], threads: int, repeat: int) -> tuple[list[float], list[float]]:
    """Best wall and CPU seconds of each method over ``repeat`` interleaved rounds, on ``threads`` torch threads;
    one untimed round first (page faults of fresh buffers, kernels compiled)."""
    best, cpu = [float("inf")] * len(methods), [float("inf")] * len(methods)
    old_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for method in methods:
            method()
        for _ in range(repeat):
            for i, method in enumerate(methods):
                t0, c0 = time.perf_counter(), time.process_time()
                method()
                best[i] = min(best[i], time.perf_counter() - t0)
                cpu[i] = min(cpu[i], time.process_time() - c0)
    finally:
        torch.set_num_threads(old_threads)
    return best, cpu


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.reshape(-1)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]).numpy()


def measure_quantized(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], fmt: str, threads: int, repeat: int
) -> FusedRow:
    """A quantized format's whole served view and its changes (every component), the three ways: the
    publisher's fused pass (`Fuse`: payloads and plain casts in one pass, scales then diffed by the
    engine), `served_view` + ``np.flatnonzero`` per component, and `served_view` + `DiffEngine`."""
    prev = served_view(before, fmt)
    pieces = {k: Piece(t, 0, tuple(t.shape)) for k, t in prev.items()}
    prev_bits = {k: _bits(t) for k, t in prev.items()}
    served = sum(t.numel() * t.element_size() for t in prev.values())
    counts: dict[str, int] = {}
    with CastDiffer(threads) as caster, DiffEngine(threads) as engine:

        def fused() -> None:
            fuse = Fuse(caster, pieces)
            new = served_view(after, fmt, cast=fuse.hook(0), quantize=fuse.quantize)
            rest = [(prev[k], t) for k, t in new.items() if k not in fuse.found]
            counts["fused"] = sum(c.size for c in fuse.found.values()) + sum(c.size for c in engine.changes_many(rest))

        def view_flatnonzero() -> None:
            new = served_view(after, fmt)
            counts["torch"] = sum(np.flatnonzero(prev_bits[k] != _bits(t)).size for k, t in new.items())

        def view_diffengine() -> None:
            new = served_view(after, fmt)
            counts["engine"] = sum(c.size for c in engine.changes_many([(prev[k], t) for k, t in new.items()]))

        best, cpu = _time_side_by_side([fused, view_flatnonzero, view_diffengine], threads, repeat)
    if len(set(counts.values())) != 1:
        raise AssertionError(f"the methods found different numbers of changes: {counts}")
    values = sum(t.numel() for t in prev.values())
    ns = [b / served * 1e9 for b in (*best, *cpu)]
    return FusedRow(fmt, threads, served, 100 * counts["fused"] / values, *ns)


PHASES = ("view", "diff", "code", "publish")


def publish_phases(masters: dict[str, torch.Tensor], steps: int, threads: int) -> dict[str, dict[str, float]]:
    """ns per served byte of each publication phase, fused on and off, median over ``steps`` Adam steps."""
    adam = AdamSteps(masters, LR)
    store = open_store("memory://")
    never = KeyframePolicy(chain_fraction=1e9, max_interval=1 << 30)
    pubs = {
        on: Publisher(
            lambda: {k: p.detach() for k, p in adam.params.items()},
            store,
            run=f"fused-{'on' if on else 'off'}",
            format="bf16",
            config=PublisherConfig(background=False, spans=False, keyframe_policy=never, threads=threads),
        )
        for on in (True, False)
    }
    pubs[False].feed.fuse = False
    seen: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    served = 0
    try:
        adam.step()  # Adam's first step moves every weight by lr: publish the typical ones after it
        for pub in pubs.values():
            pub.step()
        for i in range(steps + 1):
            adam.step()
            for on in (True, False) if i % 2 == 0 else (False, True):
                pubs[on].step()
                published = pubs[on].flush()
                assert published is not None
                served = pubs[on].stats.view_bytes
                if i:  # the first one warms the buffers up
                    seen[on].append(dict(published.timings))
    finally:
        for pub in pubs.values():
            pub.close()
    out: dict[str, dict[str, float]] = {}
    for on, rows in seen.items():
        phases = {k: float(np.median([r[k] for r in rows])) / served * 1e9 for k in PHASES}
        out["fused" if on else "separate"] = phases | {"total": sum(phases.values())}
    return out


def run(
    console: Console, quick: bool = False, threads: tuple[int, ...] = (1, 2), shape: Shape | None = None
) -> dict[str, Any]:
    """Measure and print; returns the rows (``shape``: another size than QUICK / FULL, for tests)."""
    masters = llm_like_masters(shape or (QUICK if quick else FULL))
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
        for fmt in QUANTIZED:
            for n in threads:
                status.update(f"fused bench: {fmt}, {n} thread(s)")
                rows.append(measure_quantized(before, after, fmt, n, repeat=2 if quick else 3))
        status.update("fused bench: publications")
        phases = {n: publish_phases(masters, 3 if quick else 5, n) for n in threads}
    console.print(table(rows))
    console.print(phase_table(phases))
    return {
        "lr": LR,
        "rows": [
            asdict(r) | {"vs_flatnonzero": r.vs_flatnonzero, "floor_vs_flatnonzero": r.floor_vs_flatnonzero}
            for r in rows
        ],
        "publish_ns_per_byte": {str(n): p for n, p in phases.items()},
    }


def phase_table(phases: dict[int, dict[str, dict[str, float]]]) -> Table:
    t = Table(title="bf16 publication, ns per served byte by phase (inline publisher, median over steps)")
    for i, col in enumerate(("threads", "pass", *PHASES, "total")):
        t.add_column(col, justify="left" if i < 2 else "right")
    for n, by in phases.items():
        for name, p in by.items():
            t.add_row(str(n), name, *(f"{p[k]:.3f}" for k in (*PHASES, "total")))
    return t


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
        f"{r.fused_cpu_ns_per_byte:.2f} / {r.torch_flatnonzero_cpu_ns_per_byte:.2f} / "
        f"{r.cast_diffengine_cpu_ns_per_byte:.2f}",
        f"{r.floor_ns_per_byte:.3f}" if r.floor_ns_per_byte else "-",
        f"{r.floor_vs_flatnonzero:.2f}x" if r.floor_vs_flatnonzero else "-",
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
    "CPU ns/B: fused / flatnonzero / DiffEngine",
    "memory floor ns/B",
    "flatnonzero / floor",
)


def table(rows: list[FusedRow]) -> Table:
    t = Table(
        title=f"Served view + changes, per served byte: fused pass vs cast then compare (Adam lr {LR:g}; "
        "quantized rows: the whole view, baselines served_view + flatnonzero / DiffEngine)"
    )
    for i, col in enumerate(HEAD):
        t.add_column(col, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*_cells(r))
    return t


def markdown(result: dict[str, Any]) -> str:
    rows = [
        FusedRow(**{k: v for k, v in r.items() if k not in ("vs_flatnonzero", "floor_vs_flatnonzero")})
        for r in result["rows"]
    ]
    phases = [
        (n, name, *(f"{p[k]:.3f}" for k in (*PHASES, "total")))
        for n, by in result.get("publish_ns_per_byte", {}).items()
        for name, p in by.items()
    ]
    return (
        md_table(HEAD, [_cells(r) for r in rows])
        + "\n\nWhole BF16 publications (inline publisher, median over the steps), ns per served byte by phase; "
        + "*fused*: the one-pass cast, *separate*: the cast, then the diff:\n\n"
        + md_table(("threads", "pass", *PHASES, "total"), phases, left=2)
    )
