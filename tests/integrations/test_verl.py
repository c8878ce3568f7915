"""The flipsync checkpoint engine inside the real verl (0.9.x), run with a separate interpreter that has verl.

verl pins its own transformers, so it lives in its own virtual environment (.ci/run builds
``.ci-verl-venv``). These tests run when ``FLIPSYNC_VERL_PYTHON`` names that interpreter (with flipsync
installed into it); otherwise they skip. Set it up once (about 2 minutes, 2 GB):

    python3.11 -m venv .verl-venv
    .verl-venv/bin/pip install torch==2.13.0 verl==0.9.1 pyzmq
    .verl-venv/bin/pip install torch==2.13.0 -e .
    FLIPSYNC_VERL_PYTHON=.verl-venv/bin/python pytest tests/integrations/test_verl.py

The check (``tests/integrations/verl_check.py``, whose docstring says what is verl's and what stands in for
a GPU) prints one ``RESULT`` line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.result_script import run_result_script

HERE = Path(__file__).parent
PYTHON = os.environ.get("FLIPSYNC_VERL_PYTHON", "")

pytestmark = pytest.mark.skipif(
    not PYTHON,
    reason="set FLIPSYNC_VERL_PYTHON to a Python with verl 0.9 and flipsync installed to run the real verl tests "
    "(see this file's docstring)",
)


def run_check(tmp_path: Path, script: str, *args: str, timeout: int = 600) -> dict:
    python = Path(PYTHON)
    if not python.exists():
        pytest.fail(f"FLIPSYNC_VERL_PYTHON={PYTHON} does not exist")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    src = str(HERE.parent.parent / "src")  # this checkout's flipsync, whatever the venv has installed
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    argv = [str(python), str(HERE / script), str(tmp_path / "work"), *args]
    result = run_result_script(argv, env, tmp_path / "check.log", timeout=timeout, what="verl check")
    sys.stderr.write(f"verl check: {json.dumps(result.get('timings', {}))}\n")
    return result


def test_flipsync_checkpoint_engine_in_real_verl(tmp_path: Path) -> None:
    result = run_check(tmp_path, "verl_check.py")
    failed = [k for k, ok in result["checks"].items() if not ok]
    assert not failed, f"failed checks: {failed}; rows {result['rows']}"
    rows = result["rows"]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows[1:]:
        assert r["changed"] > 0 and r["kind"] == "patch"
        # verl's delta_sharded: int32 positions + raw bf16 values, exactly what its encoder built
        assert r["delta_sharded_bytes"] == 6 * r["changed"]
        assert r["flipsync_bytes"] < r["delta_sharded_bytes"] / 3
        sys.stderr.write(
            f"step {r['step']}: {r['changed']} changed; flipsync {r['flipsync_bytes']} B "
            f"({r['flipsync_bytes'] / r['changed']:.2f} B/value) vs delta_sharded {r['delta_sharded_bytes']} B\n"
        )


def test_the_verl_doc_example_runs(tmp_path: Path) -> None:
    from tests.integrations.doc_examples import run_example

    out = run_example("verl.md", "verl_sync.py", tmp_path, PYTHON, timeout=300)
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert [ln.split(":")[0] for ln in lines] == ["step 0", "step 1", "step 2"], out
    assert lines[0].startswith("step 0: v0, 1 flush(es)") and lines[2].startswith("step 2: v2"), out
