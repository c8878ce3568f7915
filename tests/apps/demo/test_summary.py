"""The demo's closing sentences are true of every run: any length (1-12 steps), lags of zero, ties, a control
island that wins. Each sentence is parsed back and checked against the records it was made from."""

from __future__ import annotations

import re
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flipsync_apps.demo.records import CONTROL, DemoConfig, IslandStep, StepRecord, VersionRow
from flipsync_apps.demo.summary import (
    CLEAR,
    bytes_verdict,
    comparison,
    lag_verdict,
    reward_window,
    summarize,
    summary_lines,
)

CHECKPOINT = 40_000_000


@st.composite
def runs(draw: st.DrawFn) -> dict:
    n = draw(st.integers(1, 12))
    flipsync = [f"island-{i}" for i in range(draw(st.integers(1, 3)))]
    names = [*flipsync, CONTROL]
    # bytes per island: small sets of values, so that ties and exact equalities come up
    totals = {name: draw(st.sampled_from([0, 1_000_000, 40_600_000, 42_400_000, 80_000_000])) for name in names}
    rewards = draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]), min_size=n, max_size=n))
    records = [
        StepRecord(
            step=i + 1,
            reward=rewards[i],
            rollouts=9,
            islands={
                name: IslandStep(
                    behind=0,
                    used=3,
                    dropped=draw(st.integers(0, 2)),
                    rollout_lag=None,
                    bytes=totals[name] * (i + 1) // n,
                )
                for name in names
            },
        )
        for i in range(n)
    ]
    # lag samples: each island's held step trails the trainer by 0-2 steps (often 0)
    samples = []
    for t in range(draw(st.integers(0, 30))):
        step = draw(st.integers(0, n))
        held = {name: max(0, step - draw(st.sampled_from([0, 0, 1, 2]))) for name in names}
        samples.append((0.2 * t, step, held))
    versions = draw(st.integers(0, n))
    rows = [VersionRow(0, 1, 0, 0, 1000, CHECKPOINT, CHECKPOINT)]
    rows += [
        VersionRow(v, 1, v, draw(st.integers(0, 1000)), 1000, draw(st.integers(10, 10**6)), CHECKPOINT)
        for v in range(1, versions + 1)
    ]
    return {"records": records, "rows": rows, "samples": samples, "flipsync": flipsync}


def _number(text: str) -> float:
    return float(text.replace(",", ""))


@settings(max_examples=300, deadline=None)
@given(runs(), st.sampled_from(["adam", "muon"]))
def test_every_sentence_is_true_of_its_run(run: dict, optimizer: str) -> None:
    cfg = DemoConfig(optimizer=optimizer)
    s = summarize(run["records"], run["rows"], run["samples"], run["flipsync"], CONTROL, cfg)
    lines = summary_lines(s)  # must not raise, whatever the run
    text = "\n".join(lines)
    last = run["records"][-1].islands
    f_bytes = statistics.fmean(last[n].bytes for n in run["flipsync"])
    c_bytes = last[CONTROL].bytes
    rl = [x for x in run["samples"] if x[1] >= 1]

    def lag(name: str) -> float:
        return statistics.fmean(max(0, step - held[name]) for _, step, held in rl) if rl else 0.0

    f_lag = statistics.fmean(lag(n) for n in run["flipsync"])
    c_lag = lag(CONTROL)

    m = re.search(r"flipsync moved ([\d.,]+)x fewer bytes", text)
    assert bool(m) == (f_bytes > 0 and c_bytes >= CLEAR * f_bytes)
    if m:
        # one decimal below 10x, rounded: a ratio of 1.45 may print 1.4 (binary floats), hence the 1e-9
        assert _number(m.group(1)) == pytest.approx(
            c_bytes / f_bytes, abs=(0.05 if c_bytes < 10 * f_bytes else 0.5) + 1e-9
        )
    m = re.search(r"flipsync moved ([\d.,]+)x more bytes", text)
    assert bool(m) == (c_bytes > 0 and f_bytes >= CLEAR * c_bytes)
    if "about as many bytes" in text:
        assert max(f_bytes, c_bytes) < CLEAR * min(f_bytes, c_bytes)
    assert ("flipsync moved as many bytes" in text) == (f_bytes == c_bytes > 0)
    assert ("the flipsync islands moved no bytes" in text) == (f_bytes == 0 < c_bytes)
    assert ("the full-checkpoint island moved no bytes" in text) == (c_bytes == 0 < f_bytes)

    m = re.search(r"the flipsync islands trailed ([\d.,]+)x less", text)
    assert bool(m) == (f_lag > 0 and c_lag >= CLEAR * f_lag)
    m = re.search(r"the full-checkpoint island trailed ([\d.,]+)x less", text)
    assert bool(m) == (c_lag > 0 and f_lag >= CLEAR * c_lag)
    assert ("the flipsync islands never trailed" in text) == (f_lag == 0 < c_lag)
    assert ("the full-checkpoint island never trailed" in text) == (c_lag == 0 < f_lag)
    assert ("neither trailed" in text) == (f_lag == 0 == c_lag)

    n = len(run["records"])
    rewards = [r.reward for r in run["records"]]
    if n == 1:
        assert f"reward: {rewards[0]:.3f} (one step)" in text
    else:
        m = re.search(r"reward: first (\d+ steps|step) ([\d.]+), last (\d+ steps|step) ([\d.]+) \(([+-][\d.]+)\)", text)
        assert m, text
        k = 1 if m.group(1) == "step" else int(m.group(1).split()[0])
        assert m.group(3) == m.group(1) and 2 * k <= n  # the two windows never overlap
        assert k == reward_window(n) == min(5, n // 2)
        assert _number(m.group(2)) == pytest.approx(statistics.fmean(rewards[:k]), abs=5.001e-4)
        assert _number(m.group(4)) == pytest.approx(statistics.fmean(rewards[-k:]), abs=5.001e-4)
    assert f"{optimizer}, lr " in text
    patches = [r for r in run["rows"] if r.version > 0]
    assert ("no patch" in text) == (not patches)
    assert "1.0x fewer" not in text and "1.0x more" not in text and "1.0x less" not in text


def test_verdicts_at_the_edges() -> None:
    assert bytes_verdict(42.4e6, 40.6e6) == "flipsync moved about as many bytes (within 5%)"  # the reported run
    assert bytes_verdict(40.6e6, 42.4e6) == "flipsync moved about as many bytes (within 5%)"
    assert bytes_verdict(10e6, 40e6) == "flipsync moved 4.0x fewer bytes"
    assert bytes_verdict(40e6, 10e6) == "flipsync moved 4.0x more bytes"
    assert bytes_verdict(1e6, 1e6) == "flipsync moved as many bytes"
    assert lag_verdict(0.4, 0.0) == "the full-checkpoint island never trailed"  # was a ZeroDivisionError
    assert lag_verdict(0.0, 0.0) == "neither trailed"
    assert lag_verdict(0.2, 0.8) == "the flipsync islands trailed 4.0x less"
    assert [reward_window(n) for n in (1, 2, 3, 9, 10, 40)] == [1, 1, 1, 4, 5, 5]


def test_two_runs_side_by_side() -> None:
    from io import StringIO

    from rich.console import Console

    rec = [
        StepRecord(
            i, 0.1 * i, 9, {"island-0": IslandStep(0, 3, 0, None, 10**6), CONTROL: IslandStep(0, 3, 0, None, 4 * 10**7)}
        )
        for i in range(1, 4)
    ]
    rows = [VersionRow(0, 1, 0, 0, 100, 100, 100), VersionRow(1, 1, 1, 5, 100, 70, 100)]
    docs = []
    for opt in ("adam", "muon"):
        cfg = DemoConfig(optimizer=opt)
        summary = summarize(rec, rows, [(0.0, 1, {"island-0": 1, CONTROL: 0})], ["island-0"], CONTROL, cfg)
        docs.append((opt, {"config": {"optimizer": opt, "lr": cfg.lr, "head_lr_scale": 20.0, "model": "m",
                                       "served_format": "bf16"}, "summary": summary}))  # fmt: skip
    console = Console(file=StringIO(), width=120, record=True)
    console.print(comparison(docs))
    out = console.export_text()
    for expected in ("optimizer", "adam", "muon", "reward, last steps", "patch per version kB", "lag (steps)"):
        assert expected in out
