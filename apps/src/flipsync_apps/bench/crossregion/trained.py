"""The crossregion benchmark's workload: one real Adam step of Llama-sized masters, the same in every run.

FP32 masters (four ``(rows, 1024)`` matrices, N(0, 0.02^2)) trained by ``torch.optim.Adam`` (lr 1e-6, betas
0.9/0.999) on Gaussian-noise gradients; a few warm-up steps, then one measured step. The state after the
warm-up and the measured step's gradient are kept, and every run restores them: every method and every repeat
publishes the same v0 -> v1.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from flipsync.codec import diff_views
from flipsync.codec.bits import int_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.formats import served_view

FMT = "bf16"
COLS = 1024


class Trained:
    """Masters after ``warmup`` Adam steps, Adam's state and the measured step's gradient.

    ``fresh()`` rebuilds the parameters and optimizer from them, so every run takes the same step.
    """

    def __init__(self, elements: int, lr: float, warmup: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        rows = max(1, elements // 4 // COLS)
        params = {
            f"model.layers.{i}.mlp.weight": torch.nn.Parameter(torch.randn(rows, COLS, generator=g) * 0.02)
            for i in range(4)
        }
        opt = torch.optim.Adam(params.values(), lr=lr, betas=(0.9, 0.999))
        scale = {k: (torch.rand(rows, 1, generator=g) + 0.5) for k in params}

        def noise() -> dict[str, torch.Tensor]:
            return {k: torch.randn(rows, COLS, generator=g) * scale[k] for k in scale}

        for _ in range(warmup):
            for k, grad in noise().items():
                params[k].grad = grad
            opt.step()
        self.lr = lr
        self.masters = {k: p.detach().clone() for k, p in params.items()}
        self.opt_state = copy.deepcopy(opt.state_dict())
        self.grads = noise()
        del params, opt
        self.v0 = served_view(self.masters, FMT)
        p1, o1 = self.fresh()
        self.step(p1, o1)
        self.v1 = served_view({k: p.detach() for k, p in p1.items()}, FMT)
        del p1, o1
        t0 = FingerprintTable.of(self.v0)
        self.table0 = t0
        # the patch the trainer publisher ships by default (positions coded against the base)
        patch, t1 = diff_views(self.v0, self.v1, old_table=t0, base_version=0, target_version=1, served_format=FMT)
        self.fp0, self.fp1 = t0.view_fp(), t1.view_fp()
        self.patch = patch.to_bytes()
        self.changed = sum(int((int_view(self.v0[k]) != int_view(self.v1[k])).sum()) for k in self.v0)

    @property
    def view_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.v0.values())

    @property
    def elements(self) -> int:
        return sum(t.numel() for t in self.v0.values())

    def fresh(self) -> tuple[dict[str, torch.nn.Parameter], torch.optim.Optimizer]:
        params = {k: torch.nn.Parameter(v.clone()) for k, v in self.masters.items()}
        opt = torch.optim.Adam(params.values(), lr=self.lr, betas=(0.9, 0.999))
        opt.load_state_dict(copy.deepcopy(self.opt_state))
        return params, opt

    def step(self, params: Mapping[str, torch.nn.Parameter], opt: torch.optim.Optimizer) -> None:
        for k, p in params.items():
            p.grad = self.grads[k].clone()
        opt.step()


def same_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(int_view(a[k]), int_view(b[k])) for k in a)
