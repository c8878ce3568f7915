"""The crossregion benchmark's schedule: calibration runs, every (link, N, method) cell, the fitted model.

``run`` measures each cell ``Setup.repeats`` times with the methods interleaved, fits the cost model from
separate calibration runs, checks streaming on and off, extrapolates, and prints the tables.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich.console import Console

from flipsync.board.throttle import parse_bandwidth
from flipsync_apps.bench.crossregion.costs import CostModel, extrapolate, fit_line
from flipsync_apps.bench.crossregion.race import (
    CHUNK_BYTES,
    METHOD_LABEL,
    METHODS,
    UNLIMITED,
    Outcome,
    apply_seconds,
    load_seconds,
    run_method,
)
from flipsync_apps.bench.crossregion.render import tables
from flipsync_apps.bench.crossregion.trained import Trained

STREAM_CHECK = "20mbit"  # the link of the streaming on/off check: the wire outweighs the trainer there
CALIBRATION_RUNS = 3  # odd: each calibration median is one run's, so a single slow run cannot move it


@dataclass(frozen=True)
class Setup:
    elements: int
    replicas: tuple[int, ...]
    bandwidths: tuple[str, ...]
    repeats: int
    lr: float = 1e-6
    warmup: int = 2
    timeout_s: float = 300.0


QUICK = Setup(2 << 20, (1, 4), ("100mbit", "1gbit", "10gbit"), repeats=1)
FULL = Setup(16 << 20, (1, 4, 16), ("100mbit", "1gbit", "10gbit"), repeats=3)


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run(
    console: Console,
    quick: bool = False,
    *,
    setup: Setup | None = None,
    rates: Sequence[tuple[str, float, float]] = (),
) -> dict[str, Any]:
    """Measure every (link, N, method) cell ``setup.repeats`` times, fit the cost model, extrapolate.

    ``rates``: (source, changed fraction, bytes per change) for each 500 GB extrapolation (``bench all`` passes
    the codec section's BF16 lr 1e-6 row of every workload); by default this benchmark's own step.
    """
    setup = setup or (QUICK if quick else FULL)
    with console.status("crossregion bench: warm-up Adam steps"):
        tr = Trained(setup.elements, setup.lr, setup.warmup)
    console.print(
        f"served view {tr.view_bytes / 1e6:.1f} MB bf16, one Adam step at lr {setup.lr:g}: {tr.changed:,} values "
        f"changed ({100 * tr.changed / tr.elements:.2f}%), patch {len(tr.patch) / 1e3:.1f} kB "
        f"({len(tr.patch) / tr.changed:.3f} B/changed)"
    )
    runs: dict[tuple[str, int, str], list[Outcome]] = {}
    calibration: dict[str, list[Outcome]] = {m: [] for m in METHODS}
    with console.status("crossregion bench") as status:
        status.update("crossregion bench: calibration (unlimited link, N=1)")
        apply_s = apply_seconds(tr)
        load_s = load_seconds(tr)
        for _ in range(CALIBRATION_RUNS):
            for m in calibration:
                calibration[m].append(run_method(m, tr, 1, UNLIMITED, setup.timeout_s))
        # A second, smaller view separates the trainer's per-publication cost from its per-byte cost.
        status.update("crossregion bench: calibration, a view 1/8 the size")
        small = Trained(max(1 << 16, setup.elements // 8), setup.lr, setup.warmup)
        small_runs: dict[str, list[Outcome]] = {m: [] for m in ("patch", "full")}
        for _ in range(CALIBRATION_RUNS):
            for m in small_runs:
                small_runs[m].append(run_method(m, small, 1, UNLIMITED, setup.timeout_s))
        status.update(f"crossregion bench: streaming on and off, N=1, {STREAM_CHECK}")
        check_rate = parse_bandwidth(STREAM_CHECK)
        check: dict[bool, list[Outcome]] = {True: [], False: []}
        for _ in range(setup.repeats):
            for on in (True, False):
                check[on].append(run_method("patch", tr, 1, check_rate, setup.timeout_s, stream=on))
        for bw in setup.bandwidths:
            rate = parse_bandwidth(bw)
            for n in setup.replicas:
                for rep in range(setup.repeats):
                    for m in METHODS:  # interleaved, so load from elsewhere hits every method alike
                        status.update(f"crossregion bench: {bw}, N={n}, {METHOD_LABEL[m]}, run {rep + 1}")
                        runs.setdefault((bw, n, m), []).append(run_method(m, tr, n, rate, setup.timeout_s))
    cal_patch = statistics.median(o.seconds - o.publish_s for o in calibration["patch"])
    cal_relay = statistics.median(o.seconds - o.publish_s for o in calibration["relay"])
    one = [o for (_, n, m), os_ in runs.items() if n == 1 and m == "patch" for o in os_] + calibration["patch"]
    one_full = [o for (_, n, m), os_ in runs.items() if n == 1 and m == "full" for o in os_] + calibration["full"]
    trainer_patch = fit_line(
        (small.view_bytes, statistics.median(o.publish_s for o in small_runs["patch"])),
        (tr.view_bytes, statistics.median(o.publish_s for o in one)),
    )
    trainer_full = fit_line(
        (small.view_bytes, statistics.median(o.publish_s for o in small_runs["full"])),
        (tr.view_bytes, statistics.median(o.publish_s for o in one_full)),
    )
    model = CostModel(
        trainer_patch_s_per_byte=trainer_patch[1],
        trainer_full_s_per_byte=trainer_full[1],
        trainer_patch_fixed_s=trainer_patch[0],
        trainer_full_fixed_s=trainer_full[0],
        receiver_s_per_change=apply_s / tr.changed,
        receiver_full_s_per_byte=load_s / tr.view_bytes,
        fixed_s=max(0.0, cal_patch - apply_s),
        relay_fixed_s=max(0.0, cal_relay - apply_s),
        cores=os.cpu_count() or 1,
    )
    rows = []
    for bw in setup.bandwidths:
        rate = parse_bandwidth(bw)
        for n in setup.replicas:
            row: dict[str, Any] = {"bandwidth": bw, "bytes_per_s": rate, "replicas": n}
            for m in METHODS:
                os_ = runs[(bw, n, m)]
                row[m] = _stats([o.seconds for o in os_])
                row[m]["runs"] = [o.seconds for o in os_]
                row[m]["model"] = model.predict(
                    m, n, rate, tr.view_bytes, tr.changed, len(tr.patch), chunk_bytes=CHUNK_BYTES
                )
                row[m]["wan_bytes"] = statistics.median(o.wan_bytes for o in os_)
                row[m]["publish_s"] = statistics.median(o.publish_s for o in os_)
            row["bitwise"] = all(o.bitwise for m in METHODS for o in runs[(bw, n, m)])
            rows.append(row)
    streaming: dict[str, Any] = {"bandwidth": STREAM_CHECK, "chunk_bytes": CHUNK_BYTES}
    for on, label in ((True, "streamed"), (False, "whole")):
        streaming[label] = _stats([o.seconds for o in check[on]])
        streaming[label]["bitwise"] = all(o.bitwise for o in check[on])
        streaming[label]["model"] = model.predict(
            "patch", 1, check_rate, tr.view_bytes, tr.changed, len(tr.patch), chunk_bytes=CHUNK_BYTES if on else None
        )
    rates = rates or [("this benchmark's own step", tr.changed / tr.elements, len(tr.patch) / tr.changed)]
    result: dict[str, Any] = {
        "setup": asdict(setup),
        "elements": tr.elements,
        "view_bytes": tr.view_bytes,
        "changed": tr.changed,
        "patch_bytes": len(tr.patch),
        "bytes_per_changed": len(tr.patch) / tr.changed,
        "published_bytes": statistics.median(o.published_bytes for o in one),
        "apply_s": apply_s,
        "load_s": load_s,
        "calibration": {m: [o.seconds for o in os_] for m, os_ in calibration.items()},
        "calibration_small": {
            "view_bytes": small.view_bytes,
            **{m: [o.publish_s for o in os_] for m, os_ in small_runs.items()},
        },
        "model": asdict(model),
        "trainer_phases": _phases_per_byte(one, tr.view_bytes),
        "rows": rows,
        "streaming": streaming,
        "extrapolations": [extrapolate(model, setup.bandwidths, frac, bpc, src) for src, frac, bpc in rates],
    }
    for t in tables(result):
        console.print(t)
    return result


def _phases_per_byte(outcomes: Sequence[Outcome], view_bytes: int) -> dict[str, float]:
    """The trainer publisher's own account of where a patch's time went (medians), in seconds per view byte."""
    timed = [o.phases for o in outcomes if o.phases]
    keys = timed[0].keys() if timed else ()
    return {k: statistics.median(t[k] for t in timed) / view_bytes for k in keys}
