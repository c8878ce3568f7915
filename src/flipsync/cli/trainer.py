"""``flipsync watch`` and ``flipsync publish``: publish Hugging Face checkpoints from a shell.

Plain typer-ready functions; ``flipsync.cli.main`` mounts them with ``app.command("watch")(watch)`` and
``app.command("publish")(publish)``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flipsync.board.cadence import KeyframePolicy
from flipsync.board.signing import Signer
from flipsync.errors import ConfigError, FlipsyncError
from flipsync.formats import FORMAT_NAMES
from flipsync.serving import parse_pairs
from flipsync.stores import StoreOptions, open_store
from flipsync.trainer import watch as watching
from flipsync.trainer.config import PublisherConfig

log = logging.getLogger(__name__)

UrlArg = Annotated[str, typer.Argument(help="Board URL or local path, e.g. s3://bucket/board or ./board")]
RunOpt = Annotated[str | None, typer.Option("--run", "-r", help="Run name (default: a new unique run)")]
FormatOpt = Annotated[str, typer.Option("--format", "-f", help=f"served format: {', '.join(FORMAT_NAMES)}")]
ResumeOpt = Annotated[bool, typer.Option(help="continue an existing run (after the checkpoint its HEAD came from)")]
NewWeightsOpt = Annotated[
    bool,
    typer.Option(
        "--new-weights",
        help="with --resume: replace the run's weights even when the model differs from HEAD's (a snapshot)",
    ),
]
StoreOpt = Annotated[
    list[str] | None,
    typer.Option("--store-option", "-o", help="Store setting key=value (endpoint, region, ...); repeatable"),
]
KeyOpt = Annotated[Path | None, typer.Option("--key", help="Ed25519 private key (PEM) to sign manifests")]
KeyframeOpt = Annotated[
    int, typer.Option(help="write a keyframe at least every N versions (and when the chain grows large)")
]


def _options(key: Path | None, keyframe_every: int, resume: bool, new_weights: bool) -> dict[str, Any]:
    if new_weights and not resume:
        raise ConfigError("--new-weights replaces an existing run's weights: it needs --resume")
    return {
        "new_weights": new_weights,
        "config": PublisherConfig(
            signer=Signer.from_pem(key) if key else None, keyframe_policy=KeyframePolicy(max_interval=keyframe_every)
        ),
    }


def _fail(e: Exception) -> typer.Exit:
    Console(stderr=True).print(f"[bold red]error:[/] {e}")
    return typer.Exit(code=1)


def watch(
    ckpt_dir: Annotated[Path, typer.Argument(help="directory the trainer writes HF safetensors checkpoints to")],
    board_url: UrlArg,
    run: RunOpt = None,
    fmt: FormatOpt = "bf16",
    resume: ResumeOpt = False,
    new_weights: NewWeightsOpt = False,
    poll: Annotated[float, typer.Option(help="seconds between scans")] = 5.0,
    settle: Annotated[float, typer.Option(help="a checkpoint's files must be unchanged this long")] = 10.0,
    once: Annotated[bool, typer.Option(help="publish what is complete now, then exit")] = False,
    max_checkpoints: Annotated[int | None, typer.Option(help="exit after publishing this many")] = None,
    store_option: StoreOpt = None,
    key: KeyOpt = None,
    keyframe_every: KeyframeOpt = 1000,
) -> None:
    """Publish every new complete checkpoint in CKPT_DIR as the next version of a run on BOARD_URL."""
    console = Console(stderr=True)
    status = console.status(f"watching {ckpt_dir}")

    def on_event(kind: str, info: Mapping[str, Any]) -> None:
        if kind == "loading":
            status.update(f"publishing {info['checkpoint']}")
        elif kind == "published":
            console.print(f"{info['checkpoint']} -> run {info['run']} v{info['version']}")
        elif kind == "adopted":
            console.print(f"resumed: HEAD v{info['version']} holds {info['checkpoint']}")
        elif kind == "waiting":
            status.update(f"watching {info['dir']} ({info['published']} published; Ctrl-C to stop)")

    try:
        store = open_store(board_url, StoreOptions(config=parse_pairs(store_option, "store option")))
        with status:
            pub = watching.watch(
                ckpt_dir,
                store,
                run=run,
                format=fmt,
                resume=resume,
                poll_s=poll,
                settle_s=settle,
                once=once,
                max_checkpoints=max_checkpoints,
                on_event=on_event,
                **_options(key, keyframe_every, resume, new_weights),
            )
    except KeyboardInterrupt:
        console.print("stopped")
        return
    except FlipsyncError as e:
        raise _fail(e) from None
    if pub.last is None:
        console.print(f"no complete checkpoint in {ckpt_dir}")


def publish(
    board_url: UrlArg,
    checkpoints: Annotated[
        list[Path], typer.Argument(help="checkpoints (HF directories or .safetensors files), in order")
    ],
    run: RunOpt = None,
    fmt: FormatOpt = "bf16",
    resume: ResumeOpt = False,
    new_weights: NewWeightsOpt = False,
    store_option: StoreOpt = None,
    key: KeyOpt = None,
    keyframe_every: KeyframeOpt = 1000,
) -> None:
    """Publish CHECKPOINTS, in order, as consecutive versions of a run on BOARD_URL (the first: a snapshot)."""
    console = Console(stderr=True)
    try:
        found = [watching.complete_checkpoint(p) for p in checkpoints]
        store = open_store(board_url, StoreOptions(config=parse_pairs(store_option, "store option")))
        options = _options(key, keyframe_every, resume, new_weights)
        pub = watching.CheckpointPublisher(store, run=run, format=fmt, resume=resume, **options)
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as progress:
            task = progress.add_task("publishing", total=len(found))
            try:
                for ckpt in found:
                    progress.update(task, description=f"publishing {ckpt.name}")
                    head = pub.publish(ckpt)
                    progress.console.print(f"{ckpt.path} -> run {pub.run} v{head}")
                    progress.advance(task)
            finally:
                pub.close()
    except FlipsyncError as e:
        raise _fail(e) from None
