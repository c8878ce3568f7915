"""The ``flipsync`` command line."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from flipsync.board.cli import board_app, keygen, output_console
from flipsync.board.throttle import parse_bandwidth
from flipsync.checkpoint import Checkpoint, save_checkpoint
from flipsync.codec import FingerprintTable, Patch, apply_patch, diff_views, squash
from flipsync.codec.bits import dtype_of
from flipsync.codec.patch import DEFAULT_MAX_DECODED_BYTES
from flipsync.domain.patch import ViewRef
from flipsync.errors import BaseMismatchError, ConfigError, FlipsyncError, PatchError
from flipsync.formats import FORMAT_NAMES, get_format, served_view
from flipsync.sidecar.cli import relay, sidecar
from flipsync.trainer.cli import publish as publish_cmd
from flipsync.trainer.cli import watch as watch_cmd

log = logging.getLogger("flipsync")
app = typer.Typer(
    name="flipsync",
    help="Ship small lossless patches of an RL policy's served weights instead of checkpoints.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks: every comparison runs side by side in one process.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


CODEC_DTYPES = "bf16, fp16, fp32, fp64, fp8 (e4m3, e5m2, e8m0), int8 to int64, uint8 and bool tensors"


class InputKind(StrEnum):
    auto = "auto"
    master = "master"
    served = "served"


class PatchMode(StrEnum):
    step = "step"
    overwrite = "overwrite"


class VerifyMode(StrEnum):
    fingerprint = "fingerprint"
    digest = "digest"


def _format_name(value: str | None) -> str | None:
    """The canonical name of a served format ('BF16' -> 'bf16'); an unknown name passes through, to be refused
    with the list of valid names inside the command."""
    if value is None:
        return None
    try:
        return get_format(value).name
    except FlipsyncError:
        return value


FormatOpt = Annotated[
    str, typer.Option("--format", "-f", help=f"served format: {', '.join(FORMAT_NAMES)}", callback=_format_name)
]
InputOpt = Annotated[
    InputKind,
    typer.Option(
        help="are the checkpoints master weights (quantized first) or served views? auto: masters "
        "if any tensor named *weight is float32/float64"
    ),
]


@app.callback()
def _main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="log progress details")] = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=Console(stderr=True), show_path=False)],
    )


def _is_master(tensors: Mapping[str, torch.Tensor]) -> bool:
    return any(n.endswith("weight") and tensors[n].dtype in (torch.float32, torch.float64) for n in tensors)


def _served(path: Path, fmt: str | None, kind: InputKind, *, from_fp32: bool = False) -> dict[str, torch.Tensor]:
    """Load a checkpoint and return its served view (quantizing masters by ``fmt``)."""
    ckpt = Checkpoint(path)
    tensors = {name: ckpt[name] for name in ckpt}
    master = _is_master(tensors) if kind is InputKind.auto else kind is InputKind.master
    if not master:
        _check_dtypes(path, tensors)
        return tensors
    if fmt is None:
        raise ConfigError(f"{path} holds master weights: say which served format to quantize them to (--format)")
    log.info("quantizing %s to %s", path, fmt)
    return served_view(tensors, fmt, from_fp32=from_fp32)


def _check_dtypes(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Name the tensor the codec cannot hold here, where the user can still act on the checkpoint."""
    for name, t in tensors.items():
        try:
            dtype_of(t)
        except PatchError:
            raise ConfigError(
                f"{path}: tensor {name!r} is {t.dtype}, which flipsync cannot patch (it patches {CODEC_DTYPES}); "
                "convert it or leave it out of the checkpoint"
            ) from None


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _view_bytes(view: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in view.values())


def _run(fn: Callable[[], None]) -> None:
    """Turn flipsync errors into one red line and exit code 1."""
    try:
        fn()
    except FlipsyncError as e:
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {e}")
        raise typer.Exit(1) from None


@app.command()
def view(
    master: Annotated[Path, typer.Argument(help="master checkpoint: a .safetensors file or an HF directory")],
    fmt: FormatOpt,
    out: Annotated[Path, typer.Option("--output", "-o", help="a .safetensors file or a directory (sharded)")],
    from_fp32: Annotated[bool, typer.Option(help="quantize fp32 masters directly, not bf16(master)")] = False,
) -> None:
    """Write the served view of a master checkpoint in checkpoint format (payloads and scales)."""

    def go() -> None:
        served = _served(master, fmt, InputKind.master, from_fp32=from_fp32)
        save_checkpoint(served, out, metadata={"flipsync_format": fmt})
        output_console().print(f"wrote the {fmt} served view of {master} to {out} ({_size(_view_bytes(served))})")

    _run(go)


@app.command()
def diff(
    old: Annotated[Path, typer.Argument(help="old checkpoint (masters or served view)")],
    new: Annotated[Path, typer.Argument(help="new checkpoint (masters or served view)")],
    out: Annotated[Path, typer.Option("--output", "-o", help="patch file to write")],
    fmt: Annotated[
        str | None, typer.Option("--format", "-f", help="served format of master inputs", callback=_format_name)
    ] = None,
    input_kind: InputOpt = InputKind.auto,
    mode: Annotated[
        PatchMode, typer.Option(help="step: smallest; overwrite: raw new values, idempotent")
    ] = PatchMode.step,
    base_version: Annotated[int | None, typer.Option(help="version number of OLD")] = None,
    target_version: Annotated[int | None, typer.Option(help="version number of NEW")] = None,
) -> None:
    """Write the lossless patch that turns OLD's served view into NEW's, bit for bit."""

    def go() -> None:
        a, b = _served(old, fmt, input_kind), _served(new, fmt, input_kind)
        with Progress(
            TextColumn("diff"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as progress:
            task = progress.add_task("diff", total=len(a))
            patch, _ = diff_views(
                a,
                b,
                mode="raw" if mode is PatchMode.overwrite else "step",
                base_version=base_version,
                target_version=target_version,
                served_format=fmt,
                progress=lambda _n, _b: progress.advance(task),
            )
        data = patch.to_bytes()
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(out)
        n = patch.header.n_changed
        total = sum(t.numel() for t in b.values())
        full = _view_bytes(b)
        output_console().print(
            f"{out}: {n:,} of {total:,} values changed ({100 * n / max(1, total):.3f}%), "
            f"{_size(len(data))} vs {_size(full)} served ({full / max(1, len(data)):.0f}x smaller), "
            f"{len(data) / max(1, n):.3f} bytes per changed value"
        )

    _run(go)


@app.command()
def apply(
    base: Annotated[Path, typer.Argument(help="the patch's base: its served view, or masters (quantized first)")],
    patch_path: Annotated[Path, typer.Argument(metavar="PATCH", help="patch file")],
    out: Annotated[Path, typer.Option("--output", "-o", help="where to write the patched served view")],
    fmt: Annotated[
        str | None, typer.Option("--format", "-f", help="served format (default: the patch's)", callback=_format_name)
    ] = None,
    input_kind: InputOpt = InputKind.auto,
    verify: Annotated[
        VerifyMode, typer.Option(help="check fingerprints only, or also content digests")
    ] = VerifyMode.digest,
) -> None:
    """Apply PATCH to BASE and write the result; refuses a wrong base, verifies the target."""

    def go() -> None:
        patch = Patch.load(patch_path)
        made_for = patch.header.served_format
        if fmt is not None and made_for is not None and get_format(fmt).name != get_format(made_for).name:
            raise ConfigError(
                f"{patch_path} holds {made_for} served values, but --format {fmt} was given: "
                f"leave --format out (the patch's format is used) or pass --format {made_for}"
            )
        tensors = _served(base, fmt or made_for, input_kind)
        tensors = {k: v.clone() for k, v in tensors.items()}
        table = FingerprintTable.of(tensors)
        held = table.view_fp()
        try:
            result = apply_patch(tensors, patch, table, verify=verify.value)
        except BaseMismatchError as e:
            advice = (
                "pass the checkpoint the patch was diffed from (OLD of `flipsync diff OLD NEW`), its served view, "
                "or the output of applying the patches before this one"
            )
            wanted = patch.header.base.view
            if held != wanted and str(e).startswith("this patch applies to view"):
                # the layouts fit but the values differ: said in files, not in board versions and keyframes
                raise BaseMismatchError(
                    f"{base} is not the base {patch_path} was made from: it holds served view {held}, the patch "
                    f"applies to view {wanted}; {advice}"
                ) from None
            raise BaseMismatchError(f"{e} ({base} is not the base {patch_path} was made from: {advice})") from None
        save_checkpoint(tensors, out, metadata={"flipsync_view": table.view_fp()})
        output_console().print(
            f"applied {result.n_changed:,} changes to {len(patch)} tensors; {out} holds view {table.view_fp()} "
            f"(verified by {verify.value})"
        )

    _run(go)


@app.command("squash")
def squash_cmd(
    patches: Annotated[list[Path], typer.Argument(help="patches v->v+1, ..., v+k-1->v+k, in order")],
    out: Annotated[Path, typer.Option("--output", "-o", help="patch file to write")],
    max_decoded_gib: Annotated[
        float,
        typer.Option(help="refuse patches whose declared changes take more memory than this once decoded"),
    ] = DEFAULT_MAX_DECODED_BYTES / (1 << 30),
) -> None:
    """Merge a chain of patches into one patch from the first base to the last target."""

    def go() -> None:
        loaded = [Patch.load(p) for p in patches]
        merged = squash(loaded, max_decoded_bytes=int(max_decoded_gib * (1 << 30)))
        data = merged.to_bytes()
        out.write_bytes(data)
        before = sum(len(p.to_bytes()) for p in loaded)
        output_console().print(f"{out}: {len(loaded)} patches, {_size(before)} -> {_size(len(data))}")

    _run(go)


@app.command()
def inspect(
    patch_path: Annotated[Path, typer.Argument(metavar="PATCH", help="patch file")],
    as_json: Annotated[bool, typer.Option("--json", help="print the header as JSON")] = False,
) -> None:
    """Summarise a patch: tensors, changed fraction, bytes per changed value, codecs."""

    def go() -> None:
        patch = Patch.load(patch_path)
        h = patch.header
        if as_json:
            typer.echo(json.dumps(json.loads(h.to_json()), indent=2))
            return

        def end(ref: ViewRef) -> str:
            return f"v{ref.version}" if ref.version is not None else ref.view[:12]

        t = Table(title=f"{patch_path}: {end(h.base)} -> {end(h.target)} ({h.served_format or 'served view'})")
        t.add_column("tensor", overflow="fold", min_width=24)
        # one header per cell: positions and value steps have a codec each
        for col in ("dtype", "shape", "changed", "%", "bytes", "B/chg", "pos codec", "value codec", "mode"):
            t.add_column(
                col, no_wrap=True, justify="left" if col in ("dtype", "pos codec", "value codec", "mode") else "right"
            )
        for s in h.sections:
            nbytes = patch.section_bytes(s.name)
            t.add_row(
                s.name,
                s.dtype,
                "x".join(map(str, s.shape)),
                f"{s.n:,}",
                f"{100 * s.n / max(1, s.numel):.3f}",
                f"{nbytes:,}",
                f"{nbytes / s.n:.3f}",
                str(s.pos.get("codec")),
                str(s.val.get("codec")),
                s.mode,
            )
        console = output_console()
        console.print(t)
        size = patch_path.stat().st_size
        console.print(
            f"base view {h.base.view}, target view {h.target.view}; {len(h.sections)} tensors changed, "
            f"{h.n_changed:,} values, {size:,} bytes ({size / max(1, h.n_changed):.3f} per changed value)"
        )

    _run(go)


@app.command()
def demo(
    steps: Annotated[int, typer.Option(help="RL steps")] = 30,
    fmt: Annotated[
        str, typer.Option("--format", "-f", help="served format the islands hold", callback=_format_name)
    ] = "bf16",
    lr: Annotated[float, typer.Option(help="Adam learning rate of the RL steps")] = 3e-5,
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
    max_staleness: Annotated[int, typer.Option(help="drop rollouts more than this many trainer steps old")] = 1,
    model: Annotated[str, typer.Option(help="demo model: llama-20m (40 MB in bf16) or llama-1m")] = "llama-20m",
    warm_start: Annotated[int, typer.Option(help="supervised steps before RL, so rewards have room to move")] = 60,
    prompts: Annotated[int, typer.Option(help="prompts per RL step (each sampled --group times)")] = 6,
    group: Annotated[int, typer.Option(help="samples per prompt (GRPO group)")] = 4,
    out: Annotated[Path, typer.Option("--output", "-o", help="folder for the board, report and plots")] = Path(
        "flipsync-demo"
    ),
    seed: Annotated[int, typer.Option(help="seed of the model, task and sampling")] = 0,
) -> None:
    """A small RL run on this CPU: a trainer publishes every step; flipsync islands follow the board and roll
    out, beside a control island that reloads full checkpoints over the same link."""

    def go() -> None:
        # Checked before the imports and the warm start, which take a minute, so a typo fails at once.
        get_format(fmt)
        if bandwidth.lower() != "none":
            parse_bandwidth(bandwidth)
        from flipsync.demo.run import DemoConfig, run_demo, summary_lines, write_outputs

        cfg = DemoConfig(
            steps=steps,
            served_format=fmt,
            lr=lr,
            islands=islands,
            control=control,
            engine=engine,
            bandwidth=None if bandwidth.lower() == "none" else bandwidth,
            max_staleness=max_staleness,
            model=model,
            warm_start_steps=warm_start,
            prompts_per_step=prompts,
            group_size=group,
            seed=seed,
            out=out,
        )
        console = output_console()
        report = run_demo(cfg, console)
        paths = write_outputs(report, out)
        console.print()
        for line in summary_lines(report):
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


@app.command()
def analyze(
    checkpoint: Annotated[Path, typer.Argument(help="master checkpoint (a .safetensors file or an HF directory)")],
    other: Annotated[Path | None, typer.Argument(help="a second checkpoint: measure the change between them")] = None,
    formats: Annotated[str, typer.Option(help="comma-separated served formats")] = ",".join(FORMAT_NAMES),
    lr: Annotated[float, typer.Option(help="with one checkpoint: Adam learning rate of the simulated step")] = 1e-6,
    out: Annotated[Path, typer.Option("--output", "-o", help="folder for the JSON report and PNG plots")] = Path(
        "flipsync-analysis"
    ),
    top: Annotated[int, typer.Option(help="tensors shown in the per-tensor table (largest first)")] = 20,
) -> None:
    """How many served values change, per tensor and format, and where (by |w|).

    With two checkpoints: measured. With one: a simulated Adam step, predicted by the absorption rule
    (a step changes a served value with probability min(1, |step| / grid spacing)) next to the measurement.
    """
    from flipsync import analyze as an

    def go() -> None:
        fmts = [f.strip() for f in formats.split(",") if f.strip()]
        a = {k: v.float() for k, v in Checkpoint(checkpoint).items() if v.is_floating_point()}
        console = output_console()
        with console.status("analysing"):
            if other is None:
                result = an.simulate(a, fmts, lr=lr)
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


@bench_app.command("codec")
def bench_codec(
    quick: Annotated[bool, typer.Option(help="a small workload that runs in seconds")] = False,
    markdown: Annotated[Path | None, typer.Option(help="also write the table as markdown here")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="also write the rows as JSON here")] = None,
) -> None:
    """Our codec beside XOR+zstd-1, int32+values and int64+values, on the same Adam steps."""
    from flipsync.bench import codec

    console = Console(width=max(200, Console().width))
    report = codec.run(console, quick=quick)
    if markdown:
        markdown.write_text(codec.markdown(report))
    if json_out:
        json_out.write_text(json.dumps(codec.as_dict(report), indent=2))


def _bench(module: str, quick: bool, json_out: Path | None) -> None:
    """Run ``flipsync.bench.<module>.run`` and optionally save its numbers."""
    import importlib

    bench = importlib.import_module(f"flipsync.bench.{module}")
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


@bench_app.command("crossregion")
def bench_crossregion(quick: QuickOpt = False, json_out: JsonOpt = None) -> None:
    """Publish -> last replica verified over limited links: patches, patches via a relay, full checkpoints."""
    _run(lambda: _bench("crossregion", quick, json_out))


@bench_app.command("scaling")
def bench_scaling(quick: QuickOpt = False, json_out: JsonOpt = None) -> None:
    """Diff, encode, decode, apply and fingerprint cost as one tensor grows."""
    _run(lambda: _bench("scaling", quick, json_out))


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

    from flipsync.bench.all import run_all

    def go() -> None:
        args = sys.argv[1:]
        if args[:2] != ["bench", "all"]:  # called in-process (tests): the equivalent command line
            args = ["bench", "all", *(["--quick"] if quick else []), "-o", str(out)]
        command = shlex.join(["flipsync", *args])
        text = run_all(Console(width=max(200, Console().width)), quick=quick, out=out, command=command)
        out.write_text(text)
        output_console().print(f"wrote {out} and its plots in {out.parent / out.stem}/")

    _run(go)


app.add_typer(board_app, name="board")
app.command("keygen")(keygen)
app.command("sidecar")(sidecar)
app.command("relay")(relay)
app.command("watch")(watch_cmd)
app.command("publish")(publish_cmd)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
