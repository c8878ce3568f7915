"""Where a mixture-of-experts policy's patches land: the share of each expert's served values that changes per
version, beside the dense layers' (attention, norms, embeddings, LM head) and the routers'.

Expert tensors are recognised by name: one tensor per expert (``...mlp.experts.<e>.<proj>.weight``, as
released checkpoints name them) or fused, with the experts along the first dimension (``...mlp.experts.
gate_up_proj`` [E, 2I, H], as transformers 5 holds them); a fused tensor's changed positions are split by
expert. Routers are the ``...mlp.gate.weight`` tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flipsync.codec import Patch

_PER_EXPERT = re.compile(r"^.*\.mlp\.experts\.(\d+)\.")
_FUSED = re.compile(r"^.*\.mlp\.experts\.[^.]+$")
_ROUTER = re.compile(r"^.*\.mlp\.gate\.weight$")


@dataclass
class ExpertRates:
    """Changed values per expert index (all layers pooled), per dense and router tensor, over the versions seen."""

    experts: int
    numel: dict[str, int]
    shape: dict[str, tuple[int, ...]]
    changed_experts: np.ndarray = field(init=False)
    changed_dense: int = 0
    changed_router: int = 0
    versions: int = 0

    def __post_init__(self) -> None:
        self.changed_experts = np.zeros(self.experts, np.int64)

    @classmethod
    def of(cls, view: Mapping[str, torch.Tensor]) -> ExpertRates | None:
        """For a served view holding experts; None for a dense model."""
        n = 0
        for name, t in view.items():
            if m := _PER_EXPERT.match(name):
                n = max(n, int(m.group(1)) + 1)
            elif _FUSED.match(name) and t.dim() == 3:
                n = max(n, int(t.shape[0]))
        if n == 0:
            return None
        return cls(n, {k: v.numel() for k, v in view.items()}, {k: tuple(v.shape) for k, v in view.items()})

    def _expert_values(self) -> np.ndarray:
        per = np.zeros(self.experts, np.int64)
        for name, numel in self.numel.items():
            if m := _PER_EXPERT.match(name):
                per[int(m.group(1))] += numel
            elif _FUSED.match(name) and len(self.shape[name]) == 3:
                per += numel // self.experts
        return per

    def add(self, patches: Iterable[Patch]) -> None:
        """One version's patches (sections coded against their base are counted by tensor, not position)."""
        self.versions += 1
        for patch in patches:
            for s in patch.sections:
                name = s.name
                if _ROUTER.match(name):
                    self.changed_router += s.n
                elif m := _PER_EXPERT.match(name):
                    self.changed_experts[int(m.group(1))] += s.n
                elif _FUSED.match(name) and len(self.shape.get(name, ())) == 3:
                    if patch.section_needs_base(name):  # positions need the base values: spread evenly
                        self.changed_experts += s.n // self.experts
                        continue
                    pos = patch.change(name).positions.astype(np.int64)
                    per = self.numel[name] // self.experts
                    self.changed_experts += np.bincount(pos // per, minlength=self.experts)
                else:
                    self.changed_dense += s.n

    def summary(self) -> dict[str, Any]:
        """Mean % of values changed per version: per expert index, in the dense tensors and in the routers."""
        v = max(1, self.versions)
        per = self._expert_values()
        dense = sum(n for k, n in self.numel.items() if not _is_expert(k, self.shape[k]) and not _ROUTER.match(k))
        router = sum(n for k, n in self.numel.items() if _ROUTER.match(k))
        pairs = zip(self.changed_experts.tolist(), per.tolist(), strict=True)
        experts_pct = [100.0 * c / v / max(1, p) for c, p in pairs]
        return {
            "versions": self.versions,
            "experts": self.experts,
            "per_expert_pct": experts_pct,
            "experts_pct": 100.0 * float(self.changed_experts.sum()) / v / max(1, int(per.sum())),
            "dense_pct": 100.0 * self.changed_dense / v / max(1, dense),
            "router_pct": 100.0 * self.changed_router / v / max(1, router) if router else None,
        }


def _is_expert(name: str, shape: tuple[int, ...]) -> bool:
    return bool(_PER_EXPERT.match(name)) or (bool(_FUSED.match(name)) and len(shape) == 3)


def summary_line(s: Mapping[str, Any]) -> str:
    per = ", ".join(f"{p:.2f}" for p in s["per_expert_pct"])
    router = f", routers {s['router_pct']:.2f}%" if s.get("router_pct") is not None else ""
    return (
        f"MoE: served values changed per version, experts {s['experts_pct']:.2f}% (per expert: {per}), dense "
        f"layers {s['dense_pct']:.2f}%{router} (means over {s['versions']} versions)"
    )
