"""What the command lines share: one line and an exit code for a flipsync error, one-command apps, the
``--store-option`` type, and human-readable sizes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated

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
