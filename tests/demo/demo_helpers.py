"""What the demo tests share: the demo cut short enough for CI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from flipsync.demo.run import DemoConfig, DemoReport, run_demo


def run_short_demo(out: Path, **over: Any) -> DemoReport:
    """The 1M-parameter model, 3 RL steps of 3 prompts x 3 samples, behind a 200 Mbit/s link; ``over`` changes
    any other `DemoConfig` field (the engine, the number of islands)."""
    settings: dict[str, Any] = dict(
        model="llama-1m",
        steps=3,
        warm_start_steps=20,
        prompts_per_step=3,
        group_size=3,
        lr=1e-5,
        max_staleness=3,  # the loaded CI machine may be slow to start; these tests check plumbing, not lag
        bandwidth="200mbit",
        out=out,
    )
    cfg = DemoConfig(**{**settings, **over})
    return run_demo(cfg, Console(width=200, record=True))
