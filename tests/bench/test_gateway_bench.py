"""``flipsync bench gateway`` on a tiny setup: both paths measured, the membership scans counted, and the S3
arithmetic of heartbeats (no timings asserted)."""

from __future__ import annotations

import pytest
from rich.console import Console

from flipsync.bench import gateway


def test_the_s3_arithmetic() -> None:
    c = gateway.s3_costs(1000)
    assert (c["interval_s"], c["ttl_s"], c["refresh_s"]) == (5.0, 15.0, 1.0)  # the defaults it prices
    assert c["puts_per_s"] == 200 and c["puts_per_h"] == 720_000
    assert c["put_usd_per_h"] == pytest.approx(720 * 0.005)
    assert c["gateway_gets_per_s"] == 200 and c["gateway_lists_per_s"] == 1
    assert c["gateway_usd_per_h"] == pytest.approx((200 * 0.0004 + 1 * 0.005) * 3.6)
    assert gateway.s3_costs(2500)["gateway_lists_per_s"] == 3  # a LIST page holds 1,000 keys


def test_a_tiny_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway, "QUICK", gateway.Setup(pairs=6, warmup=2, replicas=30))
    result = gateway.run(Console(width=200, record=True), quick=True)
    cases = [(r["case"], r["measure"]) for r in result["latency"]]
    assert cases == [
        ("completion, 1 token", "whole response"),
        ("chat, streamed, 4 tokens", "first byte"),
        ("chat, streamed, 4 tokens", "whole response"),
    ]
    for r in result["latency"]:
        assert r["pairs"] == 6 and r["direct_p50_ms"] > 0 and r["gateway_p50_ms"] > 0
    scans = result["membership"]["scans"]
    assert [(s["live"], s["gets"]) for s in scans] == [(30, 30), (30, 0), (30, 6)]  # only rewrites are read
    assert all(s["lists"] == 1 for s in scans)
    text = gateway.markdown(result)
    assert "| request | until | direct p50 |" in text and "Heartbeats of 1,000 replicas on S3" in text
