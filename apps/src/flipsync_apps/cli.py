"""The applications' commands, added to the ``flipsync`` command line through the ``flipsync.commands`` entry
points (apps/pyproject.toml): ``flipsync demo``, ``flipsync analyze`` and ``flipsync bench``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from flipsync.board.throttle import parse_bandwidth
from flipsync.checkpoint import Checkpoint
from flipsync.cli.board import output_console
from flipsync.cli.local import format_name
from flipsync.cli.terminal import human_size as _size
from flipsync.cli.terminal import run_or_exit as _run
from flipsync.errors import ConfigError
from flipsync.formats import FORMAT_NAMES, get_format
from flipsync_apps.bench.cli import bench_app

if TYPE_CHECKING:
    import torch

__all__ = ["analyze", "bench_app", "demo"]


def demo(
    steps: Annotated[int, typer.Option(help="RL steps")] = 40,
    fmt: Annotated[
        str, typer.Option("--format", "-f", help="served format the islands hold", callback=format_name)
    ] = "bf16",
    lr: Annotated[float, typer.Option(help="Adam learning rate of the RL steps")] = 3e-5,
    head_lr_scale: Annotated[
        float, typer.Option(help="the LM head and final norm learn at this times --lr (1: the same rate)")
    ] = 20.0,
    islands: Annotated[int, typer.Option(help="flipsync rollout islands (processes)")] = 2,
    control: Annotated[
        bool, typer.Option(help="also run an island that reloads each full checkpoint (what users do without flipsync)")
    ] = True,
    engine: Annotated[str, typer.Option(help="the flipsync islands' engine: torch, or vllm (FLIPSYNC_VLLM_PYTHON)")] = (
        "torch"
    ),
    bandwidth: Annotated[str, typer.Option(help="each island's link to the board, e.g. 100mbit, 1gbit; 'none'")] = (
        "100mbit"
    ),
    max_staleness: Annotated[
        int | None, typer.Option(help="a hard cap: drop rollouts more than this many trainer steps old (default: none)")
    ] = None,
    rollout: Annotated[
        str,
        typer.Option(
            help="rollout mode: sync (on-policy, islands wait for each version), async (a buffer 4 batches deep, "
            "a version per response) or inflight (versions land mid-sequence, a version per token); docs/async.md"
        ),
    ] = "inflight",
    is_cap: Annotated[float, typer.Option(help="cap of the per-token truncated importance weight")] = 2.0,
    staleness_bound: Annotated[
        int, typer.Option(help="tokens older than this many trainer steps get a cap falling as is_cap * bound / age")
    ] = 2,
    model: Annotated[
        str, typer.Option(help="demo model: llama-20m (40 MB in bf16), llama-1m or moe-2m (Qwen3-MoE-shaped)")
    ] = "llama-20m",
    warm_start: Annotated[int, typer.Option(help="supervised steps before RL, so rewards have room to move")] = 100,
    prompts: Annotated[int, typer.Option(help="prompts per RL step (each sampled --group times)")] = 6,
    group: Annotated[int, typer.Option(help="samples per prompt (GRPO group)")] = 4,
    out: Annotated[Path, typer.Option("--output", "-o", help="folder for the board, report and plots")] = Path(
        "flipsync-demo"
    ),
    seed: Annotated[int, typer.Option(help="seed of the model, task and sampling")] = 0,
    context: Annotated[
        bool, typer.Option(help="code patch positions against their base (the publisher's default; smaller patches)")
    ] = True,
    optimizer: Annotated[
        str, typer.Option(help="RL optimizer: adam, adamw, muon (Muon on 2-D hidden weights, AdamW on the rest) or sgd")
    ] = "adam",
    muon_lr_scaling: Annotated[
        str, typer.Option(help="Muon's adjust_lr_fn: match_rms_adamw (its step RMS about AdamW's) or original")
    ] = "match_rms_adamw",
    compare: Annotated[
        list[Path] | None,
        typer.Option(help="a previous run's report.json (or its folder): print the runs side by side; repeatable"),
    ] = None,
    fleet: Annotated[
        bool,
        typer.Option(
            help="rollouts through a gateway (flipsync gateway); an island joins a third of the way in and one "
            "is killed two thirds of the way in"
        ),
    ] = True,
) -> None:
    """A small RL run on this CPU: a trainer publishes every step; flipsync islands follow the board and roll
    out, beside a control island that reloads full checkpoints over the same link."""

    def go() -> None:
        # Checked before the imports and the warm start, which take a minute, so a typo fails at once.
        get_format(fmt)
        if bandwidth.lower() != "none":
            parse_bandwidth(bandwidth)
        from flipsync_apps.demo.fleet import fleet_lines
        from flipsync_apps.demo.outputs import mode_plots, write_outputs
        from flipsync_apps.demo.records import DemoConfig
        from flipsync_apps.demo.run import run_demo
        from flipsync_apps.demo.summary import comparison, load_report, summary_lines

        earlier = [(str(c), load_report(c)) for c in compare or []]

        cfg = DemoConfig(
            steps=steps,
            served_format=fmt,
            lr=lr,
            head_lr_scale=head_lr_scale,
            islands=islands,
            control=control,
            engine=engine,
            bandwidth=None if bandwidth.lower() == "none" else bandwidth,
            max_staleness=max_staleness,
            rollout=rollout.strip().lower(),
            is_cap=is_cap,
            staleness_bound=staleness_bound,
            model=model,
            warm_start_steps=warm_start,
            prompts_per_step=prompts,
            group_size=group,
            seed=seed,
            context=context,
            out=out,
            optimizer=optimizer.strip().lower(),
            muon_lr_scaling=muon_lr_scaling,
            fleet=fleet,
        )
        console = output_console()
        report = run_demo(cfg, console)
        paths = write_outputs(report, out)
        console.print()
        for line in summary_lines(report):
            console.print(line)
        if earlier:
            console.print(comparison([*earlier, (str(out), report.to_json())]))
            docs = [doc for _, doc in earlier] + [report.to_json()]
            if all("rollout" in d["summary"] for d in docs):  # runs of the rollout modes: their plots too
                paths += mode_plots(docs, out / "compare")
        for line in fleet_lines(report.fleet, report.failed_rollouts):
            console.print(line)
        ok = all(report.bitwise_equal.values())
        verdict = "[green]bitwise equal[/]" if ok else "[red]NOT equal[/]"
        held = ", ".join(f"{name}: v{report.audits[name]['version']}" for name in report.bitwise_equal)
        console.print(
            f"final view {report.final_view_fp}: every flipsync island {verdict} to the trainer's served view "
            f"({held}); {len(report.steps)} steps, {report.wall_s:.0f} s in all"
        )
        console.print("wrote " + ", ".join(str(p) for p in paths))
        if report.masters:
            console.print(
                "master checkpoints to try `flipsync view/diff/apply/analyze` on: " + ", ".join(report.masters)
            )
        if not ok:
            raise typer.Exit(1)

    _run(go)


def analyze(
    checkpoint: Annotated[Path, typer.Argument(help="master checkpoint (a .safetensors file or an HF directory)")],
    other: Annotated[Path | None, typer.Argument(help="a second checkpoint: measure the change between them")] = None,
    formats: Annotated[str, typer.Option(help="comma-separated served formats")] = ",".join(FORMAT_NAMES),
    lr: Annotated[float, typer.Option(help="with one checkpoint: learning rate of the simulated steps")] = 1e-6,
    optimizer: Annotated[
        str | None,
        typer.Option(help="with one checkpoint: adam, adamw, muon or sgd; several, comma-separated, side by side"),
    ] = None,
    muon_lr_scaling: Annotated[
        str, typer.Option(help="Muon's adjust_lr_fn: match_rms_adamw (its step RMS about AdamW's) or original")
    ] = "match_rms_adamw",
    weight_decay: Annotated[float, typer.Option(help="decoupled weight decay of AdamW and Muon")] = 0.0,
    match: Annotated[str, typer.Option(help="with several optimizers: lr, rms or lr,rms (matched update RMS)")] = (
        "lr,rms"
    ),
    steps: Annotated[int, typer.Option(help="with several optimizers: measured steps (after 2 warm-up steps)")] = 3,
    gradients: Annotated[
        str, typer.Option(help="simulated gradients: noise, or correlated (half a fixed direction)")
    ] = ("noise"),
    out: Annotated[Path, typer.Option("--output", "-o", help="folder for the JSON report and PNG plots")] = Path(
        "flipsync-analysis"
    ),
    top: Annotated[int, typer.Option(help="tensors shown in the per-tensor table (largest first)")] = 20,
) -> None:
    """How many served values change, per tensor and format, and where (by |w|).

    With two checkpoints: measured. With one: simulated optimizer steps (Adam unless --optimizer), predicted by
    the absorption rule (a step changes a served value with probability min(1, |step| / grid spacing)) next to
    the measurement. With several optimizers: each one's change per step, per tensor kind and by |w|, at the
    same lr and at matched update RMS of the 2-D weights, side by side.
    """
    from flipsync_apps import analyze as an
    from flipsync_apps.synthetic import OptimizerSpec

    def go() -> None:
        fmts = [f.strip() for f in formats.split(",") if f.strip()]
        specs = [
            OptimizerSpec(name.strip().lower(), muon_lr_scaling=muon_lr_scaling, weight_decay=weight_decay)
            for name in (optimizer or "adam").split(",")
            if name.strip()
        ]
        if other is not None and optimizer is not None:
            raise ConfigError(
                "--optimizer simulates steps from one checkpoint; two checkpoints are measured as they are"
            )
        a = {k: v.float() for k, v in Checkpoint(checkpoint).items() if v.is_floating_point()}
        console = output_console()
        if other is None and len(specs) > 1:
            with console.status(f"analysing {len(specs)} optimizers"):
                comp = an.compare_optimizers(
                    a,
                    fmts,
                    specs,
                    lr=lr,
                    steps=steps,
                    match=[m.strip() for m in match.split(",") if m.strip()],
                    gradients=gradients,
                )
            for table in an.comparison_tables(comp):
                console.print(table)
            out.mkdir(parents=True, exist_ok=True)
            (out / "optimizers.json").write_text(json.dumps(comp.to_json(), indent=2))
            plot = an.plot_comparison(comp, out / "change_vs_magnitude_by_optimizer.png", f"lr {lr:g}")
            console.print(f"wrote {out / 'optimizers.json'} and {plot}")
            return
        with console.status("analysing"):
            if other is None:
                result = an.simulate(a, fmts, lr=lr, optimizer=specs[0], gradients=gradients)
            else:
                b = {k: v.float() for k, v in Checkpoint(other).items() if v.is_floating_point()}
                check_same_names(a, b)
                result = an.compare(a, b, fmts)
        summary = Table(title="Served values changed, by format")
        for col in ("format", "changed %", "predicted %", "patch", "served", "ratio", "B/changed"):
            summary.add_column(col, justify="left" if col == "format" else "right")
        for s in result.formats:
            predicted = f"{100 * s.predicted_fraction:.3f}" if s.predicted_fraction is not None else "-"
            summary.add_row(
                s.format,
                f"{100 * s.changed_fraction:.3f}",
                predicted,
                _size(s.patch_bytes),
                _size(s.served_bytes),
                f"{s.served_bytes / max(1, s.patch_bytes):.0f}x",
                f"{s.bytes_per_changed:.3f}",
            )
        console.print(summary)
        predicted = any(r.predicted for r in result.tensors)
        per_tensor = Table(
            title=f"Per tensor, % changed (the {top} largest tensors)",
            caption="measured % (in brackets: % predicted by the absorption rule)" if predicted else None,
        )
        per_tensor.add_column("tensor", overflow="fold", min_width=24)
        for f in fmts:
            per_tensor.add_column(f"{f}\n% changed" + (" (predicted)" if predicted else ""), justify="right")
        for r in sorted(result.tensors, key=lambda r: -r.numel)[:top]:
            cells = [
                f"{100 * r.changed[f]:.3f}" + (f" ({100 * r.predicted[f]:.3f})" if f in r.predicted else "")
                for f in fmts
            ]
            per_tensor.add_row(r.name, *cells)
        console.print(per_tensor)
        out.mkdir(parents=True, exist_ok=True)
        (out / "analysis.json").write_text(json.dumps(result.to_json(), indent=2))
        plots = an.plot(result, out)
        console.print(f"wrote {out / 'analysis.json'} and {', '.join(str(p) for p in plots)}")

    _run(go)


def check_same_names(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    if set(a) != set(b) or any(a[k].shape != b[k].shape for k in a):
        raise ConfigError(
            "the two checkpoints hold different tensors or shapes; analyze compares versions of one model"
        )
