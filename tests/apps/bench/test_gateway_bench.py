"""``flipsync bench gateway``: the S3 arithmetic of heartbeats, and membership scans on a real S3 API that
download only what changed (no timings asserted; ``bench all --quick`` in test_bench_smoke.py runs the latency
part)."""

from __future__ import annotations

import pytest

from flipsync_apps.bench import gateway


def test_the_s3_arithmetic() -> None:
    c = gateway.s3_costs(1000)
    assert (c["interval_s"], c["ttl_s"], c["refresh_s"]) == (5.0, 15.0, 1.0)  # the defaults it prices
    assert c["puts_per_s"] == 200 and c["puts_per_h"] == 720_000
    assert c["put_usd_per_h"] == pytest.approx(720 * 0.005)
    assert c["gateway_gets_per_s"] == 200 and c["gateway_lists_per_s"] == 1
    assert c["gateway_usd_per_h"] == pytest.approx((200 * 0.0004 + 1 * 0.005) * 3.6)
    assert gateway.s3_costs(2500)["gateway_lists_per_s"] == 3  # a LIST page holds 1,000 keys


def test_membership_scans_read_only_what_changed() -> None:
    from flipsync_apps.bench.board import local_s3

    with local_s3() as make_s3:
        if make_s3 is None:
            pytest.skip("moto is not installed")
        store = make_s3()
        result = gateway.membership_scans(store, 30)
        store.close()
    scans = result["scans"]
    assert [(s["live"], s["gets"]) for s in scans] == [(30, 30), (30, 0), (30, 6)]  # only rewrites are read
    assert all(s["lists"] == 1 for s in scans)
    assert result["record_bytes"] > 300
    latency = [
        {
            "case": "c",
            "measure": "whole response",
            "pairs": 1,
            **{k: 1.0 for k in ("direct_p50_ms", "direct_p99_ms", "gateway_p50_ms", "gateway_p99_ms")},
            **{k: 0.0 for k in ("added_p50_ms", "added_p99_ms", "paired_median_ms")},
        }
    ]
    text = gateway.markdown({"latency": latency, "membership": result})
    assert "| request | until | direct p50 |" in text and "Heartbeats of 1,000 replicas on S3" in text
    assert "| scan | seconds | live records | GETs | LIST pages |" in text


def test_the_affinity_run_and_its_markdown() -> None:
    """The load part of the bench at a small size (the 1,000 requests/s and 5,000-stream runs start processes:
    ``bench all --quick`` runs them; tests/fleet/test_gateway_streams.py runs the streams)."""
    from flipsync_apps.bench import gateway_load

    a = gateway_load.affinity(sessions=12, turns=3)
    assert a["sessions"] == 12 and 0.0 <= a["hit_rate"] <= 1.0 and a["busiest_over_mean"] >= 1.0
    rate = {
        "rate": 1000.0,
        "requests": 10,
        "errors": 0,
        **{k: 1.0 for k in ("direct_p50_ms", "direct_p99_ms", "gateway_p50_ms", "gateway_p99_ms")},
        **{k: 0.5 for k in ("added_p50_ms", "added_p99_ms")},
    }
    streams = {"streams": 5000, "completed": 5000, "all_open_at_once": True, "seconds": 30.0}
    latency = [
        {
            "case": "c",
            "measure": "whole response",
            "pairs": 1,
            **{k: 1.0 for k in ("direct_p50_ms", "direct_p99_ms", "gateway_p50_ms", "gateway_p99_ms")},
            **{k: 0.0 for k in ("added_p50_ms", "added_p99_ms", "paired_median_ms")},
        }
    ]
    membership = {**gateway.s3_costs(1000), "scans": [], "replicas": 0}
    text = gateway.markdown(
        {"latency": latency, "membership": membership, "load": {"affinity": a, "rate": rate, "streams": streams}}
    )
    assert "of turns 2-3 on turn 1's replica" in text and "5,000 completed" in text and "+0.50 ms p50" in text
