"""Absorption analysis: how many served values an optimizer step changes, where, and why.

The absorption rule: a master weight w moved by d changes its served value only when the move crosses a
rounding boundary of the served grid. With the spacing s(w) of that grid around w (one ulp for BF16, about
|w|/256; the scaled element step for FP8/FP4), and w's position inside its rounding interval uniform, a
step changes the served value with probability min(1, |d| / s(w)). ``predict`` applies that rule to a
simulated Adam step; ``measure`` diffs the served views for real; ``compare_checkpoints`` measures two
checkpoints per tensor, per format, and by |w| bucket. ``compare_optimizers`` runs the same synthetic steps
under several optimizers (`flipsync_apps.synthetic.OptimizerSpec`: Adam, AdamW, Muon, SGD) at matched learning rate
and at matched update RMS, and measures each step's served change per format, per tensor kind and by |w|.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flipsync.codec import diff_views
from flipsync.errors import ConfigError
from flipsync.formats import dequantize_view, get_format, served_view
from flipsync_apps.synthetic import KINDS, OptimizerSpec, OptimizerSteps, tensor_kind

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
    masters: Mapping[str, torch.Tensor],
    formats: Sequence[str],
    *,
    lr: float,
    warmup: int = 2,
    seed: int = 0,
    optimizer: OptimizerSpec | None = None,
    gradients: str = "noise",
) -> Analysis:
    """Optimizer steps (Adam unless ``optimizer``) on synthetic gradients; predict and measure the served change of
    the last step."""
    spec = optimizer or OptimizerSpec()
    steps = OptimizerSteps(_floats(masters), lr, seed=seed, optimizer=spec, gradients=gradients)
    before = steps.step()
    for _ in range(warmup - 1):
        before = steps.step()
    after = steps.step()
    analysis = compare(before, after, formats, predict=True)
    analysis.meta.update(
        {"lr": lr, "warmup_steps": warmup, "optimizer": spec.describe(), "gradients": gradients, "seed": seed}
    )
    return analysis


def _floats(masters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in masters.items() if v.is_floating_point()}


MATCHES = ("lr", "rms")


@dataclass
class FormatSteps:
    """One format's served change over the measured steps of one optimizer run."""

    format: str
    changed_per_step: list[float]  # share of the masters' served values that changed, per measured step
    by_kind: dict[str, float]  # tensor kind -> share changed, over all measured steps
    by_bucket: list[tuple[float, float, int]]  # (|w| upper edge, share changed, element-steps), all steps
    patch_bytes: list[int]  # diff_views patch per step
    changed_values: list[int]  # changed served values per step (the patch's count: payloads and scales)

    @property
    def changed_fraction(self) -> float:
        return sum(self.changed_per_step) / max(1, len(self.changed_per_step))

    @property
    def bytes_per_changed(self) -> float:
        return sum(self.patch_bytes) / max(1, sum(self.changed_values))


@dataclass
class OptimizerRun:
    """One optimizer's run: its steps' update size and the served change they caused, per format."""

    optimizer: str
    describe: str
    match: str  # "lr": the lr given; "rms": lr scaled so its matrices' update RMS equals the reference's
    lr_scale: float  # what the lr was multiplied by (for Muon, the Muon part's lr only)
    update_rms: dict[str, float]  # tensor kind -> RMS of the FP32 master update over the measured steps
    formats: list[FormatSteps]
    reference: bool = False  # the first optimizer: the one the others' update RMS is matched to


@dataclass
class OptimizerComparison:
    runs: list[OptimizerRun]
    kinds: dict[str, int]  # tensor kind -> elements
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        for run, r in zip(doc["runs"], self.runs, strict=True):
            for f, fs in zip(run["formats"], r.formats, strict=True):
                f["changed_fraction"] = fs.changed_fraction
                f["bytes_per_changed"] = fs.bytes_per_changed
        return doc

    def run(self, optimizer: str, match: str) -> OptimizerRun:
        for r in self.runs:
            if r.optimizer == optimizer and r.match == match:
                return r
        raise KeyError((optimizer, match))


def _trajectory(
    masters: Mapping[str, torch.Tensor],
    spec: OptimizerSpec,
    lr: float,
    lr_scale: float,
    warmup: int,
    steps: int,
    gradients: str,
    seed: int,
) -> list[dict[str, torch.Tensor]]:
    """The masters after the last warm-up step and after each measured step (steps + 1 snapshots)."""
    if spec.name == "muon":
        spec = OptimizerSpec(**{**asdict(spec), "muon_lr_scale": spec.muon_lr_scale * lr_scale})
        lr_scale = 1.0
    run = OptimizerSteps(masters, lr, seed=seed, optimizer=spec, gradients=gradients, lr_scale=lr_scale)
    out = [dict(masters)]
    for _ in range(warmup):
        out = [run.step()]
    out += list(run.steps(steps))
    return out


def _update_rms(trajectory: list[dict[str, torch.Tensor]], kinds: Mapping[str, str]) -> dict[str, float]:
    sq = dict.fromkeys(KINDS, 0.0)
    n = dict.fromkeys(KINDS, 0)
    for before, after in itertools.pairwise(trajectory):
        for k, kind in kinds.items():
            d = (after[k] - before[k]).double()
            sq[kind] += float(d.pow(2).sum())
            n[kind] += d.numel()
    return {kind: math.sqrt(sq[kind] / n[kind]) for kind in KINDS if n[kind]}


def _measure_formats(
    trajectory: list[dict[str, torch.Tensor]], formats: Sequence[str], kinds: Mapping[str, str]
) -> list[FormatSteps]:
    names = list(kinds)
    out = []
    for fmt in formats:
        views = [served_view(m, fmt) for m in trajectory]
        values = [dequantize_view(v, fmt) for v in views]
        per_step, patch_bytes, counts = [], [], []
        kind_changed = dict.fromkeys(KINDS, 0.0)
        kind_total = dict.fromkeys(KINDS, 0)
        edges = torch.tensor(BUCKET_EDGES)
        b_changed = torch.zeros(len(BUCKET_EDGES) + 1, dtype=torch.float64)
        b_total = torch.zeros_like(b_changed)
        for i in range(len(trajectory) - 1):
            changed = 0.0
            for k in names:
                mask = values[i][k].view(torch.int32) != values[i + 1][k].view(torch.int32)
                c = float(mask.sum())
                changed += c
                kind_changed[kinds[k]] += c
                kind_total[kinds[k]] += mask.numel()
                idx = torch.bucketize(trajectory[i][k].abs().reshape(-1), edges)
                b_total += torch.bincount(idx, minlength=len(b_total)).double()
                b_changed += torch.bincount(idx, weights=mask.reshape(-1).double(), minlength=len(b_total))
            per_step.append(changed / max(1, sum(trajectory[i][k].numel() for k in names)))
            patch, _ = diff_views(views[i], views[i + 1], digests=False)
            patch_bytes.append(len(patch.to_bytes()))
            counts.append(patch.header.n_changed)
        uppers = [*BUCKET_EDGES, math.inf]
        buckets = [
            (uppers[j], float(b_changed[j] / b_total[j]), int(b_total[j])) for j in range(len(b_total)) if b_total[j]
        ]
        by_kind = {kind: kind_changed[kind] / kind_total[kind] for kind in KINDS if kind_total[kind]}
        out.append(FormatSteps(fmt, per_step, by_kind, buckets, patch_bytes, counts))
    return out


def compare_optimizers(
    masters: Mapping[str, torch.Tensor],
    formats: Sequence[str],
    optimizers: Sequence[OptimizerSpec],
    *,
    lr: float,
    steps: int = 3,
    warmup: int = 2,
    match: Sequence[str] = MATCHES,
    gradients: str = "noise",
    seed: int = 0,
) -> OptimizerComparison:
    """Each optimizer's served change over ``steps`` steps after ``warmup``, on the same synthetic gradients.

    ``match`` "lr": every optimizer at ``lr`` (Muon's own scaling, ``muon_lr_scaling``, applies). "rms": the
    first optimizer at ``lr`` is the reference; every other one's lr (Muon: its Muon part's lr) is scaled so
    that the RMS of its update of the ``matrix`` tensors over the measured steps equals the reference's. The
    gradients are the same whatever the weights, and every step here is linear in the lr, so one probe run
    gives the scale exactly (the measured RMS ratio is reported).
    """
    if not optimizers:
        raise ConfigError("name at least one optimizer to analyse")
    if steps < 1 or warmup < 1:
        raise ConfigError("the analysis needs at least one warm-up step and one measured step")
    if unknown := set(match) - set(MATCHES):
        raise ConfigError(f"unknown match {sorted(unknown)}; choose from {', '.join(MATCHES)}")
    m = _floats(masters)
    kinds = {k: tensor_kind(k, v.shape) for k, v in m.items()}
    runs: list[OptimizerRun] = []
    cache: dict[tuple[int, float], list[dict[str, torch.Tensor]]] = {}

    def trajectory(i: int, scale: float) -> list[dict[str, torch.Tensor]]:
        if (i, scale) not in cache:
            cache[(i, scale)] = _trajectory(m, optimizers[i], lr, scale, warmup, steps, gradients, seed)
        return cache[(i, scale)]

    ref_rms = _update_rms(trajectory(0, 1.0), kinds).get("matrix")
    for i, spec in enumerate(optimizers):
        for how in match:
            if how == "rms" and i == 0 and "lr" in match:
                continue  # the reference at matched RMS is the reference at its lr: measured once
            scale = 1.0
            if how == "rms" and i > 0:
                rms = _update_rms(trajectory(i, 1.0), kinds).get("matrix")
                if not ref_rms or not rms:
                    raise ConfigError("matching update RMS needs 2-D weights that the optimizers move")
                scale = ref_rms / rms
            traj = trajectory(i, scale)
            runs.append(
                OptimizerRun(
                    optimizer=spec.name,
                    describe=spec.describe(),
                    match=how if i > 0 else "lr",
                    lr_scale=scale,
                    update_rms=_update_rms(traj, kinds),
                    formats=_measure_formats(traj, formats, kinds),
                    reference=i == 0,
                )
            )
        cache.clear()  # a trajectory holds steps + 1 copies of the masters: keep one optimizer's at a time
    counts = dict.fromkeys(KINDS, 0)
    for k, kind in kinds.items():
        counts[kind] += m[k].numel()
    meta = {
        "lr": lr,
        "steps": steps,
        "warmup_steps": warmup,
        "gradients": gradients,
        "seed": seed,
        "reference": optimizers[0].name,
        "match": list(match),
    }
    return OptimizerComparison(runs, {k: v for k, v in counts.items() if v}, meta)


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


def run_label(run: OptimizerRun) -> str:
    """``adam`` (the reference), ``muon @ lr``, ``muon @ rms``."""
    return run.optimizer if run.reference else f"{run.optimizer} @ {run.match}"


def comparison_tables(comp: OptimizerComparison) -> list[Any]:
    """Rich tables of a comparison: per format and run, the change per step and per kind; then, per format, the
    change by |w| with one column per run. Each fits a 100-column terminal."""
    from rich.table import Table

    steps = comp.meta.get("steps", 1)
    t = Table(
        title=f"Served values changed per step, lr {comp.meta.get('lr', 0):g}, {comp.meta.get('gradients')} gradients",
        caption="lr x: the lr multiplier that matched the update RMS of the 2-D hidden weights (Muon: its part "
        "only); RMS: of those weights' FP32 update; % per step, then by tensor kind over all steps",
    )
    for col in (
        "format",
        "optimizer",
        "lr x",
        "RMS",
        f"% changed, steps 1-{steps}",
        "matrix",
        "embed",
        "vector",
        "B/chg",
    ):
        t.add_column(col, justify="left" if col in ("format", "optimizer") else "right")
    for fmt in dict.fromkeys(f.format for r in comp.runs for f in r.formats):
        for r in comp.runs:
            f = next(x for x in r.formats if x.format == fmt)
            t.add_row(
                fmt,
                run_label(r),
                f"{r.lr_scale:.2f}",
                f"{r.update_rms.get('matrix', 0):.2e}",
                " ".join(f"{100 * x:.3f}" for x in f.changed_per_step),
                *(f"{100 * f.by_kind[k]:.3f}" if k in f.by_kind else "-" for k in KINDS),
                f"{f.bytes_per_changed:.3f}",
            )
    tables = [t]
    for fmt in dict.fromkeys(f.format for r in comp.runs for f in r.formats):
        b = Table(title=f"{fmt}: % of served values changed per step, by |w| (all tensors)")
        b.add_column("|w| up to", justify="right")
        b.add_column("elements", justify="right")
        per_run = [
            {e: frac for e, frac, _ in next(x for x in r.formats if x.format == fmt).by_bucket} for r in comp.runs
        ]
        sizes = {e: n for e, _, n in comp.runs[0].formats[0].by_bucket}
        for r in comp.runs:
            b.add_column(run_label(r), justify="right")
        for edge in sizes:
            b.add_row(
                f"2^{round(math.log2(edge))}" if math.isfinite(edge) else "more",
                f"{sizes[edge] // max(1, steps):,}",
                *(f"{100 * p[edge]:.3f}" if edge in p else "-" for p in per_run),
            )
        tables.append(b)
    return tables


def plot_comparison(comp: OptimizerComparison, path: Path, title: str = "") -> Path:
    """Change rate against |w|, one panel per format, one line per run (the reference solid)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = list(dict.fromkeys(f.format for r in comp.runs for f in r.formats))
    fig, axes = plt.subplots(1, len(formats), figsize=(5.2 * len(formats), 4), squeeze=False)
    styles = ["-", "--", ":", "-."]
    for ax, fmt in zip(axes[0], formats, strict=True):
        for i, r in enumerate(comp.runs):
            f = next(x for x in r.formats if x.format == fmt)
            pts = [(e, 100 * p) for e, p, n in f.by_bucket if math.isfinite(e) and n >= 1000 and p > 0]
            ax.plot(
                [e for e, _ in pts], [p for _, p in pts], styles[i % len(styles)], marker="o", ms=3, label=run_label(r)
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("|w| (bucket upper edge)")
        ax.set_ylabel("% of served values changed per step")
        ax.set_title(f"{fmt}" + (f", {title}" if title else ""), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
