"""Absorption analysis: the rule predicts the measured change; the CLI writes tables, JSON and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flipsync.checkpoint import save_checkpoint
from flipsync.cli.main import app
from flipsync_apps.analyze import compare, grid_spacing, simulate
from flipsync_apps.synthetic import Shape, llm_like_masters

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
    from flipsync_apps.analyze import short_name

    assert short_name("model.layers.3.self_attn.q_proj.weight") == "3.attn.q_proj"
    assert short_name("model.layers.0.post_attention_layernorm.weight") == "0.post_attn_norm"
    assert short_name("lm_head.weight") == "lm_head"


# -- optimizers ---------------------------------------------------------------------------------------------


def test_optimizers_are_the_torch_ones_muon_on_hidden_matrices_only() -> None:
    from flipsync_apps.synthetic import Combined, OptimizerSpec, ParamGroup, build_optimizer, tensor_kind

    m = llm_like_masters(SMALL)
    params = [(k, torch.nn.Parameter(v.clone())) for k, v in m.items()]
    assert isinstance(build_optimizer([ParamGroup(params, 1e-3)], OptimizerSpec("adam")), torch.optim.Adam)
    assert isinstance(build_optimizer([ParamGroup(params, 1e-3)], OptimizerSpec("sgd")), torch.optim.SGD)
    adamw = build_optimizer([ParamGroup(params, 1e-3)], OptimizerSpec("adamw", weight_decay=0.1))
    assert isinstance(adamw, torch.optim.AdamW) and adamw.param_groups[0]["weight_decay"] == 0.1
    muon = build_optimizer([ParamGroup(params, 1e-3)], OptimizerSpec("muon", muon_lr_scaling="original"))
    assert isinstance(muon, Combined)
    part_muon, part_adamw = muon.parts
    assert isinstance(part_muon, torch.optim.Muon) and isinstance(part_adamw, torch.optim.AdamW)
    assert part_muon.param_groups[0]["adjust_lr_fn"] == "original"
    names = {id(p): n for n, p in params}
    on_muon = {names[id(p)] for g in part_muon.param_groups for p in g["params"]}
    assert on_muon == {n for n, p in params if tensor_kind(n, p.shape) == "matrix"}
    assert "model.embed_tokens.weight" not in on_muon and "lm_head.weight" not in on_muon
    assert all(p.ndim == 2 for n, p in params if n in on_muon)
    # one step() of the combined optimizer: its hooks (the publisher's) run once, and every parameter moves
    calls = []
    muon.register_step_post_hook(lambda *_: calls.append(1))
    for _, p in params:
        p.grad = torch.randn_like(p)
    before = {n: p.detach().clone() for n, p in params}
    muon.step()
    assert calls == [1]
    assert all(not torch.equal(before[n], p.detach()) for n, p in params)


def test_unknown_optimizer_is_a_config_error() -> None:
    from flipsync.errors import ConfigError
    from flipsync_apps.synthetic import OptimizerSpec

    with pytest.raises(ConfigError, match="adam, adamw, muon, sgd"):
        OptimizerSpec("lion")
    with pytest.raises(ConfigError, match="lr scaling"):
        OptimizerSpec("muon", muon_lr_scaling="half")


def test_matched_rms_matches_the_update_and_the_fallback_is_adam() -> None:
    from flipsync_apps.analyze import compare_optimizers
    from flipsync_apps.synthetic import OptimizerSpec

    comp = compare_optimizers(
        llm_like_masters(SMALL), ["bf16"], [OptimizerSpec("adam"), OptimizerSpec("muon")], lr=1e-5, steps=2
    )
    adam, muon_lr, muon_rms = comp.runs
    assert (adam.reference, muon_lr.match, muon_rms.match) == (True, "lr", "rms")
    assert muon_lr.lr_scale == 1.0 and muon_rms.lr_scale > 1.0  # match_rms_adamw: a smaller step than Adam's here
    assert muon_lr.update_rms["matrix"] < 0.8 * adam.update_rms["matrix"]
    assert muon_rms.update_rms["matrix"] == pytest.approx(adam.update_rms["matrix"], rel=1e-3)
    # Muon moves only the hidden matrices: AdamW (weight decay 0) on the rest is Adam, on the same gradients
    for kind in ("embedding", "vector"):
        assert muon_lr.update_rms[kind] == pytest.approx(adam.update_rms[kind], rel=1e-6)
        assert muon_lr.formats[0].by_kind[kind] == adam.formats[0].by_kind[kind]
    a, m = adam.formats[0], muon_lr.formats[0]
    assert len(a.changed_per_step) == 2 and all(0 < x < 1 for x in a.changed_per_step)
    assert m.by_kind["matrix"] < a.by_kind["matrix"]
    # neither optimizer's step scales with |w|: for both, smaller weights (finer grid) change more often
    for run in comp.runs:
        fractions = [b[1] for b in run.formats[0].by_bucket if b[2] > 5000]
        assert fractions[0] > fractions[-1]
    doc = comp.to_json()
    assert doc["runs"][0]["formats"][0]["bytes_per_changed"] > 0 and doc["kinds"]["matrix"] > 0


def test_analyze_cli_compares_optimizers(tmp_path: Path) -> None:
    save_checkpoint(llm_like_masters(SMALL), tmp_path / "a.safetensors")
    runner = CliRunner(env={"COLUMNS": "100"})
    out = tmp_path / "cmp"
    args = ["analyze", str(tmp_path / "a.safetensors"), "--optimizer", "adam,muon", "--formats", "bf16"]
    result = runner.invoke(app, [*args, "--steps", "1", "--gradients", "correlated", "-o", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "optimizers.json").read_text())
    assert [(r["optimizer"], r["match"]) for r in report["runs"]] == [("adam", "lr"), ("muon", "lr"), ("muon", "rms")]
    assert report["meta"]["gradients"] == "correlated"
    assert (out / "change_vs_magnitude_by_optimizer.png").stat().st_size > 1000
    assert "muon @ rms" in result.output and "…" not in result.output
    # one optimizer: the simulated step with the absorption rule, under that optimizer
    result = runner.invoke(app, [*args[:2], "--optimizer", "muon", "--formats", "bf16", "-o", str(tmp_path / "one")])
    assert result.exit_code == 0, result.output
    assert "Muon" in json.loads((tmp_path / "one" / "analysis.json").read_text())["meta"]["optimizer"]
    two = runner.invoke(app, [*args[:2], str(tmp_path / "a.safetensors"), "--optimizer", "muon"])
    assert two.exit_code != 0 and "two checkpoints" in two.output
