"""Run a check script under another interpreter (vLLM's or verl's venv) and read its one ``RESULT`` line."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest


def run_result_script(
    argv: Sequence[str], env: Mapping[str, str], log: Path, *, timeout: int, what: str
) -> dict[str, Any]:
    """``argv`` with its output in ``log``; the JSON of its last ``RESULT`` line, or a test failure with the
    log's tail."""
    with open(log, "w") as out:
        try:
            proc = subprocess.run(
                list(argv), stdout=out, stderr=subprocess.STDOUT, env=dict(env), timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"the {what} ran past {timeout}s; its log: {log}")
    text = log.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        tail = "\n".join(text.splitlines()[-40:])
        pytest.fail(f"the {what} exited {proc.returncode} without a result:\n{tail}")
    return json.loads(lines[-1][len("RESULT ") :])
