"""Synthetic workloads: master weights shaped like an LLM's, moved by real optimizer steps.

Weights are N(0, 0.02^2) with a few outlier input channels (x10-x30), as in real LLM projections;
norm weights sit near 1. Gradients are Gaussian noise with a per-row scale (optionally half of it a fixed
low-rank direction, the same every step), fed to a real torch optimizer at the given learning rate, so the
served-view change rate comes from real absorption, not a guess. ``build_optimizer`` sets up the optimizers
the analysis, the benchmarks and the demo compare: Adam, AdamW, SGD, and ``torch.optim.Muon`` on the 2-D
hidden weights with AdamW on the rest (embeddings, the LM head, norms and biases), its lr scaling explicit.
``flipsync analyze`` simulates its steps with them; the benchmarks and tests use them as workloads.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from flipsync.errors import ConfigError


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


OPTIMIZERS = ("adam", "adamw", "muon", "sgd")
MUON_LR_SCALINGS = ("match_rms_adamw", "original")
GRADIENTS = ("noise", "correlated")
KINDS = ("matrix", "embedding", "vector")  # what tensor_kind returns


def tensor_kind(name: str, shape: Sequence[int]) -> str:
    """``matrix`` (a 2-D hidden weight: what Muon moves), ``embedding`` (token/position embeddings and the LM
    head: 2-D, but Muon's authors leave them to AdamW) or ``vector`` (norms, biases, anything not 2-D)."""
    if len(shape) != 2:
        return "vector"
    low = name.lower()
    if any(k in low for k in ("embed", "embd", "lm_head", "wte", "wpe")) or low in ("output.weight",):
        return "embedding"
    return "matrix"


@dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer, with every choice that moves the served change rate explicit.

    ``adam``: ``torch.optim.Adam`` (betas 0.9/0.999, eps 1e-8, no weight decay). ``adamw``: ``torch.optim.AdamW``
    with the same betas and decoupled ``weight_decay``. ``sgd``: ``torch.optim.SGD`` with ``momentum``.
    ``muon``: ``torch.optim.Muon`` (momentum 0.95, Nesterov, 5 Newton-Schulz steps, its defaults) on the 2-D
    ``matrix`` tensors, with ``muon_lr_scaling`` as its ``adjust_lr_fn``: ``match_rms_adamw`` scales each
    matrix's step by 0.2 sqrt(max(rows, cols)), so that its RMS is about AdamW's at the same lr (Moonshot's
    choice); ``original`` by sqrt(max(1, rows / cols)) (Keller Jordan's), a step 0.2 sqrt(cols) times smaller at
    the same lr. Every other tensor gets AdamW (betas 0.9/0.999); ``weight_decay`` applies to
    both parts. ``muon_lr_scale`` multiplies the Muon part's lr only (matching update RMS).
    """

    name: str = "adam"
    muon_lr_scaling: str = "match_rms_adamw"
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd only
    muon_lr_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.name!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.muon_lr_scaling not in MUON_LR_SCALINGS:
            raise ConfigError(
                f"unknown Muon lr scaling {self.muon_lr_scaling!r}; choose one of {', '.join(MUON_LR_SCALINGS)}"
            )
        if self.weight_decay < 0 or self.momentum < 0 or self.muon_lr_scale <= 0:
            raise ConfigError("weight decay and momentum must be 0 or more, the Muon lr scale positive")

    def describe(self) -> str:
        wd = f", weight decay {self.weight_decay:g}" if self.weight_decay else ""
        if self.name == "adam":
            return "torch.optim.Adam(betas 0.9/0.999)"
        if self.name == "adamw":
            return f"torch.optim.AdamW(betas 0.9/0.999{wd})"
        if self.name == "sgd":
            return f"torch.optim.SGD(momentum {self.momentum:g})"
        scale = f", lr x{self.muon_lr_scale:.3g}" if self.muon_lr_scale != 1.0 else ""
        return (
            f"torch.optim.Muon(adjust_lr_fn={self.muon_lr_scaling!r}{wd}{scale}) on 2-D hidden weights, "
            f"torch.optim.AdamW(betas 0.9/0.999{wd}) on embeddings, head, norms and biases"
        )


@dataclass
class ParamGroup:
    """Named parameters that share a learning rate (and Adam eps) in `build_optimizer`."""

    params: list[tuple[str, torch.nn.Parameter]]
    lr: float
    eps: float = 1e-8


class Combined(torch.optim.Optimizer):
    """Several optimizers stepped as one (Muon on the matrices, AdamW on the rest), so that step hooks (the
    flipsync publisher's) see a single ``step()``. ``param_groups`` are the parts' own groups."""

    def __init__(self, parts: Sequence[torch.optim.Optimizer]) -> None:
        if not parts:
            raise ConfigError("an optimizer needs at least one parameter")
        params = [p for part in parts for g in part.param_groups for p in g["params"]]
        super().__init__(params, {})
        self.parts = list(parts)
        self.param_groups = [g for part in self.parts for g in part.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {"parts": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        for part, sd in zip(self.parts, state_dict["parts"], strict=True):
            part.load_state_dict(sd)


def build_optimizer(groups: Sequence[ParamGroup], spec: OptimizerSpec) -> torch.optim.Optimizer:
    """The optimizer ``spec`` names over ``groups`` (each its own lr and eps); see `OptimizerSpec`."""
    betas = (0.9, 0.999)
    if spec.name == "sgd":
        return torch.optim.SGD(
            [{"params": [p for _, p in g.params], "lr": g.lr} for g in groups], lr=groups[0].lr, momentum=spec.momentum
        )
    if spec.name in ("adam", "adamw"):
        cls = torch.optim.Adam if spec.name == "adam" else torch.optim.AdamW
        kw: dict[str, Any] = {"weight_decay": spec.weight_decay} if spec.name == "adamw" else {}
        return cls(
            [{"params": [p for _, p in g.params], "lr": g.lr, "eps": g.eps} for g in groups],
            lr=groups[0].lr,
            betas=betas,
            **kw,
        )
    matrices, rest = [], []
    for g in groups:
        mine = [p for n, p in g.params if tensor_kind(n, p.shape) == "matrix"]
        others = [p for n, p in g.params if tensor_kind(n, p.shape) != "matrix"]
        if mine:
            matrices.append({"params": mine, "lr": g.lr * spec.muon_lr_scale})
        if others:
            rest.append({"params": others, "lr": g.lr, "eps": g.eps})
    parts: list[torch.optim.Optimizer] = []
    if matrices:
        parts.append(
            torch.optim.Muon(
                matrices,
                lr=matrices[0]["lr"],
                weight_decay=spec.weight_decay,
                adjust_lr_fn=spec.muon_lr_scaling,
            )
        )
    if rest:
        parts.append(torch.optim.AdamW(rest, lr=rest[0]["lr"], betas=betas, weight_decay=spec.weight_decay))
    return Combined(parts)


@dataclass
class _Gradients:
    """Per tensor: a per-row scale and, for correlated gradients, a fixed unit-RMS direction."""

    row_scale: torch.Tensor
    direction: torch.Tensor | None = None


@dataclass
class OptimizerSteps:
    """Masters moved by a real torch optimizer on synthetic gradients; ``step()`` returns a copy of the new
    masters.

    ``gradients="noise"``: each step's gradient is Gaussian noise times a per-row scale (drawn once).
    ``"correlated"``: half its energy is a fixed direction (rank 4 for a matrix), the same every step, as real
    gradients persist across steps; the other half fresh noise. ``lr_scale`` multiplies every group's lr.
    """

    masters: Mapping[str, torch.Tensor]
    lr: float
    seed: int = 0
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    gradients: str = "noise"
    lr_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.gradients not in GRADIENTS:
            raise ConfigError(f"unknown gradient model {self.gradients!r}; choose one of {', '.join(GRADIENTS)}")
        self.params = {k: torch.nn.Parameter(v.clone()) for k, v in self.masters.items()}
        self.opt = build_optimizer([ParamGroup(list(self.params.items()), self.lr * self.lr_scale)], self.optimizer)
        self.gen = torch.Generator().manual_seed(self.seed)
        self.grads = {
            k: _Gradients(torch.rand(v.shape[0] if v.ndim else 1, generator=self.gen) + 0.5)
            for k, v in self.masters.items()
        }
        if self.gradients == "correlated":
            for k, v in self.masters.items():
                self.grads[k].direction = _direction(tuple(v.shape), self.gen)

    def step(self) -> dict[str, torch.Tensor]:
        for k, p in self.params.items():
            g = self.grads[k]
            scale = g.row_scale.reshape(-1, *([1] * (p.ndim - 1))) if p.ndim else g.row_scale
            noise = torch.randn(p.shape, generator=self.gen)
            if g.direction is not None:
                noise = (noise + g.direction) * math.sqrt(0.5)
            p.grad = noise * scale
        self.opt.step()
        return {k: p.detach().clone() for k, p in self.params.items()}

    def steps(self, n: int) -> Iterator[dict[str, torch.Tensor]]:
        for _ in range(n):
            yield self.step()


def _direction(shape: tuple[int, ...], gen: torch.Generator, rank: int = 4) -> torch.Tensor:
    """A fixed random direction of unit RMS: rank ``rank`` for a matrix, dense otherwise."""
    if len(shape) == 2 and min(shape) > rank:
        d = torch.randn(shape[0], rank, generator=gen) @ torch.randn(rank, shape[1], generator=gen)
    else:
        d = torch.randn(shape, generator=gen)
    return d / d.pow(2).mean().sqrt().clamp_min(1e-30)


class AdamSteps(OptimizerSteps):
    """Masters moved by torch Adam on noise gradients; ``step()`` returns a copy of the new masters."""

    def __init__(self, masters: dict[str, torch.Tensor], lr: float, seed: int = 0) -> None:
        super().__init__(masters, lr, seed)
