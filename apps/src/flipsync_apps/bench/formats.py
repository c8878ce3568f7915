"""``flipsync bench formats``: what each extra served format costs a trainer that publishes several.

The same synthetic masters (`flipsync_apps.synthetic`, Adam at lr 1e-6) are published by inline
`MultiFormatPublisher`s (``background=False``, so a step's whole publication is timed; no spans or
keyframes) of one, two and three formats, to one in-memory board, stepping in turns after every Adam step
(the order rotates, so load from elsewhere hits all alike). The table gives the median seconds per step,
the extra over BF16 alone, and the bytes each format's patch took.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from flipsync.board import KeyframePolicy, open_store
from flipsync.trainer import MultiFormatPublisher, PublisherConfig
from flipsync_apps.bench.report import md_table
from flipsync_apps.bench.workload import FULL, QUICK, AdamSteps, llm_like_masters

LR = 1e-6
SETS = (("bf16",), ("bf16", "fp8-block"), ("bf16", "fp8-block", "nvfp4"))


def run(console: Console, quick: bool = False, steps: int | None = None) -> dict[str, Any]:
    masters = llm_like_masters(QUICK if quick else FULL)
    master_bytes = sum(t.numel() * t.element_size() for t in masters.values())
    adam = AdamSteps(masters, LR)
    store = open_store("memory://")
    never = KeyframePolicy(chain_fraction=1e9, max_interval=1 << 30)
    config = PublisherConfig(background=False, spans=False, keyframe_policy=never)
    n = steps or (3 if quick else 6)
    adam.step()  # Adam's first step moves every weight by lr: time the typical ones after it
    source = lambda: {k: p.detach() for k, p in adam.params.items()}  # noqa: E731
    pubs = [MultiFormatPublisher(source, store, s, run=f"formats-{len(s)}", config=config) for s in SETS]
    seconds: list[list[float]] = [[] for _ in SETS]
    patch_bytes: dict[str, list[int]] = {}
    try:
        with console.status("formats bench"):
            for i in range(n + 1):
                adam.step()
                order = list(range(len(SETS)))
                order = order[i % len(order) :] + order[: i % len(order)]
                for k in order:
                    t0 = time.perf_counter()
                    pubs[k].step()
                    last = pubs[k].flush()
                    if i:  # the first one warms the buffers up
                        seconds[k].append(time.perf_counter() - t0)
                        if k == len(SETS) - 1:
                            for fmt, p in last.items():
                                assert p is not None
                                patch_bytes.setdefault(fmt, []).append(p.part_bytes)
    finally:
        for p in pubs:
            p.close()
    rows = []
    base = statistics.median(seconds[0])
    for s, secs in zip(SETS, seconds, strict=True):
        med = statistics.median(secs)
        rows.append(
            {
                "formats": list(s),
                "step_s": med,
                "ns_per_master_byte": med / master_bytes * 1e9,
                "extra_s": med - base,
                "vs_bf16": med / base,
            }
        )
    result = {
        "lr": LR,
        "master_bytes": master_bytes,
        "steps": n,
        "rows": rows,
        "patch_bytes": {f: statistics.median(b) for f, b in patch_bytes.items()},
    }
    console.print(table(result))
    return result


def table(result: dict[str, Any]) -> Table:
    t = Table(title=f"publishing several served formats ({result['master_bytes'] / 1e6:.0f} MB of FP32 masters)")
    for i, col in enumerate(("formats", "s per step", "ns per master byte", "extra over bf16", "x bf16")):
        t.add_column(col, justify="left" if i == 0 else "right")
    for r in result["rows"]:
        t.add_row(
            " + ".join(r["formats"]),
            f"{r['step_s']:.3f}",
            f"{r['ns_per_master_byte']:.2f}",
            f"{r['extra_s']:+.3f} s",
            f"{r['vs_bf16']:.2f}",
        )
    return t


def markdown(result: dict[str, Any]) -> str:
    rows = [
        (
            " + ".join(r["formats"]),
            f"{r['step_s']:.3f}",
            f"{r['ns_per_master_byte']:.2f}",
            f"{r['extra_s']:+.3f} s",
            f"{r['vs_bf16']:.2f}",
        )
        for r in result["rows"]
    ]
    sizes = ", ".join(f"{f} {b / 1e3:.0f} kB" for f, b in result["patch_bytes"].items())
    return (
        "Inline `MultiFormatPublisher`s of one, two and three formats publish the same masters "
        f"({result['master_bytes'] / 1e6:.0f} MB FP32, Adam at lr {result['lr']:g}) to one in-memory board, "
        f"in turns after each of {result['steps']} Adam steps; median seconds per step's whole publication "
        "(views, diffs, coding, upload).\n\n"
        + md_table(("formats", "s per step", "ns per master byte", "extra over bf16", "x bf16"), rows)
        + f"\n\nMedian patch per format: {sizes}.\n"
    )
