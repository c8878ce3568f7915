"""`StaticPool`: a sidecar that misses a status poll keeps its last answer until its ttl ends (one slow poll must
not move its sessions off their KV caches), then leaves the snapshot as ``unreadable``."""

from __future__ import annotations

import time

from flipsync.domain.fleet import replica_id_for
from flipsync.fleet.pool import StaticPool
from flipsync.fleet.stub_replica import StubReplica


def test_a_silent_replica_keeps_its_last_answer_until_its_ttl() -> None:
    with StubReplica() as a, StubReplica() as b:
        pool = StaticPool([a.url, b.url], timeout_s=1.0, ttl_s=1.5)
        try:
            first = pool.discover_replicas()
            assert {r.replica for r in first.members} == {replica_id_for(a.url), replica_id_for(b.url)}
            b.stop()  # now every poll of b is refused
            t0 = time.monotonic()
            kept = pool.discover_replicas()
            assert [r.replica for r in kept.members] == [replica_id_for(a.url), replica_id_for(b.url)]
            assert kept.members[1] == first.members[1] and not kept.rejected  # its last answer, as it was
            while time.monotonic() - t0 < 1.6:
                time.sleep(0.1)
            gone = pool.discover_replicas()
            assert [r.replica for r in gone.members] == [replica_id_for(a.url)]
            assert [(r.path, r.reason) for r in gone.rejected] == [(b.url, "unreadable")]
            assert [(r.path, r.reason) for r in pool.discover_replicas().rejected] == [(b.url, "unreadable")]
        finally:
            pool.close()


def test_a_replica_never_heard_from_is_left_out_at_once() -> None:
    with StubReplica() as a:
        pool = StaticPool([a.url, "http://127.0.0.1:9"], timeout_s=1.0)
        try:
            snap = pool.discover_replicas()
            assert [r.replica for r in snap.members] == [replica_id_for(a.url)]
            assert [r.reason for r in snap.rejected] == ["unreadable"]
        finally:
            pool.close()
