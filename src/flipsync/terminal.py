"""What the command lines share: one red line and exit code 1 for a flipsync error, and human-readable sizes."""

from __future__ import annotations

from collections.abc import Callable

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
