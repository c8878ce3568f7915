"""The demo's RL optimizer: the LM head and final norm in their own Adam parameter group at a scaled rate."""

from __future__ import annotations

import pytest
import torch

from flipsync.demo.grpo import rl_optimizer
from flipsync.demo.model import demo_config
from flipsync.engines.torch.models import build_model
from flipsync.errors import ConfigError


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
