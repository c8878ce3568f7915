"""The demo's table tells the truth about *applied*: a version waits only for the flipsync islands following
the board when it was published; a joiner counts once it has caught up (its catch-up is an event of its own,
not the applied time of the versions it replays); an island killed stops counting at its death. A synthetic
run (no processes): two islands, island-2 joins after v2 and catches up at v4, island-1 is killed after v5."""

from __future__ import annotations

import threading
from io import StringIO
from types import SimpleNamespace

from rich.console import Console

from flipsync_apps.demo.monitor import Following, StepTable, applied_cell
from flipsync_apps.demo.records import DemoConfig, IslandStep, StepRecord, VersionRow


class SyntheticRun:
    """Feeds `Following` and the version rows the events the monitor would see, in order."""

    def __init__(self) -> None:
        self.following = Following(["island-0", "island-1"], t0=0.0)
        self.rows: dict[int, VersionRow] = {}
        self.seen: dict[int, float] = {}
        self.lock = threading.Lock()

    def publish(self, v: int, t: float) -> None:
        row = VersionRow(v, 1, v, 10, 1000, 100, 2000)
        row.followers = self.following.followers()
        self.rows[v], self.seen[v] = row, t

    def commit(self, name: str, held: int, t: float) -> None:
        """What `Monitor._island_loop` does when an island reports it holds ``held``."""
        for v, row in self.rows.items():
            if v <= held and name in row.followers and name not in row.applied_s:
                row.applied_s[name] = t - self.seen[v]
        self.following.committed(name, held, max(self.rows), t)

    def cell(self, v: int) -> str:
        return applied_cell(*self.following.applied(self.rows[v]))


def synthetic_run() -> SyntheticRun:
    run = SyntheticRun()
    run.publish(0, 0.0)
    for name in ("island-0", "island-1"):
        run.commit(name, 0, 0.1)
    run.publish(1, 10.0)
    run.commit("island-0", 1, 10.3)
    run.commit("island-1", 1, 10.5)
    run.publish(2, 20.0)
    run.commit("island-0", 2, 20.2)
    run.following.joined("island-2", 21.0)  # boots, then replays v0..v3 from the board
    run.commit("island-1", 2, 20.4)
    run.publish(3, 30.0)
    run.commit("island-0", 3, 30.2)
    run.commit("island-2", 2, 31.0)  # still behind HEAD (v3): catching up, not following
    run.commit("island-1", 3, 30.6)
    run.publish(4, 40.0)
    run.commit("island-2", 4, 40.1)  # reaches HEAD v4: follows from now on
    run.commit("island-0", 4, 40.3)
    run.commit("island-1", 4, 40.9)
    run.publish(5, 50.0)
    for name, t in (("island-0", 50.2), ("island-2", 50.4), ("island-1", 50.7)):
        run.commit(name, 5, t)
    run.publish(6, 60.0)
    run.commit("island-0", 6, 60.2)
    run.following.leave("island-1", 60.5)  # SIGKILLed before it committed v6
    run.commit("island-2", 6, 60.3)
    run.publish(7, 70.0)  # after the death: waits for island-0 and island-2 only
    run.commit("island-0", 7, 70.4)
    run.publish(8, 80.0)  # island-2 has not committed it yet
    run.commit("island-0", 8, 80.1)
    return run


def test_every_row_counts_its_followers_only() -> None:
    run = synthetic_run()
    assert {v: r.followers for v, r in run.rows.items()} == {
        0: ["island-0", "island-1"],
        1: ["island-0", "island-1"],
        2: ["island-0", "island-1"],
        3: ["island-0", "island-1"],  # island-2 joined at 21 s but had not caught up when v3 appeared
        4: ["island-0", "island-1"],  # nor when v4 appeared: it reached v4 after
        5: ["island-0", "island-1", "island-2"],
        6: ["island-0", "island-1", "island-2"],
        7: ["island-0", "island-2"],  # island-1 was dead when v7 appeared
        8: ["island-0", "island-2"],
    }
    # the joiner's replay of v1..v4 is not their applied time (it was 30 s late for v1)
    assert all("island-2" not in run.rows[v].applied_s for v in range(5))
    assert [run.cell(v) for v in range(9)] == [
        "0.10",
        "0.50",
        "0.40",
        "0.60",
        "0.90",
        "0.70",
        "0.30",  # island-1 died before committing v6: the two that remain took at most 0.3 s
        "…",  # island-2 has not committed v7
        "…",
    ]
    run.commit("island-2", 8, 80.5)
    assert [run.cell(v) for v in (7, 8)] == ["10.50", "0.50"]  # island-2 took 10.5 s for v7 (one commit for v7, v8)
    # the catch-up is its own event
    assert run.following.events == [
        {"island": "island-2", "joined_t": 21.0, "t": 40.1, "catch_up_s": 40.1 - 21.0, "version": 4}
    ]


def test_no_follower_left() -> None:
    following = Following(["island-0"])
    row = VersionRow(1, 1, 1, 0, 10, 10, 10)
    row.followers = following.followers()
    following.leave("island-0", 5.0)
    assert following.applied(row) == (None, True) and applied_cell(None, True) == "-"
    assert Following([]).followers() == []


def test_the_table_shows_every_row() -> None:
    run = synthetic_run()
    names = ["island-0", "island-1", "island-2"]
    table = StepTable(
        DemoConfig(), "run-x", names, SimpleNamespace(lock=run.lock, rows=run.rows, following=run.following)
    )  # type: ignore[arg-type]
    table.records = [
        StepRecord(step, 0.5, 9, {n: IslandStep(0, 3, 0, None, 10**6) for n in names[:2]}) for step in range(1, 9)
    ]
    console = Console(file=StringIO(), width=250, record=True)
    console.print(table.render())
    lines = {ln.split("│")[1].strip(): ln for ln in console.export_text().splitlines() if ln.count("│") > 5}
    want = {1: "0.50", 2: "0.40", 3: "0.60", 4: "0.90", 5: "0.70", 6: "0.30", 7: "…", 8: "…"}
    for step, cell in want.items():
        cells = [c.strip() for c in lines[str(step)].split("│")]
        assert cells[2] == "0.500" and cells[3] == f"v{step}" and cells[7] == cell, lines[str(step)]
