"""Ejection (docs/fleet.md#ejection): a replica that fails fast is taken out of rotation with exponential backoff,
probed back in with one request, and counted per replica; a drain is no failure."""

from __future__ import annotations

import time

from flipsync.fleet.ejection import Admission, EjectionPolicy, Ejector
from flipsync.fleet.metrics import GatewayMetrics
from tests.fleet.stub_fleet import poll, stub_fleet

# The defaults scaled down 15x: eject after 2 failures in a row, out for 1 s, then 2 s, 4 s ...
POLICY = EjectionPolicy(after=2, window_s=10.0, backoff_s=1.0, max_backoff_s=8.0)


def test_a_replica_answering_503_is_ejected_probed_and_comes_back() -> None:
    with stub_fleet(2, ejection=POLICY) as fleet:
        good, bad = fleet.stubs
        bad.status = 503
        bad_id = fleet.replica_of(bad)
        window = 2.9 * POLICY.backoff_s  # what 30 s is to the defaults' 15 s backoff (2 + one probe at most)
        i = 0
        while not bad.hits or time.monotonic() < bad.hits[0].at + window:
            r = fleet.client.post("/v1/completions", json={"prompt": f"p{i}"})  # distinct prompts: both replicas
            assert r.status_code == 200 and r.headers["x-flipsync-replica"] == fleet.replica_of(good)
            i += 1
        first = bad.hits[0].at
        assert len([h for h in bad.hits if h.at < first + window]) <= 3
        assert i > 20  # the traffic went on meanwhile
        registry = fleet.gateway.metrics.registry
        errors = registry.get_sample_value(
            "flipsync_gateway_replica_errors_total", {"replica": bad_id, "reason": "refused_503"}
        )
        assert errors is not None and errors >= 2
        assert registry.get_sample_value("flipsync_gateway_replica_ejections_total", {"replica": bad_id}) >= 1
        member = next(m for m in fleet.fleet()["members"] if m["replica"] == bad_id)
        assert member["health"]["ejected"] and member["health"]["errors"] >= 2

        # It heals: the next probe finds it well, and it takes requests again.
        bad.status = 200

        def served_by_bad() -> bool:
            nonlocal i
            i += 1
            r = fleet.client.post("/v1/completions", json={"prompt": f"p{i}"})
            return r.status_code == 200 and r.headers["x-flipsync-replica"] == bad_id

        assert poll(served_by_bad, timeout=60.0, every=0.01)
        # (the gateway records the probe's success just after relaying its answer)
        assert poll(
            lambda: not next(m for m in fleet.fleet()["members"] if m["replica"] == bad_id)["health"]["ejected"]
        )
        assert registry.get_sample_value("flipsync_gateway_replica_ejected", {"replica": bad_id}) == 0


def test_when_every_replica_is_ejected_they_are_tried_all_the_same() -> None:
    """Panic mode: a fleet of one (or a burst that failed them all) is not cut off by its own ejection."""
    with stub_fleet(1, ejection=POLICY, hold_s=0.5) as fleet:
        (stub,) = fleet.stubs
        stub.status = 502  # a sidecar whose engine is unreachable
        for _ in range(2):
            r = fleet.client.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 503 and "no ready replica" in r.text
        assert fleet.fleet()["members"][0]["health"]["ejected"]
        assert fleet.gateway.ready_replicas() == 0 and fleet.client.get("/readyz").status_code == 503
        stub.status = 200  # healed before its backoff ends: the first answer brings it back
        r = fleet.client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 200
        assert poll(lambda: not fleet.fleet()["members"][0]["health"]["ejected"])
        assert fleet.client.get("/readyz").status_code == 200


def test_the_ejector_backs_off_exponentially() -> None:
    now = [0.0]
    ej = Ejector(EjectionPolicy(after=2, window_s=5, backoff_s=10, max_backoff_s=25), GatewayMetrics(), lambda: now[0])
    assert ej.admit("r") is Admission.NORMAL
    ej.failed("r", "refused_409", Admission.NORMAL)  # a version refusal is not a failure
    ej.failed("r", "draining", Admission.NORMAL)  # nor is a drain
    ej.failed("r", "refused_503", Admission.NORMAL)
    now[0] = 6.0  # too long after the first: not "in a row"
    ej.failed("r", "refused_503", Admission.NORMAL)
    assert not ej.ejected("r")
    ej.failed("r", "unreachable", Admission.NORMAL)
    assert ej.ejected("r") and ej.admit("r") is Admission.SKIP
    now[0] = 16.0
    assert not ej.ejected("r") and ej.admit("r") is Admission.PROBE
    assert ej.admit("r") is Admission.SKIP  # one probe at a time
    ej.failed("r", "broken", Admission.PROBE)
    now[0] = 16.0 + 19.0
    assert ej.ejected("r")  # 20 s the second time
    now[0] = 16.0 + 20.0
    assert ej.admit("r") is Admission.PROBE
    ej.failed("r", "broken", Admission.PROBE)
    now[0] = 36.0 + 24.0
    assert ej.ejected("r")  # capped at 25 s
    now[0] = 36.0 + 25.0
    assert ej.admit("r") is Admission.PROBE
    ej.succeeded("r", Admission.PROBE)
    assert not ej.ejected("r") and ej.admit("r") is Admission.NORMAL
    assert ej.describe("r")["errors"] == 5
    ej.forget(set())
    assert ej.describe("r") == {"errors": 0, "ejected": False}
    never = Ejector(EjectionPolicy(after=0), GatewayMetrics())
    for _ in range(10):
        never.failed("r", "refused_503", Admission.NORMAL)
    assert not never.ejected("r")
