"""The demo's RL optimizer: the LM head and final norm in their own Adam parameter group at a scaled rate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flipsync.engines.torch.model_dir import demo_config
from flipsync.engines.torch.models import build_model
from flipsync.errors import ConfigError
from flipsync_apps.demo.grpo import rl_optimizer


def _model() -> torch.nn.Module:
    model = build_model(demo_config("llama-1m"), dtype=torch.float32)
    model.requires_grad_(True)
    return model


def test_head_group_learns_at_the_scaled_rate() -> None:
    model = _model()
    opt = rl_optimizer(model, 3e-5, head_lr_scale=10.0)
    body, head = opt.param_groups
    assert body["lr"] == pytest.approx(3e-5) and head["lr"] == pytest.approx(3e-4)
    # the head's eps damps the near-zero gradients of the rows of tokens the policy never samples
    assert head["eps"] == pytest.approx(1e-5) and body["eps"] == pytest.approx(1e-8)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in head["params"]) == ["lm_head.weight", "model.norm.weight"]
    # every parameter is in exactly one group
    grouped = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(names) and len(set(grouped)) == len(grouped)


def test_scale_one_is_plain_adam() -> None:
    model = _model()
    opt = rl_optimizer(model, 1e-4)
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["lr"] == pytest.approx(1e-4)
    assert len(opt.param_groups[0]["params"]) == len(list(model.parameters()))


def test_a_model_without_a_head_is_refused() -> None:
    with pytest.raises(ConfigError, match="lm_head"):
        rl_optimizer(torch.nn.Linear(4, 4), 1e-4, head_lr_scale=10.0)


def test_muon_moves_the_hidden_matrices_and_adamw_the_rest() -> None:
    from flipsync_apps.synthetic import Combined, OptimizerSpec

    model = _model()
    opt = rl_optimizer(model, 3e-5, head_lr_scale=10.0, optimizer=OptimizerSpec("muon"))
    assert isinstance(opt, Combined)
    muon, adamw = opt.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    names = {id(p): n for n, p in model.named_parameters()}
    on_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    assert on_muon and all(".layers." in n and n.endswith("proj.weight") for n in on_muon)
    head = [g for g in adamw.param_groups if g["lr"] == pytest.approx(3e-4)]
    assert len(head) == 1 and head[0]["eps"] == pytest.approx(1e-5)
    assert sorted(names[id(p)] for p in head[0]["params"]) == ["lm_head.weight", "model.norm.weight"]
    grouped = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(grouped) == sorted(names) and len(set(grouped)) == len(grouped)
    # a real step: the publisher's hooks see one step, and every matrix moves
    fired = []
    opt.register_step_post_hook(lambda *_: fired.append(1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = model(input_ids=torch.randint(0, 200, (2, 8))).logits.float().pow(2).mean()
    loss.backward()
    opt.step()
    assert fired == [1]
    assert all(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters() if n in on_muon)


def test_unknown_optimizer_fails_before_the_warm_start(tmp_path: Path) -> None:
    from flipsync_apps.demo.records import DemoConfig
    from flipsync_apps.demo.run import run_demo

    with pytest.raises(ConfigError, match="unknown optimizer"):
        run_demo(DemoConfig(model="llama-1m", optimizer="lion", out=tmp_path), None)  # type: ignore[arg-type]
