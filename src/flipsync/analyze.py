"""Absorption analysis: how many served values an optimizer step changes, where, and why.

The absorption rule: a master weight w moved by d changes its served value only when the move crosses a
rounding boundary of the served grid. With the spacing s(w) of that grid around w (one ulp for BF16, about
|w|/256; the scaled element step for FP8/FP4), and w's position inside its rounding interval uniform, a
step changes the served value with probability min(1, |d| / s(w)). ``predict`` applies that rule to a
simulated Adam step; ``measure`` diffs the served views for real; ``compare_checkpoints`` measures two
checkpoints per tensor, per format, and by |w| bucket.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flipsync.codec import diff_views
from flipsync.formats import dequantize_view, get_format, served_view

# |w| buckets (powers of two) for "where the changes sit"
BUCKET_EDGES = tuple(2.0**e for e in range(-16, 3))
_MAX_FINITE_MAG = {torch.bfloat16: 0x7F7F, torch.float16: 0x7BFF, torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B}
_INT_VIEW = {1: torch.uint8, 2: torch.int16}


def _next_code(t: torch.Tensor, packed_fp4: bool) -> torch.Tensor:
    """The same tensor with every element moved one code away from zero (one code back at the top)."""
    if packed_fp4:
        b = t.view(torch.uint8).to(torch.int16)
        out = torch.zeros_like(b)
        for shift in (0, 4):
            nib = (b >> shift) & 0xF
            mag = nib & 7
            mag = torch.where(mag < 7, mag + 1, mag - 1)
            out |= ((nib & 8) | mag) << shift
        return out.to(torch.uint8)
    size = t.element_size()
    bits = t.view(_INT_VIEW[size]).to(torch.int32) & ((1 << (8 * size)) - 1)
    sign = 1 << (8 * size - 1)
    mag = bits & (sign - 1)
    top = _MAX_FINITE_MAG[t.dtype]
    mag = torch.where(mag < top, mag + 1, mag - 1)
    out = (bits & sign) | mag
    if size == 2:
        out = torch.where(out >= 1 << 15, out - (1 << 16), out)
        return out.to(torch.int16).view(t.dtype)
    return out.to(torch.uint8).view(t.dtype)


def grid_spacing(masters: Mapping[str, torch.Tensor], fmt: str, *, from_fp32: bool = False) -> dict[str, torch.Tensor]:
    """Per master element, the distance between its served value and the next served code (same scales)."""
    f = get_format(fmt)
    view = served_view(masters, fmt, from_fp32=from_fp32)
    packed = f.quantized and f.payload_dtype == torch.uint8
    neighbour = {}
    for name, t in view.items():
        if name in masters and t.is_floating_point():
            neighbour[name] = _next_code(t, packed_fp4=False)
        elif name in masters and packed and t.dtype == torch.uint8:
            neighbour[name] = _next_code(t, packed_fp4=True)
        else:
            neighbour[name] = t  # scales and non-float tensors stay as they are
    a, b = dequantize_view(view, fmt), dequantize_view(neighbour, fmt)
    return {k: (b[k] - a[k]).abs() for k in masters if masters[k].is_floating_point()}


def predicted_fraction(delta: torch.Tensor, spacing: torch.Tensor) -> float:
    """The absorption rule: mean over elements of min(1, |d| / s)."""
    ratio = delta.abs() / spacing.clamp_min(torch.finfo(torch.float32).tiny)
    return float(ratio.clamp(max=1.0).mean())


def changed_mask(
    before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor], fmt: str, *, from_fp32: bool = False
) -> dict[str, torch.Tensor]:
    """Per master element: did the value an engine computes with change (payload or scale)?"""
    a = dequantize_view(served_view(before, fmt, from_fp32=from_fp32), fmt)
    b = dequantize_view(served_view(after, fmt, from_fp32=from_fp32), fmt)
    return {k: a[k].view(torch.int32) != b[k].view(torch.int32) for k in before if before[k].is_floating_point()}


@dataclass
class TensorRow:
    name: str
    numel: int
    changed: dict[str, float] = field(default_factory=dict)  # format -> measured fraction
    predicted: dict[str, float] = field(default_factory=dict)  # format -> absorption-rule fraction


@dataclass
class FormatSummary:
    format: str
    changed_fraction: float
    predicted_fraction: float | None
    patch_bytes: int
    served_bytes: int
    bytes_per_changed: float
    by_bucket: list[tuple[float, float, int]]  # (|w| upper edge, changed fraction, elements)


@dataclass
class Analysis:
    tensors: list[TensorRow]
    formats: list[FormatSummary]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _buckets(weights: Mapping[str, torch.Tensor], masks: Mapping[str, torch.Tensor]) -> list[tuple[float, float, int]]:
    edges = torch.tensor(BUCKET_EDGES)
    changed = torch.zeros(len(BUCKET_EDGES) + 1, dtype=torch.float64)
    total = torch.zeros_like(changed)
    for name, mask in masks.items():
        idx = torch.bucketize(weights[name].abs().reshape(-1).float(), edges)
        total += torch.bincount(idx, minlength=len(total)).double()
        changed += torch.bincount(idx, weights=mask.reshape(-1).double(), minlength=len(total))
    uppers = [*BUCKET_EDGES, math.inf]
    return [(uppers[i], float(changed[i] / total[i]), int(total[i])) for i in range(len(total)) if total[i] > 0]


def compare(
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
    formats: Sequence[str],
    *,
    predict: bool = False,
    from_fp32: bool = False,
) -> Analysis:
    """Measure (and with ``predict`` also predict) the served change between two sets of masters."""
    names = [k for k in before if before[k].is_floating_point()]
    rows = {k: TensorRow(k, before[k].numel()) for k in names}
    summaries = []
    for fmt in formats:
        masks = changed_mask(before, after, fmt, from_fp32=from_fp32)
        spacing = grid_spacing(before, fmt, from_fp32=from_fp32) if predict else {}
        for k in names:
            rows[k].changed[fmt] = float(masks[k].float().mean()) if masks[k].numel() else 0.0
            if predict:
                rows[k].predicted[fmt] = predicted_fraction((after[k] - before[k]).float(), spacing[k])
        old, new = served_view(before, fmt, from_fp32=from_fp32), served_view(after, fmt, from_fp32=from_fp32)
        patch, _ = diff_views(old, new, digests=False)
        patch_bytes = len(patch.to_bytes())
        n_changed = patch.header.n_changed
        numel = sum(before[k].numel() for k in names)
        changed_total = sum(float(masks[k].sum()) for k in names)
        predicted_total = sum(rows[k].predicted[fmt] * before[k].numel() for k in names) / numel if predict else None
        summaries.append(
            FormatSummary(
                format=fmt,
                changed_fraction=changed_total / max(1, numel),
                predicted_fraction=predicted_total,
                patch_bytes=patch_bytes,
                served_bytes=sum(t.numel() * t.element_size() for t in new.values()),
                bytes_per_changed=patch_bytes / max(1, n_changed),
                by_bucket=_buckets({k: before[k] for k in names}, masks),
            )
        )
    return Analysis(list(rows.values()), summaries)


def simulate(
    masters: Mapping[str, torch.Tensor], formats: Sequence[str], *, lr: float, warmup: int = 2, seed: int = 0
) -> Analysis:
    """Adam steps on noise gradients; predict and measure the served change of the last step."""
    from flipsync.synthetic import AdamSteps

    steps = AdamSteps({k: v.float() for k, v in masters.items() if v.is_floating_point()}, lr, seed=seed)
    before = steps.step()
    for _ in range(warmup - 1):
        before = steps.step()
    after = steps.step()
    analysis = compare(before, after, formats, predict=True)
    analysis.meta.update({"lr": lr, "warmup_steps": warmup, "optimizer": "torch.optim.Adam(0.9, 0.999)"})
    return analysis


def short_name(name: str) -> str:
    """A tensor name short enough for an axis label: ``model.layers.3.self_attn.q_proj.weight`` -> ``3.attn.q_proj``."""
    for prefix in ("model.", "language_model."):
        name = name.removeprefix(prefix)
    name = name.removesuffix(".weight").replace("layers.", "").replace("self_attn.", "attn.")
    return name.replace("post_attention_layernorm", "post_attn_norm").replace("input_layernorm", "in_norm")


def plot(analysis: Analysis, out_dir: Path) -> list[Path]:
    """PNG plots: change fraction per tensor (measured, and predicted where known) and vs |w|."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(max(8, len(analysis.tensors) * 0.18), 5))
    x = np.arange(len(analysis.tensors))
    for s in analysis.formats:
        measured = [100 * r.changed[s.format] for r in analysis.tensors]
        (line,) = ax.plot(x, measured, marker="o", ms=3, lw=1, label=f"{s.format} measured")
        if s.predicted_fraction is not None:
            predicted = [100 * r.predicted[s.format] for r in analysis.tensors]
            ax.plot(x, predicted, ls="--", lw=1, color=line.get_color(), label=f"{s.format} predicted")
    ax.set_xticks(x, [short_name(r.name) for r in analysis.tensors], rotation=90, fontsize=7)
    ax.set_ylabel("% of served values changed")
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_ylim(bottom=0)  # fractions are never negative: no empty lower half
    ax.set_xlim(-0.5, len(analysis.tensors) - 0.5)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)  # beside, not over, the data
    ax.set_title("Served values changed per tensor")
    fig.tight_layout()
    paths.append(out_dir / "change_per_tensor.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    for s in analysis.formats:
        edges = [b[0] if math.isfinite(b[0]) else 8.0 for b in s.by_bucket]
        ax.plot(edges, [100 * b[1] for b in s.by_bucket], marker="o", label=s.format)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("|w| (bucket upper edge)")
    ax.set_ylabel("% of served values changed")
    ax.set_title("Where the changes sit: smaller weights change more (their spacing is smaller)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "change_vs_magnitude.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
