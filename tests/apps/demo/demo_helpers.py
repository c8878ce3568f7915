"""What the demo tests share: the demo cut short enough for CI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from flipsync_apps.demo.records import DemoConfig, DemoReport
from flipsync_apps.demo.run import run_demo


def run_short_demo(out: Path, **over: Any) -> DemoReport:
    """The 1M-parameter model, 3 RL steps of 3 prompts x 3 samples, behind a 200 Mbit/s link, islands reached
    directly (no fleet: tests/apps/demo/test_demo_fleet.py runs the gateway, a join and a kill); ``over`` changes
    any `DemoConfig` field (the engine, the number of islands, the steps, the fleet)."""
    defaults: dict[str, Any] = {
        "model": "llama-1m",
        "steps": 3,
        "warm_start_steps": 20,
        "prompts_per_step": 3,
        "group_size": 3,
        "lr": 1e-5,
        "max_staleness": 3,  # the loaded CI machine may be slow to start; these tests check plumbing, not lag
        "bandwidth": "200mbit",
        "out": out,
        "fleet": False,
    }
    cfg = DemoConfig(**{**defaults, **over})
    return run_demo(cfg, Console(width=200, record=True))
