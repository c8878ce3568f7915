"""Tiny runs of the crossregion and scaling benchmarks: correctness only, no timings asserted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from flipsync.bench import crossregion, scaling
from flipsync.bench.all import machine, plot_crossregion, versions

RATE = 50e6  # bytes/s: fast enough that the test takes milliseconds per transfer


@pytest.fixture(scope="module")
def versions_small() -> crossregion.Versions:
    return crossregion.prepare(1 << 18)


@pytest.mark.parametrize("n", [1, 3])
def test_patch_replicas_end_at_v1_bitwise(versions_small: crossregion.Versions, n: int) -> None:
    out = crossregion.run_patch(versions_small, n, RATE, timeout_s=30)
    assert out.bitwise
    assert out.wan_bytes >= n * len(versions_small.patch)


def test_relay_carries_the_patch_once_whatever_n(versions_small: crossregion.Versions) -> None:
    patch = len(versions_small.patch)
    wan = []
    for n in (1, 4):
        out = crossregion.run_relay(versions_small, n, RATE, timeout_s=30)
        assert out.bitwise
        wan.append(out.wan_bytes)
    for w in wan:
        assert patch <= w < 1.5 * patch + 8192  # the patch once, plus manifests and HEAD hints
    assert abs(wan[1] - wan[0]) < 0.25 * patch + 4096


def test_full_download_ends_at_v1(versions_small: crossregion.Versions) -> None:
    out = crossregion.run_full(versions_small, 2, RATE, timeout_s=30)
    assert out.bitwise
    assert out.wan_bytes >= 2 * versions_small.view_bytes


def test_dict_engine_rolls_back(versions_small: crossregion.Versions) -> None:
    engine = crossregion.DictEngine(versions_small.v0)
    undo = engine.commit(engine.stage(crossregion.Patch.from_bytes(versions_small.patch)))
    assert engine.table.view_fp() == versions_small.fp1
    engine.rollback(undo)
    assert engine.table.view_fp() == versions_small.fp0
    assert crossregion.same_bits(engine.tensors, versions_small.v0)
    assert engine.recompute_table().view_fp() == versions_small.fp0


def test_scaling_measure_verifies() -> None:
    from flipsync.codec import DiffEngine

    with DiffEngine(threads=1) as engine:
        r = scaling.measure(1_000_000, 1, engine)
    assert r["verified"]
    assert 0.002 < r["changed"] / r["elements"] < 0.004
    assert "| 1,000,000 |" in scaling.markdown({"fraction": scaling.FRACTION, "rows": [r]})


def test_crossregion_markdown_and_plot(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = [
        {
            "bandwidth": "1gbit",
            "replicas": n,
            "patch_s": 0.01,
            "relay_s": 0.02,
            "full_s": 0.1,
            "full_over_patch": 10.0,
            "relay_wan_bytes": 10,
            "bitwise": True,
        }
        for n in (1, 4)
    ]
    result: dict[str, Any] = {
        "view_bytes": 1000,
        "changed": 5,
        "patch_bytes": 10,
        "bytes_per_changed": 2.0,
        "apply_s": 0.001,
        "rows": rows,
    }
    result["extrapolation"] = crossregion.extrapolate(rows, 2.0, 1e-9, 1000)
    text = crossregion.markdown(result)
    assert "| 1gbit | 4 |" in text and "500 GB" in text
    assert plot_crossregion(result, tmp_path / "x.png").stat().st_size > 0
    assert "cores" in machine() and "Python" in versions()


def test_run_quick_tables_print() -> None:
    console = Console(record=True, width=200)
    out = scaling.run(console, quick=True)
    assert all(r["verified"] for r in out["rows"])
