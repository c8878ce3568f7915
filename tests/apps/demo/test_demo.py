"""The main job, short: a real RL run whose rollouts come from two flipsync islands and a control island that
reloads full checkpoints, all behind the same throttled link.

Asserts what the demo promises: every flipsync island ends bitwise equal to the trainer's final served view,
every version was verified on every flipsync island, the control island's lag and bytes are measured and
reported beside the flipsync islands', rewards came from real generations tagged with trainer steps, and
the saved master checkpoints work with the README's `flipsync view/diff/apply/inspect/analyze` lines.
(The default-size run, where the reward visibly rises, is too long for CI; its figures are in the report.)
"""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from flipsync.cli.main import app
from flipsync_apps.demo.outputs import write_outputs
from flipsync_apps.demo.records import CONTROL
from flipsync_apps.demo.summary import summary_lines
from tests.apps.demo.demo_helpers import check_rollout_mode, run_short_demo

FLIPSYNC = ("island-0", "island-1")


def test_short_demo_run(tmp_path: Path) -> None:
    # the default rollout mode (inflight), with no hard cap on staleness: nothing may be dropped
    report = run_short_demo(tmp_path, islands=2, max_staleness=None)
    check_rollout_mode(report, "inflight")
    assert report.bitwise_equal == dict.fromkeys(FLIPSYNC, True)
    final = report.versions[-1].version
    assert final >= 1 and all(report.audits[n]["version"] == final for n in FLIPSYNC)
    assert [r.version for r in report.versions] == list(range(len(report.versions)))
    for row in report.versions:
        assert set(row.verified) == set(FLIPSYNC) and all(row.verified.values())
        assert all(s >= 0 for s in row.applied_s.values())
    patches = [r for r in report.versions if r.version > 0]
    # a step whose rollouts all score alike has zero advantages, hence (at Adam's first step) no change at all
    assert all(0 <= r.changed < r.served_values and r.patch_bytes < r.checkpoint_bytes for r in patches)
    assert any(r.changed > 0 for r in patches)
    assert report.versions[-1].step == 3  # the last version covers the last trainer step

    assert [s.step for s in report.steps] == [1, 2, 3]
    for s in report.steps:
        assert s.rollouts == 9 and 0.0 <= s.reward <= 1.0
        assert set(s.islands) == {*FLIPSYNC, CONTROL}
        for isl in s.islands.values():
            assert 0 <= isl.behind < s.step and isl.dropped >= 0
    # the control island downloaded at least the first full checkpoint through its link; flipsync islands
    # read the keyframe v0 and patches
    last = report.steps[-1].islands
    assert last[CONTROL].bytes >= report.checkpoint_bytes
    assert all(last[n].bytes >= report.checkpoint_bytes for n in FLIPSYNC)
    summary = report.summary
    assert set(summary["lag_steps"]) == {*FLIPSYNC, CONTROL} and summary["bytes_ratio"] > 0
    lines = summary_lines(report)
    assert any("full-checkpoint island" in ln and "MB" in ln for ln in lines)
    assert any(ln.startswith("lag (trainer steps") and "full-checkpoint island" in ln for ln in lines)

    paths = write_outputs(report, tmp_path)
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["bitwise_equal"] == dict.fromkeys(FLIPSYNC, True)
    assert "bytes_ratio" in doc["summary"] and doc["lag_samples"]
    assert all(p.exists() and p.stat().st_size > 1000 for p in paths)
    assert (tmp_path / "lag_over_time.png") in paths and (tmp_path / "staleness.png") in paths

    # the saved masters: steps 0, 1 and the last, as the README's examples use them
    masters = sorted(Path(p).name for p in report.masters)
    assert masters == ["step-0000.safetensors", "step-0001.safetensors", "step-0003.safetensors"]
    m0, m1 = (tmp_path / "masters" / m for m in masters[:2])
    runner = CliRunner(env={"COLUMNS": "200"})
    for args in (
        ["view", m1, "--format", "bf16", "-o", tmp_path / "v1.safetensors"],
        ["view", m0, "--format", "BF16", "-o", tmp_path / "v0.safetensors"],
        ["diff", m0, m1, "--format", "bf16", "-o", tmp_path / "p01.safetensors"],
        ["apply", tmp_path / "v0.safetensors", tmp_path / "p01.safetensors", "-o", tmp_path / "v1b.safetensors"],
        ["inspect", tmp_path / "p01.safetensors"],
        ["analyze", m0, m1, "--formats", "bf16,fp8-block", "-o", tmp_path / "analysis"],
    ):
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, (args, result.output)
    from flipsync.checkpoint import load_checkpoint
    from flipsync.codec.bits import int_view

    got, want = load_checkpoint(tmp_path / "v1b.safetensors"), load_checkpoint(tmp_path / "v1.safetensors")
    assert set(got) == set(want) and all(int_view(got[k]).equal(int_view(want[k])) for k in want)


def test_short_demo_on_a_mixture_of_experts(tmp_path: Path) -> None:
    """``--model moe-2m``: a Qwen3-MoE-shaped policy on the torch engine; the report gives the share of each
    expert's served values that change per version beside the dense layers' and the routers'."""
    report = run_short_demo(tmp_path, islands=1, control=False, model="moe-2m")
    assert report.bitwise_equal == {"island-0": True}
    experts = report.summary["experts"]
    assert experts["experts"] == 8 and len(experts["per_expert_pct"]) == 8
    assert experts["versions"] == len(report.versions) - 1  # every patch, not the keyframe
    assert all(0 <= p <= 100 for p in experts["per_expert_pct"]) and 0 <= experts["dense_pct"] <= 100
    assert experts["router_pct"] is not None
    patches = [r for r in report.versions if r.version > 0]
    if any(r.changed for r in patches):
        assert experts["experts_pct"] > 0 or experts["dense_pct"] > 0
    assert any(ln.startswith("MoE: served values changed per version") for ln in summary_lines(report))


def test_short_demo_under_muon(tmp_path: Path) -> None:
    """The same run with Muon on the hidden matrices: the islands still end bitwise equal, and the report says
    which optimizer moved the weights, so two runs can be put side by side (``flipsync demo --compare``). It runs
    in ``sync`` rollout mode (docs/async.md): on-policy only, every token at staleness 0, the control island's too."""
    from flipsync_apps.demo.summary import comparison

    report = run_short_demo(tmp_path, islands=1, optimizer="muon", rollout="sync", max_staleness=None)
    check_rollout_mode(report, "sync")
    assert report.bitwise_equal == {"island-0": True}
    assert report.config["optimizer"] == "muon" and report.summary["optimizer"] == "muon"
    assert any(r.changed > 0 for r in report.versions if r.version > 0)
    lines = summary_lines(report)
    assert any("muon, lr" in ln for ln in lines)
    assert (tmp_path / "staleness.png") in write_outputs(report, tmp_path)
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["config"]["optimizer"] == "muon"
    table = comparison([("adam", {**doc, "config": {**doc["config"], "optimizer": "adam"}}), ("muon", doc)])
    assert table.row_count > 10
