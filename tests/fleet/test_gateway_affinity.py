"""Affinity through the gateway (docs/fleet.md#affinity): the turns of a session and the samples of a GRPO group
reach one replica while it stays eligible, spread within bounds, and move (and succeed) when it drains."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import httpx

from flipsync.domain.balance import EngineLoad, affinity_key, load_cap, prompt_opening, rendezvous_order
from flipsync.domain.fleet import MemberRecord
from flipsync.domain.manifest import utc_now_iso
from flipsync.fleet.affinity import OUTCOMES, Affinity, AffinityPolicy
from tests.fleet.stub_fleet import StubFleet, poll, stub_fleet

SESSIONS = 50
TURNS = 5


async def _sessions(url: str, turns: range, n: int = SESSIONS) -> dict[str, list[tuple[int, str]]]:
    """``n`` sessions, all at once, each its turns one after another: per session (status, replica) per turn."""
    out: dict[str, list[tuple[int, str]]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=httpx.Limits(max_connections=n)) as client:

        async def one(s: str) -> None:
            for t in turns:
                body = {"model": "stub", "prompt": f"turn {t} of {s}", "max_tokens": 4}
                r = await client.post("/v1/completions", json=body, headers={"X-Flipsync-Session": s})
                out.setdefault(s, []).append((r.status_code, r.headers.get("x-flipsync-replica", "")))

        await asyncio.gather(*(one(f"session-{i}") for i in range(n)))
    return out


def _hit_rate(turns: dict[str, list[tuple[int, str]]]) -> float:
    later = [(rs[0][1], rep) for rs in turns.values() for _, rep in rs[1:]]
    return sum(first == rep for first, rep in later) / len(later)


def _outcomes(fleet: StubFleet) -> dict[str, Any]:
    """What the gateway's affinity did, and each replica's health (why a session moved, when one did)."""
    reg = fleet.gateway.metrics.registry
    doc = fleet.fleet()
    return {
        **{o: reg.get_sample_value("flipsync_gateway_affinity_total", {"outcome": o}) for o in OUTCOMES},
        "health": [m["health"] for m in doc["members"]],
        "rejected": doc["rejected"],
    }


def test_sessions_stick_to_one_replica_within_bounds_and_move_when_it_drains() -> None:
    with stub_fleet(4) as fleet:
        for s in fleet.stubs:
            s.delay_s = 0.2  # turns overlap, as a batch of trajectories does: load bounds the placement
        turns = asyncio.run(_sessions(fleet.url, range(TURNS)))
        assert all(code == 200 for rs in turns.values() for code, _ in rs)
        assert _hit_rate(turns) >= 0.95, _outcomes(fleet)
        served = Counter(rep for rs in turns.values() for _, rep in rs)
        assert set(served) == {fleet.replica_of(s) for s in fleet.stubs}
        mean = sum(served.values()) / len(fleet.stubs)
        assert max(served.values()) <= 1.5 * mean, served
        home = {s: rs[0][1] for s, rs in turns.items()}

        # One replica drains: its sessions' next turn goes elsewhere and succeeds; the others stay put.
        leaving = fleet.stubs[0]
        leaving.draining = True
        gone = fleet.replica_of(leaving)
        assert poll(lambda: fleet.ready() == 3)
        after = asyncio.run(_sessions(fleet.url, range(TURNS, TURNS + 2)))
        assert all(code == 200 for rs in after.values() for code, _ in rs)
        moved = [s for s in after if home[s] == gone]
        assert moved and all(rep != gone for s in moved for _, rep in after[s])
        for s in moved:  # and stay on their new replica
            assert after[s][0][1] == after[s][1][1]
        stayed = [s for s in after if home[s] != gone]
        kept = sum(rep == home[s] for s in stayed for _, rep in after[s]) / (2 * len(stayed))
        assert kept >= 0.95
        assert not fleet.fleet()["members"][0]["health"]["ejected"]  # a drain is no failure
        hits = fleet.gateway.metrics.registry.get_sample_value("flipsync_gateway_affinity_total", {"outcome": "hit"})
        assert hits is not None and hits >= 0.9 * SESSIONS * (TURNS - 1)


def test_a_grpo_group_and_the_user_field_are_affine() -> None:
    with stub_fleet(4) as fleet:
        c = fleet.client
        # the same prompt, sampled in separate requests (a GRPO group), and one chat's turns by its opening
        group = {
            c.post("/v1/completions", json={"prompt": "solve 17 * 23", "n": 1}).headers["x-flipsync-replica"]
            for _ in range(8)
        }
        assert len(group) == 1
        chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "plan a trip"}]
        first = c.post("/v1/chat/completions", json={"messages": chat}).headers["x-flipsync-replica"]
        chat += [{"role": "assistant", "content": "where to?"}, {"role": "user", "content": "Lisbon"}]
        assert c.post("/v1/chat/completions", json={"messages": chat}).headers["x-flipsync-replica"] == first
        users = {
            c.post("/v1/completions", json={"prompt": f"p{i}", "user": "u-7"}).headers["x-flipsync-replica"]
            for i in range(8)
        }
        assert len(users) == 1
        # distinct prompts without a session spread over the replicas
        spread = {c.post("/v1/completions", json={"prompt": f"q{i}"}).headers["x-flipsync-replica"] for i in range(40)}
        assert len(spread) >= 3


def test_a_hot_session_spills_over_the_load_bound() -> None:
    """A session that sends many requests at once does not pile them all on its replica."""

    async def burst(url: str) -> Counter[str]:
        async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=httpx.Limits(max_connections=64)) as client:
            rs = await asyncio.gather(
                *(
                    client.post("/v1/completions", json={"prompt": str(i)}, headers={"X-Flipsync-Session": "hot"})
                    for i in range(48)
                )
            )
        assert all(r.status_code == 200 for r in rs)
        return Counter(r.headers["x-flipsync-replica"] for r in rs)

    with stub_fleet(4) as fleet:
        for s in fleet.stubs:
            s.delay_s = 0.3
        served = asyncio.run(burst(fleet.url))
        assert len(served) >= 2 and max(served.values()) < 48
        spilled = fleet.gateway.metrics.registry.get_sample_value(
            "flipsync_gateway_affinity_total", {"outcome": "spilled"}
        )
        assert spilled and spilled > 0


def _record(replica: str, queued: int = 0) -> MemberRecord:
    now = utc_now_iso()
    return MemberRecord(
        replica=replica,
        run="run",
        island="i",
        url=f"http://10.0.0.1:{8000 + ord(replica[0])}",
        engine="stub",
        served_format="bf16",
        model="m",
        version=1,
        view_fp="ab",
        head=1,
        state="idle",
        serving=True,
        in_flight=0,
        heartbeat=now,
        ttl_s=15.0,
        started=now,
        load=EngineLoad(waiting=queued),
    )


def test_rendezvous_moves_only_the_keys_of_a_replica_that_left() -> None:
    replicas = [f"r{i}" for i in range(5)]
    keys = [f"s{i}" for i in range(2000)]
    before = {k: rendezvous_order(k, replicas)[0] for k in keys}
    after = {k: rendezvous_order(k, replicas[1:])[0] for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "r0")
    counts = Counter(before.values())
    assert min(counts.values()) > 300  # about 400 each
    assert load_cap([0, 0, 0, 0], 1.25, 4) == 4 and load_cap([10, 10, 10, 10], 1.25, 1) == 13


def test_affinity_keys_and_the_remembered_replica() -> None:
    assert affinity_key("abc", "u", "p") == "s:abc" and affinity_key(None, "u", "p") == "u:u"
    assert affinity_key(None, None, None) is None
    assert affinity_key(None, None, ("m", "p")) == affinity_key(None, None, ("m", "p"))
    chat = {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}
    longer = {**chat, "messages": [*chat["messages"], {"role": "assistant", "content": "a"}]}
    assert prompt_opening(chat, 10) == prompt_opening(longer, 10)
    assert prompt_opening({"prompt": "x" * 50}, 10) == prompt_opening({"prompt": "x" * 60}, 10)
    aff = Affinity(AffinityPolicy(remember=2))
    ranked = [_record("a"), _record("b"), _record("c")]
    order, outcome = aff.order("k", ranked, {})
    assert outcome == "new"
    aff.served("k", "c")
    order, outcome = aff.order("k", ranked, {})
    assert outcome == "hit" and order[0].replica == "c"
    order, outcome = aff.order("k", ranked[:2], {})  # c left: moved
    assert outcome == "moved" and order[0].replica in ("a", "b")
    order, outcome = aff.order("k", [_record("a"), _record("b"), _record("c", queued=99)], {})
    assert outcome == "spilled" and order[0].replica != "c"  # its engine queues 99: full
    aff.served("x", "a")
    aff.served("y", "a")
    assert "k" not in aff.where  # the oldest forgotten (remember=2)
    assert Affinity(AffinityPolicy(enabled=False)).order("k", ranked, {})[1] == "none"
