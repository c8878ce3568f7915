"""``flipsync bench NAME``: the benchmarks from a shell, one command per module (``flipsync bench --help``).

``bench_app`` is a Typer sub-application; ``flipsync.cli.main`` mounts it as ``flipsync bench``. Each benchmark
module is imported when its command runs, so ``flipsync --help`` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from flipsync.cli.board import output_console
from flipsync.cli.terminal import run_or_exit as _run

bench_app = typer.Typer(help="Benchmarks: every comparison runs side by side in one process.", no_args_is_help=True)


@bench_app.command("codec")
def bench_codec(
    quick: Annotated[bool, typer.Option(help="a small workload that runs in seconds")] = False,
    markdown: Annotated[Path | None, typer.Option(help="also write the table as markdown here")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the rows as JSON here")] = None,
) -> None:
    """Our patch beside the encodings slime, TRL, vLLM and verl ship, on the same Adam (and Muon) steps."""
    from flipsync_apps.bench import codec, codec_markdown

    console = Console()  # its tables fit 100 columns; the full ones go to --markdown and --json
    report = codec.run(console, quick=quick)
    if markdown:
        markdown.write_text(codec_markdown.markdown(report))
    if json_out:
        json_out.write_text(json.dumps(codec_markdown.as_dict(report), indent=2))


def _bench(module: str, quick: bool, json_out: Path | None) -> None:
    """Run ``flipsync_apps.bench.<module>.run`` and optionally save its numbers."""
    import importlib

    bench = importlib.import_module(f"flipsync_apps.bench.{module}")
    results = bench.run(Console(width=max(160, Console().width)), quick=quick)
    if json_out:
        json_out.write_text(json.dumps(results, indent=2, default=str))


QuickOpt = Annotated[bool, typer.Option(help="a small workload that runs in seconds")]
JsonOpt = Annotated[Path | None, typer.Option("--json", help="also write the numbers as JSON here")]


@bench_app.command("board")
def bench_board(quick: QuickOpt = False, json_out: JsonOpt = None) -> None:
    """Publish and catch-up throughput (local S3 server, filesystem); bytes to catch up k versions."""
    _run(lambda: _bench("board", quick, json_out))


@bench_app.command("sidecar")
def bench_sidecar(quick: QuickOpt = False, json_out: JsonOpt = None) -> None:
    """Engine pause per commit and stage time against patch size (torch engine)."""
    _run(lambda: _bench("sidecar", quick, json_out))


@bench_app.command("trainer")
def bench_trainer(quick: QuickOpt = False, json_out: JsonOpt = None) -> None:
    """Time the publisher adds to a training step, and its peak extra memory."""
    _run(lambda: _bench("trainer", quick, json_out))


@bench_app.command("fused")
def bench_fused(quick: QuickOpt = False, json_out: JsonOpt = None) -> None:
    """The publisher's one-pass cast-and-diff pass beside a torch cast + np.flatnonzero, per served byte."""
    _run(lambda: _bench("fused", quick, json_out))


@bench_app.command("crossregion")
def bench_crossregion(quick: QuickOpt = False, json_out: JsonOpt = None) -> None:
    """Publish -> last replica verified over limited links: patches, patches via a relay, full checkpoints."""
    _run(lambda: _bench("crossregion", quick, json_out))


@bench_app.command("verl")
def bench_verl(quick: QuickOpt = False, json_out: JsonOpt = None) -> None:
    """Bytes per weight sync: flipsync's verl checkpoint engine beside verl's delta_sharded wire."""
    _run(lambda: _bench("verl", quick, json_out))


@bench_app.command("scaling")
def bench_scaling(quick: QuickOpt = False, json_out: JsonOpt = None) -> None:
    """Diff, encode, decode, apply and fingerprint cost as one tensor grows."""
    _run(lambda: _bench("scaling", quick, json_out))


@bench_app.command("optimizers")
def bench_optimizers(
    quick: QuickOpt = False,
    json_out: JsonOpt = None,
    out: Annotated[Path | None, typer.Option("--output", "-o", help="folder for the PNG plots and their JSON")] = None,
) -> None:
    """Adam against Muon (same lr, matched update RMS): served change per step, by tensor kind and |w|; patch bytes."""

    def go() -> None:
        from flipsync_apps.bench import optimizers

        results = optimizers.run(Console(), quick=quick, out=out)
        if json_out:
            json_out.write_text(json.dumps(results, indent=2, default=str))

    _run(go)


@bench_app.command("formats")
def bench_formats(quick: QuickOpt = False, json_out: JsonOpt = None) -> None:
    """What each extra served format costs a trainer that publishes several (BF16, FP8, NVFP4)."""
    _run(lambda: _bench("formats", quick, json_out))


@bench_app.command("gateway")
def bench_gateway(quick: QuickOpt = False, json_out: JsonOpt = None) -> None:
    """The gateway's added latency against direct requests, and fleet membership at 1,000 replicas on S3."""
    _run(lambda: _bench("gateway", quick, json_out))


@bench_app.command("ray")
def bench_ray(quick: QuickOpt = False, json_out: JsonOpt = None) -> None:
    """A Ray fleet on a 3-node local cluster: scale to in rotation, and replacement after a node loss."""
    _run(lambda: _bench("ray_join", quick, json_out))


@bench_app.command("all")
def bench_all(
    quick: QuickOpt = False,
    out: Annotated[
        Path, typer.Option("--output", "-o", help="markdown file to write; its plots go to the folder of its stem")
    ] = Path("docs/benchmarks.md"),
) -> None:
    """Every benchmark, written up as docs/benchmarks.md (tables, targets, PNG plots in docs/benchmarks/)."""
    import shlex
    import sys

    from flipsync_apps.bench.all import run_all

    def go() -> None:
        args = sys.argv[1:]
        if args[:2] != ["bench", "all"]:  # called in-process (tests): the equivalent command line
            args = ["bench", "all", *(["--quick"] if quick else []), "-o", str(out)]
        command = shlex.join(["flipsync", *args])
        text = run_all(Console(width=max(200, Console().width)), quick=quick, out=out, command=command)
        out.write_text(text)
        output_console().print(f"wrote {out} and its plots in {out.parent / out.stem}/")

    _run(go)
