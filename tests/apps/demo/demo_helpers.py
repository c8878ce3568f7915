"""What the demo tests share: the demo cut short enough for CI."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from flipsync_apps.demo.records import CONTROL, DemoConfig, DemoReport
from flipsync_apps.demo.run import run_demo
from flipsync_apps.demo.summary import summary_lines


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


def check_rollout_mode(report: DemoReport, mode: str) -> None:
    """What a run in rollout ``mode`` reports (docs/async.md): every mode its figures, the per-token log-probs that
    reached the trainer, nothing dropped without a hard cap; ``sync`` trains on-policy only (every token at
    staleness 0, the control island's too: it waits for its checkpoint). Its staleness plot is the caller's to
    check, among the outputs it writes anyway."""
    assert all(report.bitwise_equal.values())
    r = report.summary["rollout"]
    assert r["mode"] == mode and r["generated"] >= 9 * 3
    assert r["dropped_total"] == 0, (r["dropped"], report.rollout_errors)
    assert r["tokens_per_s"] > 0 and all(v >= 0 for v in r["idle_s"].values())
    assert set(r["idle_s"]) == {*report.bitwise_equal, CONTROL}
    for rec in report.steps:
        assert rec.rollouts == 9 and rec.tokens > 0
        assert sum(rec.staleness.values()) == rec.tokens == sum(rec.staleness_response.values())
        assert 0.0 < rec.weight_mean <= 2.0 and rec.kl_k2 >= 0.0
    if mode == "sync":
        assert all(set(rec.staleness) == {0} for rec in report.steps)
    # the engine's log-probs line up with the text for most completions: a systematic misalignment breaks every
    # one; a barely trained policy samples ids outside the byte range (no text) in a few (CI: 4 of 27)
    assert 2 * r["unaligned"] < r["generated"], (r["unaligned"], r["generated"])
    assert any(ln.startswith(f"rollout mode {mode}:") for ln in summary_lines(report))


def _processes() -> dict[int, tuple[int, str]]:
    """Every live process of this machine: pid -> (parent pid, command line)."""
    out: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if fields[0] == b"Z":  # a zombie has exited; only its parent's wait is due
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        out[int(entry)] = (int(fields[1]), cmd)
    return out


def descendants() -> set[int]:
    """The live processes this one started, at any depth."""
    procs = _processes()
    found: set[int] = set()
    frontier = {os.getpid()}
    while frontier:
        frontier = {pid for pid, (ppid, _) in procs.items() if ppid in frontier} - found
        found |= frontier
    return found


# multiprocessing's own helper of this process (it lives as long as this process does), not something a run started
_MP_HELPERS = re.compile(r"multiprocessing\.(resource_tracker|forkserver) import main")


def left_behind(run_dir: Path, before: set[int], timeout_s: float = 30.0) -> list[str]:
    """What a finished run left running: processes whose command line names its folder (a vLLM server is
    re-parented away once its island dies) and processes this one started since ``before`` (its islands,
    gateway and their children). Waits up to ``timeout_s`` for what is still exiting."""
    deadline = time.monotonic() + timeout_s
    while True:
        procs = _processes()
        mine = descendants() - before
        left = [
            f"{pid}: {cmd[:200]}"
            for pid, (_, cmd) in procs.items()
            if (str(run_dir) in cmd or pid in mine) and pid != os.getpid() and not _MP_HELPERS.search(cmd)
        ]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)
