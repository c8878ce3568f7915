"""Absorption analysis: the rule predicts the measured change; the CLI writes tables, JSON and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flipsync.analyze import compare, grid_spacing, simulate
from flipsync.checkpoint import save_checkpoint
from flipsync.cli import app
from flipsync.synthetic import Shape, llm_like_masters

SMALL = Shape(hidden=128, intermediate=256, layers=1, vocab=512)


def test_bf16_spacing_is_one_ulp() -> None:
    w = torch.tensor([1.0, 1.5, -3.0, 2.0**-130, 0.0])
    s = grid_spacing({"x.weight": w}, "bf16")["x.weight"]
    assert s.tolist() == [2.0**-7, 2.0**-7, 2.0**-6, 2.0**-133, 2.0**-133]


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block", "mxfp4"])
def test_absorption_rule_predicts_the_measured_change(fmt: str) -> None:
    result = simulate(llm_like_masters(SMALL), [fmt], lr=1e-6)
    (s,) = result.formats
    assert s.changed_fraction > 0
    assert s.predicted_fraction == pytest.approx(s.changed_fraction, rel=0.2)
    # smaller weights have a finer grid, so they change more often
    fractions = [b[1] for b in s.by_bucket if b[2] > 1000]
    assert fractions[0] > fractions[-1]


def test_identical_checkpoints_change_nothing() -> None:
    m = llm_like_masters(SMALL)
    result = compare(m, m, ["bf16", "nvfp4"])
    assert all(s.changed_fraction == 0 for s in result.formats)


def test_analyze_cli_writes_report_and_plots(tmp_path: Path) -> None:
    m = llm_like_masters(SMALL)
    save_checkpoint(m, tmp_path / "a.safetensors")
    save_checkpoint({k: v + 1e-4 * torch.randn_like(v) for k, v in m.items()}, tmp_path / "b.safetensors")
    runner = CliRunner(env={"COLUMNS": "160"})
    for args in (["a.safetensors"], ["a.safetensors", "b.safetensors"]):
        out = tmp_path / f"out{len(args)}"
        paths = [str(tmp_path / a) for a in args]
        result = runner.invoke(app, ["analyze", *paths, "--formats", "bf16,fp8-tensor", "-o", str(out)])
        assert result.exit_code == 0, result.output
        report = json.loads((out / "analysis.json").read_text())
        assert {f["format"] for f in report["formats"]} == {"bf16", "fp8-tensor"}
        assert (out / "change_per_tensor.png").stat().st_size > 1000
        assert (out / "change_vs_magnitude.png").stat().st_size > 1000
        text = " ".join(result.output.split())
        if len(args) == 1:  # simulated: the bracketed numbers are the rule's predictions, and say so
            assert "% changed (predicted)" in text and "in brackets: % predicted" in text
        else:
            assert "(predicted)" not in text


def test_short_tensor_names_for_plot_labels() -> None:
    from flipsync.analyze import short_name

    assert short_name("model.layers.3.self_attn.q_proj.weight") == "3.attn.q_proj"
    assert short_name("model.layers.0.post_attention_layernorm.weight") == "0.post_attn_norm"
    assert short_name("lm_head.weight") == "lm_head"
