"""Tiny runs of the benchmarks and of ``flipsync bench all --quick``: correctness and output only, no timings."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flipsync.cli.main import app
from flipsync.formats import served_view
from flipsync_apps.bench import board, codec, fused, gateway, scaling, sidecar, trainer
from flipsync_apps.bench import verl as verl_bench
from flipsync_apps.bench.all import machine, versions
from flipsync_apps.bench.crossregion import measure, race
from flipsync_apps.bench.crossregion.costs import CostModel, extrapolate, fit_line
from flipsync_apps.bench.crossregion.trained import FMT, Trained, same_bits
from flipsync_apps.synthetic import Shape

RATE = 50e6  # bytes/s: fast enough that the test takes milliseconds per transfer


@pytest.fixture(scope="module")
def trained() -> Trained:
    return Trained(1 << 18, 1e-6, warmup=2)


def test_trained_step_is_the_same_every_time(trained: Trained) -> None:
    params, opt = trained.fresh()
    trained.step(params, opt)
    view = served_view({k: p.detach() for k, p in params.items()}, FMT)
    assert same_bits(view, trained.v1)
    assert 0 < trained.changed < trained.elements


@pytest.mark.parametrize("method", race.METHODS)
@pytest.mark.parametrize("n", [1, 3])
def test_every_method_ends_at_v1_bitwise(trained: Trained, method: str, n: int) -> None:
    out = race.run_method(method, trained, n, RATE, timeout_s=60)
    assert out.bitwise
    assert 0 <= out.publish_s <= out.seconds
    if method == "patch":
        assert out.wan_bytes >= n * len(trained.patch)
    elif method == "relay":  # the patch once, plus manifests and HEAD hints, whatever n
        assert len(trained.patch) <= out.wan_bytes < 1.5 * len(trained.patch) + 8192
    else:
        assert out.wan_bytes >= n * trained.view_bytes


def test_a_patch_uploaded_whole_and_read_after_its_manifest_ends_at_v1_too(trained: Trained) -> None:
    out = race.run_method("patch", trained, 2, RATE, timeout_s=60, stream=False)
    assert out.bitwise and out.wan_bytes >= 2 * len(trained.patch)


def test_cost_model_adds_its_terms() -> None:
    m = CostModel(
        trainer_patch_s_per_byte=1e-9,
        trainer_full_s_per_byte=2e-9,
        trainer_patch_fixed_s=0.5,
        trainer_full_fixed_s=0.25,
        receiver_s_per_change=1e-7,
        receiver_full_s_per_byte=1e-9,
        fixed_s=0.01,
        relay_fixed_s=0.02,
        cores=2,
    )
    patch = m.predict("patch", 1, 1e8, view_bytes=1e9, changed=1e7, patch_bytes=1e7)
    assert patch == pytest.approx(0.5 + 1.0 + 0.01 + 0.1 + 1.0)
    assert m.predict("patch", 4, 1e8, 1e9, 1e7, 1e7) == pytest.approx(patch + 1.0)  # 4 replicas on 2 cores
    assert m.predict("relay", 1, 1e8, 1e9, 1e7, 1e7) == pytest.approx(patch + 0.01)
    assert m.predict("full", 1, 1e8, 1e9, 1e7, 1e7) == pytest.approx(0.25 + 2.0 + 0.01 + 10.0 + 1.0)
    sharded = m.predict("patch", 1, 1e8, 1e9, 1e7, 1e7, trainer_shards=10, receiver_cores=10)
    assert sharded == pytest.approx(0.5 + 0.1 + 0.01 + 0.1 + 0.1)
    # Streamed: the transfer overlaps the trainer. Trainer-bound, the last chunk still crosses after it ...
    streamed = m.predict("patch", 1, 1e8, 1e9, 1e7, 1e7, chunk_bytes=1e6)
    assert streamed == pytest.approx(0.5 + (1.0 + 0.01) + 0.01 + 1.0)
    # ... and wire-bound, the wire starts once the first chunk is coded (a tenth of the part: 0.1 s).
    slow = m.predict("patch", 1, 1e6, 1e9, 1e7, 1e7, chunk_bytes=1e6)
    assert slow == pytest.approx(0.5 + (0.1 + 10.0) + 0.01 + 1.0)
    assert slow < m.predict("patch", 1, 1e6, 1e9, 1e7, 1e7)
    e = extrapolate(m, ("1gbit",), 0.02, 1.1, "a test")
    row = e["rows"][0]
    assert row["parallel"]["ratio"] > row["single"]["ratio"] > 1
    assert row["wire_ratio"] == pytest.approx(500e9 / (1.1 * 0.02 * 250e9))


def test_line_through_two_points() -> None:
    assert fit_line((1.0, 3.0), (3.0, 7.0)) == pytest.approx((1.0, 2.0))
    assert fit_line((1.0, 3.0), (3.0, 2.0)) == pytest.approx((2.0, 0.0))  # noise: no negative slope
    assert fit_line((1.0, 3.0), (2.0, 8.0)) == pytest.approx((0.0, 4.0))  # no negative fixed part


def test_scaling_measure_verifies() -> None:
    from flipsync.codec import DiffEngine

    with DiffEngine(threads=1) as engine:
        r = scaling.measure(1_000_000, 1, engine)
    assert r["verified"]
    assert 0.002 < r["changed"] / r["elements"] < 0.004
    assert "| 1,000,000 |" in scaling.markdown({"fraction": scaling.FRACTION, "rows": [r], "skipped": []})


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrink every --quick setup so that ``bench all --quick`` runs in seconds under test."""
    monkeypatch.setattr(codec, "QUICK", Shape(hidden=64, intermediate=128, layers=1, vocab=256))
    monkeypatch.setattr(codec, "QUICK_REAL_PARAMS", 0)
    monkeypatch.setattr(codec, "BENCH_FORMATS", ("bf16", "nvfp4"))
    monkeypatch.setattr(measure, "QUICK", measure.Setup(1 << 16, (1, 2), ("1gbit",), repeats=1))
    monkeypatch.setattr(sidecar, "QUICK", sidecar.Setup("tiny", (1e-3, 1e-2), repeat=1, formats=("bf16",)))
    monkeypatch.setattr(scaling, "QUICK", scaling.Setup((200_000, 400_000), repeat=1))
    monkeypatch.setattr(
        board,
        "QUICK",
        board.Setup(patch_mib=0.25, patches=2, params=100_000, change=0.02, hot=0.25, versions=16, behind=(1, 4)),
    )
    monkeypatch.setattr(fused, "QUICK", Shape(hidden=64, intermediate=128, layers=1, vocab=256))
    monkeypatch.setattr(verl_bench, "QUICK", Shape(hidden=64, intermediate=128, layers=1, vocab=256))
    monkeypatch.setattr(
        trainer,
        "QUICK",
        trainer.Setup(hidden=32, intermediate=64, layers=1, vocab=128, seq=16, batch=2, rounds=2, block=2),
    )
    monkeypatch.setattr(gateway, "QUICK", gateway.Setup(pairs=4, warmup=1, replicas=12, rate_seconds=0.2, streams=50))


def test_bench_all_quick_writes_the_document(tiny: None, tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["bench", "all", "--quick", "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert f"Command: `flipsync bench all --quick -o {out}`" in text
    assert "Machine: " in text and "Versions: Python" in text and "Date: " in text
    for heading in (
        "## Targets",
        "## Codec",
        "## Cross-region",
        "## Engine pause",
        "## Scaling",
        "## Board",
        "## Trainer",
        "## Trainer: the one-pass cast-and-diff pass",
        "## verl: bytes per weight sync against delta_sharded",
        "## Fleet: the gateway",
        "## Trainer: each extra served format",
    ):
        assert heading in text
    for header in (
        "| target | result | figure |",
        "| workload | optimizer | format | lr | changed % | bound B/chg | conditional bound B/chg | flipsync B/chg |",
        "| workload | optimizer | format | lr | changed % | flipsync B/chg | slime 0.4.0 / miles xor+zstd-1",
        "| link | N | patch | model |",
        "| part | measured | model | bitwise |",
        "| component | cost | covers |",
        "| changed values | of view | patch |",
        "| elements | bytes | changed |",
        "| store | publish MB/s |",
        "| setup | median step |",
        "| format | threads | served | changed | fused ns/B |",
        "| workload | step | changed % | flipsync bytes |",
        "| request | until | direct p50 |",
        "| formats | s per step | ns per master byte |",
        "| scan | seconds | live records | GETs | LIST pages |",
    ):
        assert header in text
    assert "```json" not in text  # tables only
    assert "the memory floor allows at most bf16 1 thread(s)" in text  # the fused target says what bandwidth allows
    plots = sorted(p.name for p in (tmp_path / "benchmarks").iterdir())
    assert plots == ["codec-bytes-per-change.png", "crossregion.png", "engine-pause.png", "scaling.png"]
    for name in plots:
        assert f"](benchmarks/{name})" in text
        assert (tmp_path / "benchmarks" / name).stat().st_size > 1000


def test_machine_and_versions() -> None:
    assert "cores" in machine() and "Python" in versions()
