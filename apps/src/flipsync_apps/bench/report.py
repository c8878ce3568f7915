"""Helpers the benchmarks share to write their sections of docs/benchmarks.md: markdown tables and figures."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def md_table(head: Sequence[str], rows: Iterable[Sequence[str]], left: int = 1) -> str:
    """A markdown table; the first ``left`` columns are left-aligned, the rest right-aligned (numbers)."""
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join(":---" if i < left else "---:" for i in range(len(head))) + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class Figures:
    """Where a document's plots go (``directory``), and how the document links them (``prefix``/name)."""

    directory: Path
    prefix: str

    def path(self, name: str) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        return self.directory / name

    def link(self, name: str, alt: str) -> str:
        return f"![{alt}]({self.prefix}/{name})"


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only backend (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, *, top: float = 1.0) -> Path:
    """Lay out, write (110 dpi) and close a figure; ``top`` keeps room above the panels (a shared legend)."""
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path
