"""The ``# example: NAME.py`` python blocks of docs/integrations/*.md, written to files and run as they are."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "integrations"


def examples(page: str) -> dict[str, str]:
    """Every ``# example: NAME`` python block of ``page``, by NAME."""
    out = {}
    for body in re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S):
        first = body.splitlines()[0]
        if first.startswith("# example: "):
            out[first.removeprefix("# example: ").split()[0]] = body
    return out


def run_example(page: str, name: str, where: Path, python: str, *, timeout: int = 600) -> str:
    """Write every example of ``page`` into ``where`` (so one may import another), run ``name``, return stdout."""
    where.mkdir(parents=True, exist_ok=True)
    for n, body in examples(page).items():
        (where / n).write_text(body)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), str(where), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [python, name], cwd=where, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, (
        f"{page} {name} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout
