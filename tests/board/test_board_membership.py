"""Member records on the board: written and deleted per replica, read back live or refused with the reason
(malformed, misplaced, expired, from the future; on a signed board unsigned, untrusted or tampered), and
downloaded again only when their listing changed."""

from __future__ import annotations

import json
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from flipsync.board.membership import MemberReader, MemberWriter
from flipsync.board.signing import Signer, Verifier, generate_keypair
from flipsync.domain.fleet import MemberRecord
from flipsync.errors import IntegrityError
from flipsync.stores import ObstoreStore, Store, StoreWrapper


def iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def record(replica: str = "r1", run: str = "run", **over: Any) -> MemberRecord:
    now = iso(datetime.now(UTC))  # at the call: a time taken at import would expire during a long run
    fields: dict[str, Any] = {
        "replica": replica,
        "run": run,
        "island": "eu-1",
        "url": f"http://127.0.0.1:{8100 + len(replica)}",
        "engine": "torch",
        "served_format": "bf16",
        "model": "flipsync-torch",
        "version": 3,
        "view_fp": "ab" * 16,
        "head": 3,
        "state": "idle",
        "serving": True,
        "in_flight": 0,
        "heartbeat": now,
        "ttl_s": 30.0,
        "started": now,
        "seq": 0,
    }
    fields.update(over)
    return MemberRecord(**fields)


class CountingStore(StoreWrapper):
    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.url = inner.url
        self.gets: Counter[str] = Counter()

    def get(self, path: str, *, size: int | None = None) -> bytes:
        self.gets[path] += 1
        return super().get(path, size=size)


def by_reason(scan: Any) -> dict[str, str]:
    return {r.path.rsplit("/", 1)[-1]: r.reason for r in scan.rejected}


@pytest.mark.parametrize("store_factory", ["file", "memory", "s3"], indirect=True)
def test_records_round_trip_and_leave(store: ObstoreStore) -> None:
    a, b = MemberWriter(store, "run"), MemberWriter(store, "run-fp8")
    a.put(record("r1"))
    a.put(record("r2", in_flight=4))
    b.put(record("r3", run="run-fp8", served_format="fp8-block"))
    reader = MemberReader(store)
    scan = reader.scan()
    assert sorted((r.run, r.replica) for r in scan.live) == [("run", "r1"), ("run", "r2"), ("run-fp8", "r3")]
    assert scan.rejected == () and set(scan.runs) == {"run", "run-fp8"}
    a.put(record("r2", in_flight=1, version=4, view_fp="cd" * 16, head=4))  # one key per replica: rewritten
    a.remove("r1")
    a.remove("r1")  # leaving twice is fine
    scan = reader.scan()
    assert {r.replica: (r.version, r.in_flight) for r in scan.live} == {"r2": (4, 1), "r3": (3, 0)}
    only = MemberReader(store, runs=("run-fp8",)).scan()
    assert [r.replica for r in only.live] == ["r3"]
    with pytest.raises(IntegrityError, match="does not belong under run"):
        a.put(record("r9", run="run-fp8"))


def test_expired_future_malformed_and_misplaced_records_are_refused(store: ObstoreStore) -> None:
    now = datetime.now(UTC)
    w = MemberWriter(store, "run")
    w.put(record("live", heartbeat=iso(now)))
    w.put(record("old", heartbeat=iso(now - timedelta(seconds=31))))
    w.put(record("ahead", heartbeat=iso(now + timedelta(minutes=5))))
    store.put("runs/run/members/garbage.json", b"{not json")
    store.put("runs/run/members/wrongtype.json", json.dumps({**record("wrongtype").to_dict(), "version": "3"}).encode())
    store.put("runs/run/members/huge.json", b" " * 20_000)
    store.put("runs/run/members/notes.txt", b"ignored: not a record")
    # A valid record copied under another replica's key, and under another run.
    store.put("runs/run/members/copy.json", record("live").to_json().encode())
    store.put("runs/other/members/live.json", record("live").to_json().encode())
    scan = MemberReader(store).scan(now + timedelta(seconds=1))
    assert [r.replica for r in scan.live] == ["live"]
    assert by_reason(scan) == {
        "old.json": "expired",
        "ahead.json": "future",
        "garbage.json": "malformed",
        "wrongtype.json": "malformed",
        "huge.json": "malformed",
        "copy.json": "misplaced",
        "live.json": "misplaced",  # runs/other/members/live.json holds a record of run 'run'
    }
    assert all(r.message for r in scan.rejected)
    # The same record is live or expired depending on when one looks, and a reader may cap the TTL.
    assert not MemberReader(store, runs=("run",)).scan(now + timedelta(seconds=40)).live
    assert not MemberReader(store, runs=("run",), max_ttl_s=5).scan(now + timedelta(seconds=10)).live


def test_a_signed_board_routes_only_signed_records(store: ObstoreStore) -> None:
    private, public = generate_keypair()
    signer, verifier = Signer.from_pem(private), Verifier.from_pem(public)
    stranger = Signer.from_pem(generate_keypair()[0])
    MemberWriter(store, "run", signer=signer).put(record("good"))
    MemberWriter(store, "run").put(record("unsigned"))
    MemberWriter(store, "run", signer=stranger).put(record("stranger"))
    signed = MemberWriter(store, "run", signer=signer).put(record("tampered"))
    # Someone with write access to the board points a signed record at their own server.
    forged = {**signed.to_dict(), "url": "http://203.0.113.9:8100"}
    store.put("runs/run/members/tampered.json", json.dumps(forged).encode())
    scan = MemberReader(store, verifier=verifier).scan()
    assert [r.replica for r in scan.live] == ["good"] and scan.live[0].signature is not None
    assert by_reason(scan) == {
        "unsigned.json": "unsigned",
        "stranger.json": "untrusted_key",
        "tampered.json": "bad_signature",
    }
    # Without a verifier the board is trusted as a whole: every well-formed record is live.
    assert {r.replica for r in MemberReader(store).scan().live} == {"good", "unsigned", "stranger", "tampered"}


def test_unchanged_records_are_not_downloaded_again(store: ObstoreStore) -> None:
    w = MemberWriter(store, "run")
    for i in range(5):
        w.put(record(f"r{i}"))
    counting = CountingStore(store)
    reader = MemberReader(counting, runs=("run",), max_parallel_reads=4)
    assert len(reader.scan().live) == 5 and sum(counting.gets.values()) == 5
    assert len(reader.scan().live) == 5 and sum(counting.gets.values()) == 5  # nothing changed: one LIST
    w.put(record("r2", in_flight=7))  # a heartbeat
    w.remove("r4")
    scan = reader.scan()
    assert sum(counting.gets.values()) == 6 and counting.gets["runs/run/members/r2.json"] == 2
    assert {r.replica: r.in_flight for r in scan.live} == {"r0": 0, "r1": 0, "r2": 7, "r3": 0}
    reader.close()


def test_gc_deletes_the_records_of_replicas_long_gone(store: ObstoreStore) -> None:
    from board_helpers import build_run

    from flipsync.board.retention import RetentionPolicy, collect_garbage

    build_run(store, 3)
    w = MemberWriter(store, "run")
    w.put(record("r1"))
    w.put(record("r2"))
    policy = RetentionPolicy(keep_versions=100, member_grace_s=600)
    r = collect_garbage(store, "run", policy)
    assert r.deleted_members == 0 and len(store.list("runs/run/members")) == 2
    later = datetime.now(UTC) + timedelta(hours=1)
    dry = collect_garbage(store, "run", policy, now=later, dry_run=True)
    assert dry.deleted_members == 2 and len(store.list("runs/run/members")) == 2
    r = collect_garbage(store, "run", policy, now=later)
    assert r.deleted_members == 2 and not store.list("runs/run/members") and not r.deleted_versions
    with pytest.raises(Exception, match="member_grace_s"):
        RetentionPolicy(member_grace_s=0)
