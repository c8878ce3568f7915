"""A sidecar in a fleet: its member record on the board (what it says, kept fresh, rewritten at once when the
version changes), the drain that takes it out (new requests refused, requests in flight finished, record
deleted), and a board that refuses the writes."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from flipsync.board.membership import MemberReader
from flipsync.errors import ConfigError
from flipsync.sidecar.heartbeat import MembershipConfig
from flipsync.stores import ObstoreStore
from tests.sidecar.sidecar_helpers import FlakyStore, StackFactory, Trainer, wait_until


def live(store: ObstoreStore) -> dict[str, object]:
    return {r.replica: r for r in MemberReader(store).scan().live}


def test_the_record_says_what_routing_needs_and_follows_the_version(
    store: ObstoreStore, trainer: Trainer, make_stack: StackFactory
) -> None:
    stack = make_stack()
    assert wait_until(lambda: stack.replica.version == 0)
    # A long interval: the change of version must be written at once, not at the next beat.
    hb = stack.sidecar.join(MembershipConfig(public_url=stack.sidecar.url, island="eu-1", interval_s=30, ttl_s=90))
    assert wait_until(lambda: hb.replica_id in live(store))
    r = live(store)[hb.replica_id]
    assert (r.run, r.island, r.url, r.engine, r.model, r.served_format) == (
        "run",
        "eu-1",
        stack.sidecar.url,
        "torch",
        "flipsync-torch",
        "bf16",
    )
    assert (r.version, r.serving, r.ttl_s) == (0, True, 90)
    assert r.state in ("idle", "fetching")  # between two polls, or polling the board (a loaded machine)
    assert r.view_fp == trainer.fps[0]
    assert hb.replica_id == stack.sidecar.url.removeprefix("http://").replace(":", "-")
    trainer.step()
    t = time.monotonic()
    assert wait_until(lambda: live(store)[hb.replica_id].version == 1, timeout=5)
    assert time.monotonic() - t < 5
    assert live(store)[hb.replica_id].view_fp == trainer.fps[1] and live(store)[hb.replica_id].head == 1
    assert hb.seq >= 2 and hb.writes == hb.seq
    with pytest.raises(ConfigError, match="joined a fleet already"):
        stack.sidecar.join(MembershipConfig(public_url=stack.sidecar.url))


def test_drain_refuses_new_requests_finishes_those_in_flight_and_leaves(
    store: ObstoreStore, trainer: Trainer, make_stack: StackFactory
) -> None:
    stack = make_stack()
    assert wait_until(lambda: stack.replica.version == 0)
    hb = stack.sidecar.join(MembershipConfig(public_url=stack.sidecar.url, interval_s=0.2, ttl_s=2))
    assert wait_until(lambda: hb.replica_id in live(store))
    slow: dict[str, httpx.Response] = {}

    def long_request() -> None:
        slow["r"] = httpx.post(
            stack.sidecar.url + "/v1/completions",
            json={"prompt": "a", "max_tokens": 200, "ignore_eos": True},
            timeout=60,
        )

    worker = threading.Thread(target=long_request)
    worker.start()
    assert wait_until(lambda: stack.sidecar.gate.in_flight == 1)
    outcome: dict[str, bool] = {}
    drainer = threading.Thread(target=lambda: outcome.setdefault("drained", stack.sidecar.drain(30)))
    drainer.start()
    assert wait_until(lambda: stack.sidecar.gate.draining)
    r = stack.client.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["x-flipsync-draining"] == "1" and "leaving the fleet" in r.text
    assert stack.client.get("/flipsync/health").status_code == 503
    assert stack.client.get("/flipsync/status").json()["proxy"]["draining"] is True
    assert wait_until(lambda: live(store).get(hb.replica_id) is not None and live(store)[hb.replica_id].draining)
    worker.join(60)
    drainer.join(60)
    assert slow["r"].status_code == 200 and len(slow["r"].json()["choices"][0]["token_versions"]) == 200
    assert outcome == {"drained": True}
    assert hb.replica_id not in live(store) and not store.list("runs/run/members")
    assert stack.sidecar.heartbeat is None


def test_a_crash_leaves_the_record_to_expire(store: ObstoreStore, trainer: Trainer, make_stack: StackFactory) -> None:
    stack = make_stack()
    assert wait_until(lambda: stack.replica.version == 0)
    hb = stack.sidecar.join(MembershipConfig(public_url=stack.sidecar.url, interval_s=0.2, ttl_s=1.0))
    assert wait_until(lambda: hb.replica_id in live(store))
    stack.sidecar.stop(deregister=False)
    assert store.list("runs/run/members")  # still there...
    assert wait_until(lambda: hb.replica_id not in live(store), timeout=5)  # ...but no longer live
    assert [r.reason for r in MemberReader(store).scan().rejected] == ["expired"]


def test_a_board_that_refuses_writes_is_retried(
    store: ObstoreStore, trainer: Trainer, make_stack: StackFactory
) -> None:
    stack = make_stack()
    assert wait_until(lambda: stack.replica.version == 0)
    flaky = FlakyStore(store)
    flaky.down = True
    hb = stack.sidecar.join(MembershipConfig(public_url=stack.sidecar.url, interval_s=0.1, ttl_s=1.0), store=flaky)
    assert wait_until(lambda: hb.failures >= 2)
    assert not live(store) and stack.replica.serving  # serving goes on; only the record is missing
    flaky.down = False
    assert wait_until(lambda: hb.replica_id in live(store))


def test_membership_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="below the record's TTL"):
        MembershipConfig(public_url="http://10.0.0.1:8100", interval_s=5, ttl_s=5)
    with pytest.raises(ConfigError, match="http"):
        MembershipConfig(public_url="10.0.0.1:8100")
    with pytest.raises(ConfigError, match="no '@'"):
        MembershipConfig(public_url="http://10.0.0.1:8100", model="m@fp8")
    assert MembershipConfig(public_url="http://10.0.0.1:8100").replica == "10.0.0.1-8100"
    assert MembershipConfig(public_url="http://10.0.0.1:8100", replica_id="gpu-7").replica == "gpu-7"
