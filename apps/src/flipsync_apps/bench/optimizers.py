"""``flipsync bench optimizers``: Adam against Muon, the served change and the patch, on the same gradients.

For every workload (the real weights installed, and the synthetic llm-like masters), learning rate and
gradient model, `flipsync_apps.analyze.compare_optimizers` runs Adam and Muon (`torch.optim.Muon` on the 2-D hidden
weights with ``adjust_lr_fn="match_rms_adamw"``, AdamW on the rest) from the same masters on the same
synthetic gradients, 2 warm-up steps then 3 measured ones, at the same lr and with Muon's lr scaled to match
Adam's update RMS on those weights. It prints the change per step (whole view and hidden matrices) and the
patch's bytes per changed value, and with ``--output DIR`` draws the change against |w| (what docs/optimizers.md
shows) and writes the numbers as JSON.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from flipsync_apps.analyze import FormatSteps, OptimizerComparison, OptimizerRun, compare_optimizers, run_label
from flipsync_apps.bench.report import pyplot, save_figure
from flipsync_apps.bench.workload import QUICK, Shape, llm_like_masters, real_masters, short_name
from flipsync_apps.synthetic import GRADIENTS, OptimizerSpec

FORMATS = ("bf16", "fp8-block")
LRS = (1e-6, 1e-5)
OPTIMIZERS = (OptimizerSpec("adam"), OptimizerSpec("muon"))
TINY = Shape(hidden=128, intermediate=256, layers=1, vocab=512)


def run(console: Console, *, quick: bool = False, out: Path | None = None) -> dict[str, Any]:
    """Every (workload, lr, gradients) comparison; prints the summary table; plots into ``out``."""
    workloads = [("llm-like", llm_like_masters(TINY if quick else QUICK))]
    if not quick:
        workloads += list(real_masters())
    lrs = LRS[:1] if quick else LRS
    grads = GRADIENTS[:1] if quick else GRADIENTS
    formats = FORMATS[:1] if quick else FORMATS
    results: list[tuple[str, float, str, OptimizerComparison]] = []
    t0 = time.perf_counter()
    with console.status("optimizers") as status:
        for name, masters in workloads:
            for lr in lrs:
                for g in grads:
                    status.update(f"optimizers: {short_name(name)}, lr {lr:g}, {g} gradients")
                    comp = compare_optimizers(masters, formats, OPTIMIZERS, lr=lr, steps=3, gradients=g)
                    results.append((name, lr, g, comp))
    console.print(table(results))
    doc = {
        "seconds": time.perf_counter() - t0,
        "comparisons": [{"workload": w, "lr": lr, "gradients": g, **c.to_json()} for w, lr, g, c in results],
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        doc["plots"] = [str(p) for p in plots(results, out)]
        (out / "optimizers.json").write_text(json.dumps(doc, indent=2))
        console.print(f"wrote {out / 'optimizers.json'} and {', '.join(doc['plots'])}")
    return doc


def load(path: Path) -> list[tuple[str, float, str, OptimizerComparison]]:
    """The comparisons of a saved ``optimizers.json`` (to redraw its plots or table without rerunning)."""
    doc = json.loads(path.read_text())
    out = []
    for c in doc["comparisons"]:
        runs = [
            OptimizerRun(
                r["optimizer"],
                r["describe"],
                r["match"],
                r["lr_scale"],
                r["update_rms"],
                [
                    FormatSteps(
                        f["format"],
                        f["changed_per_step"],
                        f["by_kind"],
                        [tuple(b) for b in f["by_bucket"]],
                        f["patch_bytes"],
                        f["changed_values"],
                    )
                    for f in r["formats"]
                ],
                r["reference"],
            )
            for r in c["runs"]
        ]
        out.append((c["workload"], c["lr"], c["gradients"], OptimizerComparison(runs, c["kinds"], c["meta"])))
    return out


def table(results: list[tuple[str, float, str, OptimizerComparison]]) -> Table:
    """Per comparison and format: % changed per step (whole view / hidden matrices) and B/chg, per run."""
    t = Table(
        title="Served values changed per step: Adam, Muon at the same lr, Muon at Adam's update RMS",
        caption="% of the view / of the 2-D hidden weights changed per step (mean of 3); B/chg: patch bytes per "
        "changed value, Adam / Muon at the same lr",
    )
    for col in ("workload", "lr", "grads", "format", "adam", "muon@lr", "muon@rms", "B/chg"):
        t.add_column(col, justify="left" if col in ("workload", "grads", "format") else "right", no_wrap=True)
    for name, lr, g, comp in results:
        for fmt in dict.fromkeys(f.format for r in comp.runs for f in r.formats):
            fs = [next(x for x in r.formats if x.format == fmt) for r in comp.runs]
            t.add_row(
                short_name(name),
                f"{lr:.0e}".replace("e-0", "e-"),
                "noise" if g == "noise" else "corr",
                fmt,
                *(f"{100 * f.changed_fraction:.2f}/{100 * f.by_kind.get('matrix', 0):.2f}" for f in fs),
                f"{fs[0].bytes_per_changed:.2f}/{fs[1].bytes_per_changed:.2f}",
            )
    return t


def plots(results: list[tuple[str, float, str, OptimizerComparison]], out: Path) -> list[Path]:
    """change-vs-magnitude.png (the hidden matrices' kind is not split out: every tensor, by |w|) and
    change-by-kind.png, both at the smallest lr measured."""
    import math

    plt = pyplot()
    lr0 = min(lr for _, lr, _, _ in results)
    chosen = [(w, g, c) for w, lr, g, c in results if lr == lr0]
    formats = list(dict.fromkeys(f.format for _, _, c in chosen for r in c.runs for f in r.formats))
    fig, axes = plt.subplots(len(chosen), len(formats), figsize=(5.0 * len(formats), 3.1 * len(chosen)), squeeze=False)
    styles = {"adam": ("-", "C0"), "muon @ lr": ("--", "C1"), "muon @ rms": (":", "C2")}
    for i, (w, g, comp) in enumerate(chosen):
        for j, fmt in enumerate(formats):
            ax = axes[i][j]
            for r in comp.runs:
                f = next(x for x in r.formats if x.format == fmt)
                pts = [(e, 100 * p) for e, p, n in f.by_bucket if math.isfinite(e) and n >= 3000 and p > 0]
                ls, color = styles.get(run_label(r), ("-.", "C3"))
                ax.plot([e for e, _ in pts], [p for _, p in pts], ls, color=color, marker="o", ms=3, label=run_label(r))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{short_name(w)}, {fmt}, lr {lr0:g}, {g} gradients", fontsize=9)
            if i == len(chosen) - 1:
                ax.set_xlabel("|w| (bucket upper edge)")
            if j == 0:
                ax.set_ylabel("% changed per step")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=9)
    paths = [save_figure(fig, out / "change-vs-magnitude.png", top=1 - 0.4 / fig.get_figheight())]

    names = list(dict.fromkeys(w for w, _, _ in chosen))
    grads = list(dict.fromkeys(g for _, g, _ in chosen))
    fig, axes = plt.subplots(
        len(grads), len(names), figsize=(3.8 * len(names), 2.9 * len(grads)), squeeze=False, sharey=True
    )
    kinds = ("matrix", "embedding", "vector")
    for w, g, comp in chosen:
        ax = axes[grads.index(g)][names.index(w)]
        width = 0.8 / len(comp.runs)
        for k, r in enumerate(comp.runs):
            f = r.formats[0]
            xs = [x + (k - (len(comp.runs) - 1) / 2) * width for x in range(len(kinds))]
            ls, color = styles.get(run_label(r), ("-.", "C3"))
            ax.bar(xs, [100 * f.by_kind.get(kind, 0) for kind in kinds], width, color=color, label=run_label(r))
        ax.set_xticks(range(len(kinds)), kinds, fontsize=8)
        ax.set_title(f"{short_name(w)}, {comp.runs[0].formats[0].format}, {g} gradients", fontsize=9)
        ax.set_yscale("log")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        if names.index(w) == 0:
            ax.set_ylabel(f"% changed per step, lr {lr0:g}")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=9)
    paths.append(save_figure(fig, out / "change-by-kind.png", top=1 - 0.4 / fig.get_figheight()))
    return paths
