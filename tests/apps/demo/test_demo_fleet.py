"""The main job through the fleet: the demo's rollouts go through a gateway; a third island joins mid-run and
enters rotation once caught up; island-1 is SIGKILLed mid-run and the run goes on with no failed rollout.
The report and the plots record the joins, the leave and the readiness. No control island here: every batch
must come through the gateway, so the fleet alone carries the run after the kill (a control island's fresh
checkpoints could fill the batches while a starved CI machine leaves the flipsync islands behind)."""

from __future__ import annotations

import json
from pathlib import Path

from flipsync_apps.demo.fleet import fleet_lines
from flipsync_apps.demo.outputs import write_outputs
from tests.apps.demo.demo_helpers import descendants, left_behind, run_short_demo


def test_demo_through_the_gateway_with_a_join_and_a_kill(tmp_path: Path) -> None:
    before = descendants()
    report = run_short_demo(
        tmp_path, islands=2, steps=8, fleet=True, join_step=1, kill_step=4, control=False, max_staleness=1
    )
    assert not left_behind(tmp_path, before)  # the islands, the killed one's engine included, and the gateway
    fleet = report.fleet
    assert report.failed_rollouts == 0
    events = {(e["kind"], e["island"]): e for e in fleet["events"]}
    assert set(events) >= {("join", "island-2"), ("up", "island-2"), ("ready", "island-2")}
    assert {("kill", "island-1"), ("left", "island-1")} <= set(events)
    assert events[("join", "island-2")]["step"] == 1 and events[("kill", "island-1")]["step"] == 4
    ready = events[("ready", "island-2")]
    assert ready["time_to_ready_s"] == fleet["time_to_ready_s"] > 0
    assert events[("left", "island-1")]["t"] > events[("kill", "island-1")]["t"]
    assert fleet["killed"] == ["island-1"]
    # The islands alive at the end hold the trainer's final view bit for bit, the joined one included.
    assert report.bitwise_equal == {"island-0": True, "island-2": True}
    assert set(report.audits) == {"island-0", "island-2"}
    # Every step got its whole batch, after the kill too. At most one step stale, steps 7 and 8 take only weights
    # of step 5 or later, which island-1 (killed after step 4) never held: the live islands served those batches.
    assert [rec.rollouts for rec in report.steps] == [9] * 8
    for rec in report.steps[6:]:
        assert sum(rec.islands[name].used for name in ("island-0", "island-2") if name in rec.islands) == 9
    samples = fleet["samples"]
    assert samples and all(s["readiness"] is None or 0 <= s["readiness"] <= 1 for s in samples)
    assert any("island-2" in s["ready"] for s in samples) and any("island-1" in s["ready"] for s in samples)
    assert not any("island-1" in s["members"] for s in samples if s["t"] > events[("left", "island-1")]["t"])
    lines = fleet_lines(fleet, report.failed_rollouts)
    assert "island-2 joined at step 1 and entered rotation" in lines[0] and "failed rollouts: 0" in lines[0]

    paths = write_outputs(report, tmp_path)
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["failed_rollouts"] == 0 and doc["fleet"]["events"] and doc["fleet"]["samples"]
    assert (tmp_path / "fleet.png") in paths and (tmp_path / "fleet.png").stat().st_size > 1000
