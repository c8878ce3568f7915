"""Synthetic workloads: master weights shaped like an LLM's, moved by real Adam steps.

Weights are N(0, 0.02^2) with a few outlier input channels (x10-x30), as in real LLM projections;
norm weights sit near 1. Gradients are Gaussian noise with a per-row scale, fed to ``torch.optim.Adam`` at
the given learning rate, so the served-view change rate comes from real Adam absorption, not a guess.
``flipsync analyze`` simulates its steps with them; the benchmarks and tests use them as workloads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    vocab: int


def llm_like_masters(shape: Shape, seed: int = 0) -> dict[str, torch.Tensor]:
    """FP32 masters with Llama-style names and shapes."""
    g = torch.Generator().manual_seed(seed)
    h, i = shape.hidden, shape.intermediate

    def linear(out: int, inp: int) -> torch.Tensor:
        w = torch.randn(out, inp, generator=g) * 0.02
        outliers = torch.randperm(inp, generator=g)[: max(1, inp // 256)]
        w[:, outliers] *= 10 + 20 * torch.rand(outliers.numel(), generator=g)
        return w

    masters = {"model.embed_tokens.weight": torch.randn(shape.vocab, h, generator=g) * 0.02}
    for layer in range(shape.layers):
        p = f"model.layers.{layer}"
        for proj, (out, inp) in {
            "self_attn.q_proj": (h, h),
            "self_attn.k_proj": (h // 4, h),
            "self_attn.v_proj": (h // 4, h),
            "self_attn.o_proj": (h, h),
            "mlp.gate_proj": (i, h),
            "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i),
        }.items():
            masters[f"{p}.{proj}.weight"] = linear(out, inp)
        masters[f"{p}.input_layernorm.weight"] = 1 + 0.05 * torch.randn(h, generator=g)
        masters[f"{p}.post_attention_layernorm.weight"] = 1 + 0.05 * torch.randn(h, generator=g)
    masters["model.norm.weight"] = 1 + 0.05 * torch.randn(h, generator=g)
    masters["lm_head.weight"] = torch.randn(shape.vocab, h, generator=g) * 0.02
    return masters


class AdamSteps:
    """Masters moved by torch Adam on noise gradients; ``step()`` returns a copy of the new masters."""

    def __init__(self, masters: dict[str, torch.Tensor], lr: float, seed: int = 0) -> None:
        self.params = {k: torch.nn.Parameter(v.clone()) for k, v in masters.items()}
        self.opt = torch.optim.Adam(self.params.values(), lr=lr, betas=(0.9, 0.999))
        self.gen = torch.Generator().manual_seed(seed)
        self.row_scale = {
            k: torch.rand(v.shape[0] if v.ndim else 1, generator=self.gen) + 0.5 for k, v in masters.items()
        }

    def step(self) -> dict[str, torch.Tensor]:
        for k, p in self.params.items():
            scale = self.row_scale[k].reshape(-1, *([1] * (p.ndim - 1))) if p.ndim else self.row_scale[k]
            p.grad = torch.randn(p.shape, generator=self.gen) * scale
        self.opt.step()
        return {k: p.detach().clone() for k, p in self.params.items()}
