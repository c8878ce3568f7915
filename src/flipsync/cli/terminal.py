"""What the command lines share: one line and an exit code for a flipsync error, one-command apps, server
commands' start, the ``--store-option`` type, and human-readable sizes."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Annotated, ParamSpec, TypeVar

import typer
from rich.console import Console

from flipsync.errors import FlipsyncError


def run_or_exit(fn: Callable[[], None]) -> None:
    """Turn flipsync errors into one red line and exit code 1."""
    try:
        fn()
    except FlipsyncError as e:
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {e}")
        raise typer.Exit(1) from None


P = ParamSpec("P")
R = TypeVar("R")


def server_command(fn: Callable[P, R]) -> Callable[P, R]:
    """A command that serves until a signal (``sidecar``, ``gateway``, ``relay``): no garbage collection while it
    starts; `flipsync.serving.serve_until_signal` freezes the heap and turns collection back on (and it is back
    on, as it was, if the command ends first).

    Why: a start imports torch, transformers and the engine's model, some 700,000 objects that live as long as the
    process, and Python's collector scanned them all again each time they grew by a quarter (1.3 s of a 4.8 s
    torch-engine sidecar start). Frozen, they stay out of every later collection.
    """

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return run


def human_size(n: float) -> str:
    """Bytes in decimal units: ``512 B``, ``1.50 MB``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def command_app(name: str, help: str) -> typer.Typer:
    """An app holding one command for ``python -m`` runs, where the command stays a subcommand (``... relay
    --board B``): Typer runs a lone command as the app itself unless the app has a callback."""
    app = typer.Typer(name=name, help=help, no_args_is_help=True, pretty_exceptions_enable=False)
    app.callback()(lambda: None)
    return app


def command_error(e: FlipsyncError) -> typer.Exit:
    """Say what went wrong in one line and end the command with status 2 (no traceback for a user error)."""
    typer.echo(f"error: {e}", err=True)
    return typer.Exit(2)


# ``flipsync sidecar`` and ``flipsync relay`` read a board the same way.
StoreOpt = Annotated[
    list[str] | None, typer.Option("--store-option", "-o", help="Store setting key=value (endpoint, region, ...)")
]
