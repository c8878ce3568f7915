"""The gateway in front of real sidecars (torch engines on loopback) that keep member records on a board a
trainer publishes real patches to: routing by constraint and readiness, retries, holds, model/format routing,
stamps passed through untouched, and records that must never route (malformed, stale, forged)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from flipsync.board.membership import MemberWriter
from flipsync.board.signing import Signer, Verifier, generate_keypair
from flipsync.domain.fleet import MemberRecord
from flipsync.domain.manifest import utc_now_iso
from flipsync.fleet.pool import StaticPool
from flipsync.stores import ObstoreStore
from flipsync.trainer import MultiFormatPublisher, PublisherConfig
from tests.fleet.fleet_helpers import GatewayFactory, MemberFactory, impostor
from tests.sidecar.sidecar_helpers import Trainer, tiny_masters, wait_until


def forged_record(replica: str, url: str, *, version: int = 1, **over: object) -> MemberRecord:
    fields: dict[str, object] = {
        "replica": replica,
        "run": "run",
        "island": "evil",
        "url": url,
        "engine": "torch",
        "served_format": "bf16",
        "model": "flipsync-torch",
        "version": version,
        "view_fp": "ab" * 16,
        "head": version,
        "state": "idle",
        "serving": True,
        "in_flight": 0,  # the least loaded: it would be picked first
        "heartbeat": utc_now_iso(),
        "ttl_s": 60.0,
        "started": utc_now_iso(),
        "seq": 0,
    }
    fields.update(over)
    return MemberRecord(**fields)  # type: ignore[arg-type]


def served_by(r: httpx.Response) -> str:
    return r.headers["x-flipsync-replica"]


def spread(one: Callable[[], str], n: int = 40) -> set[str]:
    """Who served ``n`` sequential requests, a heartbeat apart now and then: among equally loaded replicas the
    order is random, but a record's in-flight count is a heartbeat old, so a burst can favour one."""
    seen = set()
    for i in range(n):
        seen.add(one())
        if i % 4 == 3:
            time.sleep(0.1)
    return seen


def test_routes_by_readiness_and_constraint(
    trainer: Trainer, make_member: MemberFactory, make_gateway: GatewayFactory
) -> None:
    fresh = make_member()
    behind = make_member(start_loop=False)  # moves only when the test says
    assert behind.sidecar.replica.sync_once() and behind.sidecar.replica.version == 0
    for _ in range(3):
        trainer.step()
    assert wait_until(lambda: fresh.sidecar.replica.version == 3)
    gw = make_gateway(max_lag=1)
    # both records seen, the fresh one's at v3 (its record is rewritten just after its version moves)
    assert wait_until(lambda: gw.fleet()["runs"].get("run", {}).get("members") == 2)
    assert wait_until(lambda: gw.fleet()["runs"]["run"]["at_head"] == 1)
    fleet = gw.fleet()
    assert fleet["runs"]["run"]["head"] == 3 and fleet["runs"]["run"]["at_head"] == 1
    assert fleet["runs"]["run"]["readiness"] == 0.5 and fleet["ready"] == 1
    status = {m["replica"]: (m["version"], m["ready"], m["board_lag"]) for m in fleet["members"]}
    assert status == {fresh.replica_id: (3, True, 0), behind.replica_id: (0, False, 3)}

    # Unconstrained requests only go to the ready replica (v0 is 3 behind, max_lag 1), and say so.
    for _ in range(6):
        r = gw.complete()
        assert r.status_code == 200, r.text
        assert served_by(r) == fresh.replica_id and r.json()["weight_version"]["start"] == 3
        assert r.headers["x-flipsync-fleet-head"] == "3"
    # A constraint the behind replica satisfies may go there (least in flight: both are idle, so the order
    # is the records'); exact v0 only there; v3 only to the fresh one.
    r = gw.complete(weight_version={"exact_version": 0})
    assert r.status_code == 200 and served_by(r) == behind.replica_id
    assert r.json()["weight_version"] == {"start": 0, "end": 0}
    r = gw.client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"X-Flipsync-Min-Version": "3"}
    )
    assert r.status_code == 200 and served_by(r) == fresh.replica_id
    # The behind replica catches up and enters rotation.
    assert behind.sidecar.replica.sync_once() and behind.sidecar.replica.version == 3
    assert wait_until(lambda: gw.fleet()["ready"] == 2)
    # distinct prompts: one prompt repeated is a GRPO group, affine to one replica (docs/fleet.md#affinity)
    assert spread(lambda: served_by(gw.complete(prompt=f"hi {time.monotonic_ns()}"))) == {
        fresh.replica_id,
        behind.replica_id,
    }


def test_a_record_out_of_date_is_corrected_by_the_replica(
    trainer: Trainer, make_member: MemberFactory, make_gateway: GatewayFactory
) -> None:
    """The gateway asks the replica for HEAD - max_lag at least: a replica whose record still says it is
    ready, but which lost its version, refuses (503), and the gateway sends the request elsewhere."""
    a = make_member()
    b = make_member()
    trainer.step()
    assert wait_until(lambda: a.sidecar.replica.version == 1 and b.sidecar.replica.version == 1)
    gw = make_gateway(max_lag=0)
    assert wait_until(lambda: gw.fleet()["ready"] == 2)
    assert b.sidecar.heartbeat is not None
    b.sidecar.heartbeat.stop(deregister=False)  # its record stays as it was: ready at v1
    b.sidecar.replica.stop()
    b.sidecar.replica.follower.move_to(None, None)  # b lost its version (an engine fault)
    before = gw.gateway.metrics.registry.get_sample_value("flipsync_gateway_retries_total", {"reason": "refused_503"})
    for i in range(16):  # distinct prompts hash to either replica (affinity): b comes first now and then
        r = gw.complete(prompt=f"hi {i}")
        assert r.status_code == 200 and served_by(r) == a.replica_id
    after = gw.gateway.metrics.registry.get_sample_value("flipsync_gateway_retries_total", {"reason": "refused_503"})
    assert (after or 0) > (before or 0)


def test_holds_for_a_version_then_409_with_retry_after(
    trainer: Trainer, make_member: MemberFactory, make_gateway: GatewayFactory
) -> None:
    m = make_member()
    assert wait_until(lambda: m.sidecar.replica.version == 0)
    gw = make_gateway(hold_s=1.0)
    assert wait_until(lambda: gw.fleet()["ready"] == 1)
    t = time.monotonic()
    r = gw.complete(weight_version={"min_version": 5})
    assert r.status_code == 409 and r.headers["retry-after"] == "1"
    assert 0.9 <= time.monotonic() - t < 5
    body = r.json()
    assert body["error"]["type"] == "weight_version_unavailable"
    assert body["weight_version"]["min_version"] == 5 and body["weight_version"]["served"] == [0]
    # A version published while the request is held is served as soon as a replica has it.
    gw2 = make_gateway(hold_s=20.0)
    assert wait_until(lambda: gw2.fleet()["ready"] == 1)

    # Publish only once the request is held (a fixed delay lost the race on a loaded machine).
    def publish_once_held() -> None:
        if wait_until(lambda: gw2.gateway.view.holders > 0):
            trainer.step()

    publisher = threading.Thread(target=publish_once_held)
    publisher.start()
    r = gw2.complete(weight_version={"min_version": 1})
    publisher.join()
    assert r.status_code == 200 and r.json()["weight_version"]["start"] == 1
    # The hold is timed once the answer went out, so the client may read its answer first.
    registry = gw2.gateway.metrics.registry
    assert wait_until(lambda: registry.get_sample_value("flipsync_gateway_held_seconds_count") == 1)
    # Nothing ready at all: an unconstrained request ends in 503, Retry-After.
    m.sidecar.gate.start_draining()
    assert wait_until(lambda: gw.fleet()["ready"] == 0)
    r = gw.complete()
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and "no ready replica" in r.text


def test_dead_and_draining_replicas_are_failed_over(
    trainer: Trainer, make_member: MemberFactory, make_gateway: GatewayFactory
) -> None:
    a, b = make_member(), make_member()
    assert wait_until(lambda: a.sidecar.replica.version == 0 and b.sidecar.replica.version == 0)
    gw = make_gateway(hold_s=5.0)
    assert wait_until(lambda: gw.fleet()["ready"] == 2)
    a.kill()  # its record stays until it expires
    assert gw.fleet()["ready"] == 2
    for i in range(20):  # distinct prompts hash to either replica (affinity): a comes first now and then
        r = gw.complete(prompt=f"hi {i}")
        assert r.status_code == 200 and served_by(r) == b.replica_id
    unreachable = gw.gateway.metrics.registry.get_sample_value(
        "flipsync_gateway_retries_total", {"reason": "unreachable"}
    )
    assert unreachable == 1  # tried once, then skipped until it writes a newer heartbeat
    assert wait_until(lambda: gw.fleet()["runs"]["run"]["members"] == 1, timeout=5)  # expired by TTL
    # Draining: new requests are refused by the replica (503), sent elsewhere; the record goes.
    c = make_member()
    assert wait_until(lambda: gw.fleet()["ready"] == 2)
    b.sidecar.gate.start_draining()
    for _ in range(6):
        r = gw.complete()
        assert r.status_code == 200 and served_by(r) == c.replica_id
    assert b.sidecar.drain(5.0)
    assert wait_until(lambda: [m["replica"] for m in gw.fleet()["members"]] == [c.replica_id])


def test_stamps_and_streams_pass_through_untouched(
    trainer: Trainer, make_member: MemberFactory, make_gateway: GatewayFactory
) -> None:
    m = make_member()
    trainer.step()
    assert wait_until(lambda: m.sidecar.replica.version == 1)
    gw = make_gateway()
    assert wait_until(lambda: gw.fleet()["ready"] == 1)
    body = {"prompt": "same", "max_tokens": 4, "temperature": 0, "weight_version": {"min_version": 1}}
    direct = httpx.post(m.url + "/v1/completions", json=body, timeout=30)
    via = gw.client.post("/v1/completions", json=body)
    assert via.status_code == direct.status_code == 200
    for h in ("x-flipsync-weight-version-start", "x-flipsync-weight-version-end", "x-flipsync-weight-version"):
        assert via.headers[h] == direct.headers[h] == "1"
    a, b = direct.json(), via.json()
    assert a["weight_version"] == b["weight_version"] == {"start": 1, "end": 1}
    assert a["choices"][0]["text"] == b["choices"][0]["text"]  # greedy: the same tokens
    assert a["choices"][0]["token_versions"] == b["choices"][0]["token_versions"] == [1, 1, 1, 1]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with gw.client.stream("POST", "/v1/chat/completions", json=chat) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        assert s.headers["x-flipsync-weight-version-start"] == "1"
        events = [line for line in s.iter_lines() if line.startswith("data: {")]
    assert events and all(json.loads(e[6:])["weight_version"]["start"] == 1 for e in events)
    # Bad constraints are refused by the gateway as a sidecar would.
    r = gw.complete(weight_version={"min_version": -1})
    assert r.status_code == 400 and "non-negative" in r.text
    r = gw.client.post("/v1/completions", content=b"[" * 3000, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert gw.client.get("/flipsync/health").status_code == 200
    assert gw.client.get("/flipsync/wait", params={"min_version": 1, "timeout_s": 1}).json()["satisfied"]
    assert gw.client.get("/flipsync/wait", params={"min_version": 9, "timeout_s": 0.3}).status_code == 408
    metrics = gw.client.get("/metrics").text
    assert 'flipsync_gateway_requests_total{outcome="ok"}' in metrics
    assert 'flipsync_gateway_readiness{run="run"} 1.0' in metrics


def test_one_trainer_publishes_the_formats_the_gateway_routes_by(
    store: ObstoreStore, make_member: MemberFactory, make_gateway: GatewayFactory
) -> None:
    """Heterogeneous islands fed by one trainer: a run per format under one version number per step."""
    masters = tiny_masters()
    pub = MultiFormatPublisher(
        lambda: masters, store, ("bf16", "fp8-block"), run="multi", config=PublisherConfig(background=False)
    )
    try:
        a = make_member(run="multi-bf16", fmt="bf16", island="hopper")
        b = make_member(run="multi-fp8-block", fmt="fp8-block", island="blackwell")
        for step in (1, 2):
            for m in masters.values():
                m.mul_(1 + 0.02 * step)
            pub.step()
        assert wait_until(lambda: a.sidecar.replica.version == 2 and b.sidecar.replica.version == 2)
        gw = make_gateway()
        assert wait_until(lambda: gw.fleet()["ready"] == 2)
        for fmt, member in (("fp8-block", b), ("bf16", a)):
            r = gw.complete(model=f"flipsync-torch@{fmt}", weight_version={"exact_version": 2})
            assert r.status_code == 200 and served_by(r) == member.replica_id
        assert {run: v["head"] for run, v in gw.fleet()["runs"].items()} == {"multi-bf16": 2, "multi-fp8-block": 2}
    finally:
        pub.close()


def test_routes_by_model_and_served_format(
    store: ObstoreStore, make_member: MemberFactory, make_gateway: GatewayFactory
) -> None:
    """Two islands serve one model in two formats, each following its own run (published separately)."""
    bf16 = Trainer(store, run="run-bf16", fmt="bf16")
    fp8 = Trainer(store, run="run-fp8", fmt="fp8-block")
    a = make_member(run="run-bf16", fmt="bf16", island="hopper")
    b = make_member(run="run-fp8", fmt="fp8-block", island="blackwell")
    other = make_member(run="run-bf16", fmt="bf16", model="another-model")
    bf16.step()
    fp8.step()
    assert wait_until(lambda: a.sidecar.replica.version == 1 and b.sidecar.replica.version == 1)
    assert wait_until(lambda: other.sidecar.replica.version == 1)
    gw = make_gateway()
    assert wait_until(lambda: gw.fleet()["ready"] == 3)
    ids = {m["id"] for m in gw.client.get("/v1/models").json()["data"]}
    assert ids == {
        "flipsync-torch",
        "flipsync-torch@bf16",
        "flipsync-torch@fp8-block",
        "another-model",
        "another-model@bf16",
    }
    for _ in range(4):
        r = gw.complete(model="flipsync-torch@fp8-block")
        assert r.status_code == 200 and served_by(r) == b.replica_id and r.json()["model"] == "flipsync-torch"
        r = gw.client.post(
            "/v1/completions",
            json={"model": "flipsync-torch", "prompt": "x", "max_tokens": 2},
            headers={"X-Flipsync-Format": "bf16"},
        )
        assert r.status_code == 200 and served_by(r) == a.replica_id
        r = gw.complete(model="another-model")
        assert r.status_code == 200 and served_by(r) == other.replica_id
        r = gw.client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"X-Flipsync-Run": "run-fp8"}
        )
        assert r.status_code == 200 and served_by(r) == b.replica_id
    assert spread(lambda: served_by(gw.complete(model="flipsync-torch", prompt=f"hi {time.monotonic_ns()}"))) == {
        a.replica_id,
        b.replica_id,
    }
    r = gw.complete(model="flipsync-torch@nvfp4", weight_version={"min_version": 0})  # no replica serves NVFP4
    assert r.status_code == 404 and "format nvfp4. Formats served: bf16, fp8-block" in r.json()["error"]["message"]
    fleet = gw.fleet()
    assert fleet["runs"]["run-bf16"]["members"] == 2 and fleet["runs"]["run-fp8"]["head"] == 1


def test_malformed_stale_and_forged_records_never_route(
    store: ObstoreStore, trainer: Trainer, make_member: MemberFactory, make_gateway: GatewayFactory
) -> None:
    private, public = generate_keypair()
    signer, verifier = Signer.from_pem(private), Verifier.from_pem(public)
    real = make_member(signer=signer)
    assert wait_until(lambda: real.sidecar.replica.version == 0)
    server, hits = impostor()
    try:
        w = MemberWriter(store, "run")
        # A record signed with the fleet's key, two minutes old (replayed, or a replica that died).
        stale = datetime.now(UTC) - timedelta(seconds=120)
        MemberWriter(store, "run", signer=signer).put(
            forged_record("stale", server.url, version=0, heartbeat=stale.strftime("%Y-%m-%dT%H:%M:%S.%fZ"))
        )
        store.put(
            "runs/run/members/malformed.json",
            json.dumps({**forged_record("malformed", server.url).to_dict(), "version": "0"}).encode(),
        )
        store.put("runs/run/members/notjson.json", b"url=" + server.url.encode())
        MemberWriter(store, "run", signer=Signer.from_pem(generate_keypair()[0])).put(
            forged_record("stranger", server.url, version=0)
        )
        w.put(forged_record("unsigned", server.url, version=0))
        signed = MemberWriter(store, "run", signer=signer).put(forged_record("tampered", server.url, version=0))
        store.put(
            "runs/run/members/tampered.json",
            json.dumps({**signed.to_dict(), "heartbeat": utc_now_iso(), "in_flight": 0}).encode(),
        )
        # Someone copies the real replica's signed record under another key, pointing nowhere new.
        hb = real.sidecar.heartbeat
        assert hb is not None and wait_until(lambda: hb.last is not None and hb.last.version == 0)
        assert hb.last is not None
        store.put("runs/run/members/copy.json", hb.last.to_json().encode())

        gw = make_gateway(member_verifier=verifier)
        assert wait_until(lambda: gw.fleet()["ready"] == 1)
        reasons = {r["path"].rsplit("/", 1)[-1]: r["reason"] for r in gw.fleet()["rejected"]}
        assert reasons == {
            "stale.json": "expired",
            "malformed.json": "malformed",
            "notjson.json": "malformed",
            "stranger.json": "untrusted_key",
            "unsigned.json": "unsigned",
            "tampered.json": "bad_signature",
            "copy.json": "misplaced",
        }
        for body in ({}, {"weight_version": {"min_version": 0}}, {"weight_version": {"exact_version": 0}}):
            r = gw.complete(**body)
            assert r.status_code == 200 and served_by(r) == real.replica_id
        assert hits == []
        metrics = gw.client.get("/metrics").text
        assert 'flipsync_gateway_rejected_records{reason="bad_signature"} 1.0' in metrics

        # Without member keys the board itself is what is trusted: a well-formed, live record routes, whoever
        # wrote it. (Its stamps are its own word: sign the records where others can write the board.)
        open_gw = make_gateway()
        assert wait_until(lambda: open_gw.fleet()["ready"] >= 3)
        for i in range(24):  # distinct prompts: one prompt would stay on one replica (affinity)
            assert open_gw.complete(prompt=f"hi {i}").status_code == 200
        assert hits, "an unsigned gateway trusts every well-formed record on the board"
        assert "stale" not in {m["replica"] for m in open_gw.fleet()["members"]}
    finally:
        server.stop()


def test_a_static_pool(trainer: Trainer, make_member: MemberFactory, make_gateway: GatewayFactory) -> None:
    a, b = make_member(join=False), make_member(join=False, start_loop=False)
    trainer.step()
    trainer.step()
    assert b.sidecar.replica.sync_once()
    assert wait_until(lambda: a.sidecar.replica.version == 2)
    gw = make_gateway(StaticPool([a.url, b.url + "/v1", "http://127.0.0.1:9"]), max_lag=0)
    assert wait_until(lambda: gw.fleet()["ready"] == 2)
    fleet = gw.fleet()
    assert fleet["runs"]["run"]["head"] == 2 and len(fleet["members"]) == 2
    assert [r["reason"] for r in fleet["rejected"]] == ["unreadable"]
    assert {m["served_format"] for m in fleet["members"]} == {"bf16"}
    trainer.step()
    assert wait_until(lambda: a.sidecar.replica.version == 3)
    assert wait_until(lambda: gw.fleet()["ready"] == 1)  # b is behind HEAD (3) now, and max_lag is 0
    for _ in range(4):
        r = gw.complete()
        assert r.status_code == 200 and r.json()["weight_version"]["start"] == 3
    with pytest.raises(NotImplementedError, match="cannot scale"):
        gw.gateway.pool.scale(1, 4)


def test_a_client_that_leaves_a_stream_stops_it_at_the_replica(
    trainer: Trainer, make_member: MemberFactory, make_gateway: GatewayFactory
) -> None:
    m = make_member()
    assert wait_until(lambda: m.sidecar.replica.version == 0)
    gw = make_gateway()
    assert wait_until(lambda: gw.fleet()["ready"] == 1)
    body = {"prompt": "long", "max_tokens": 250, "temperature": 0, "ignore_eos": True}
    t = time.monotonic()
    assert gw.client.post("/v1/completions", json=body).status_code == 200
    whole_s = time.monotonic() - t  # what the 250 tokens take
    with httpx.Client(base_url=gw.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            next(s.iter_lines())
            assert m.sidecar.gate.in_flight == 1
        t = time.monotonic()
    # The gateway saw the client go and closed the replica's stream: its request ends long before 250 tokens.
    assert wait_until(lambda: m.sidecar.gate.in_flight == 0, timeout=30)
    assert time.monotonic() - t < whole_s / 2, (time.monotonic() - t, whole_s)
    assert wait_until(lambda: gw.gateway.view.in_flight == {}, timeout=5)
