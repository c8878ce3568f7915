"""The island relay and the HTTP store: coalesced, cached reads; replicas that follow a board through it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from flipsync.board import BoardReader
from flipsync.board.layout import RunLayout
from flipsync.errors import NotFoundError, PermanentStoreError, StoreError, TransientStoreError
from flipsync.relay.server import RelayCache, RelayConfig, create_relay_app
from flipsync.serving import ServerThread
from flipsync.sidecar.metrics import SidecarMetrics
from flipsync.sidecar.replica import Replica
from flipsync.stores import HttpStore, ObjectInfo, ObstoreStore, StoreWrapper, is_relay_url, open_store
from tests.sidecar.sidecar_helpers import FlakyStore, Trainer, fast_replica, same_bits, tiny_engine, wait_until

FAST_CONFIG = RelayConfig(hint_ttl_s=0.3, listing_ttl_s=0.3, negative_ttl_s=0.2, watch_interval_s=0.02)


@dataclass
class Relay:
    upstream: FlakyStore
    cache: RelayCache
    server: ServerThread

    def client(self, **kw: float) -> HttpStore:
        return HttpStore(self.server.url, timeout_s=10, retry_timeout_s=kw.get("retry_timeout_s", 3.0), max_retries=2)


@pytest.fixture
def relay(store: ObstoreStore) -> Iterator[Relay]:
    upstream = FlakyStore(store)
    cache = RelayCache(upstream, FAST_CONFIG)
    server = ServerThread(create_relay_app(cache)).start()
    yield Relay(upstream, cache, server)
    server.stop()


def test_replicas_follow_a_board_through_the_relay_and_the_wan_carries_each_part_once(
    trainer: Trainer, relay: Relay
) -> None:
    trainer.step()
    replicas = [
        Replica(BoardReader(relay.client(), "run"), tiny_engine(), config=fast_replica(), metrics=SidecarMetrics())
        for _ in range(3)
    ]
    threads = [threading.Thread(target=r.sync_once) for r in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in replicas:
        assert r.version == 1 and same_bits(r.engine.served, trainer.views[1])  # type: ignore[attr-defined]
    parts = [p for p in relay.upstream.gets if "/manifest.json" not in p and not p.endswith("latest.json")]
    assert parts and all(relay.upstream.gets[p] == 1 for p in parts)  # once per island, not per replica
    trainer.step()
    for r in replicas:  # the relay remembers the HEAD hint and a missing manifest for a moment
        assert wait_until(lambda r=r: r.sync_once() and r.version == 2, 5)
    parts = [p for p in relay.upstream.gets if "/versions/000000000002/" in p and "manifest" not in p]
    assert parts and all(relay.upstream.gets[p] == 1 for p in parts)


def test_concurrent_reads_of_one_object_make_one_upstream_fetch(trainer: Trainer, relay: Relay) -> None:
    m = trainer.step()
    path = f"{RunLayout('run').version_dir(1)}/{m.parts[0].path}"
    relay.upstream.get_delay_s = 0.3
    stores = [relay.client() for _ in range(8)]
    results: list[bytes] = []
    threads = [threading.Thread(target=lambda s=s: results.append(s.get(path))) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    want = relay.upstream.inner.get(path)
    assert len(results) == 8 and all(r == want for r in results)
    assert relay.upstream.gets[path] == 1
    assert relay.cache.stats["coalesced"] >= 1
    relay.upstream.get_delay_s = 0.0
    assert stores[0].get(path) == want and relay.upstream.gets[path] == 1  # from the cache
    assert stores[0].get_range(path, 10, 50) == want[10:50]
    assert stores[0].head(path).size == len(want)
    for s in stores:
        s.close()


def test_the_head_hint_expires_and_new_versions_appear(trainer: Trainer, relay: Relay) -> None:
    client = relay.client()
    layout = RunLayout("run")
    assert b'"version": 0' in client.get(layout.latest) or b'"version":0' in client.get(layout.latest)
    assert not client.exists(layout.version_manifest(1))  # remembered as missing, briefly
    trainer.step()
    reader = BoardReader(client, "run")
    assert wait_until(lambda: reader.head() == 1, 5)
    assert client.exists(layout.version_manifest(1))
    client.close()


def test_listings_and_errors(trainer: Trainer, relay: Relay) -> None:
    client = relay.client()
    assert client.list_dirs("runs") == ["run"]
    objs = client.list("runs/run/versions")
    assert any(o.path.endswith("manifest.json") for o in objs)
    with pytest.raises(NotFoundError):
        client.get("runs/run/nothing-here")
    with pytest.raises(StoreError, match="read-only"):
        client.put("x", b"1")
    r = httpx.get(f"{relay.server.url}/board/o/runs/../../etc/passwd")
    assert r.status_code in (400, 404)
    r = httpx.get(f"{relay.server.url}/board/o/runs/%2E%2E/x")
    assert r.status_code == 400
    r = httpx.get(f"{relay.server.url}/board/dirs", params={"prefix": "/abs"})
    assert r.status_code == 400
    stats = httpx.get(f"{relay.server.url}/relay/stats").json()
    assert stats["requests"] >= 3
    assert "flipsync_relay_upstream_requests_total" in httpx.get(f"{relay.server.url}/metrics").text
    client.close()


def test_a_relay_that_goes_away_and_comes_back(store: ObstoreStore, trainer: Trainer) -> None:
    cache = RelayCache(FlakyStore(store), FAST_CONFIG)
    server = ServerThread(create_relay_app(cache)).start()
    port = server.port
    client = HttpStore(server.url, timeout_s=5, retry_timeout_s=0.5, max_retries=1, init_backoff_s=0.05)
    rep = Replica(BoardReader(client, "run"), tiny_engine(), config=fast_replica(), metrics=SidecarMetrics())
    assert rep.sync_once() and rep.version == 0
    server.stop()
    trainer.step()
    t0 = time.monotonic()
    assert not rep.sync_once()
    assert time.monotonic() - t0 < 5  # bounded retries
    assert rep.version == 0 and rep.serving and rep.status()["error"]["kind"] == "board_unreachable"
    server = ServerThread(create_relay_app(RelayCache(FlakyStore(store), FAST_CONFIG)), port=port).start()
    try:
        assert rep.sync_once() and rep.version == 1 and same_bits(rep.engine.served, trainer.views[1])  # type: ignore[attr-defined]
    finally:
        server.stop()
        client.close()


def test_upstream_failures_surface_as_store_errors(store: ObstoreStore, trainer: Trainer, relay: Relay) -> None:
    relay.upstream.down = True
    client = relay.client(retry_timeout_s=0.3)
    with pytest.raises(StoreError, match="unreachable"):
        client.get("runs/run/latest.json")
    relay.upstream.down = False
    assert client.get("runs/run/latest.json")
    client.close()


def test_large_objects_are_relayed_without_being_kept(trainer: Trainer, store: ObstoreStore) -> None:
    upstream = FlakyStore(store)
    cache = RelayCache(upstream, RelayConfig(max_object_bytes=1000))
    with ServerThread(create_relay_app(cache)) as server:
        m = trainer.step()
        path = f"{RunLayout('run').version_dir(1)}/{m.parts[0].path}"
        client = HttpStore(server.url)
        want = store.get(path)
        assert client.get(path) == want and client.get(path) == want
        assert upstream.gets[path] == 2 and cache.cached_bytes < 1000 * 20
        assert client.get_range(path, 5, 105) == want[5:105]
        client.close()


def test_open_board_picks_the_relay_for_plain_http() -> None:
    assert is_relay_url("http://10.0.0.5:8200")
    assert not is_relay_url("https://acct.r2.cloudflarestorage.com/bucket")
    assert not is_relay_url("s3://bucket/board")
    store = open_store("http://127.0.0.1:9")
    assert isinstance(store, HttpStore)
    store.close()


def test_sidecars_waiting_for_a_version_share_one_poller_and_wake_when_it_lands(trainer: Trainer, relay: Relay) -> None:
    path = RunLayout("run").version_manifest(1)
    clients = [relay.client() for _ in range(8)]
    assert not clients[0].exists(path)  # now remembered as missing for negative_ttl_s
    woke: list[float] = []
    threads = [
        threading.Thread(target=lambda c=c: c.wait_exists(path, 10) and woke.append(time.monotonic())) for c in clients
    ]
    for t in threads:
        t.start()
    time.sleep(0.4)
    checks = relay.upstream.exist_checks[path]
    assert 5 <= checks <= 0.4 / FAST_CONFIG.watch_interval_s + 5  # one poller for the eight, every 20 ms
    published = time.monotonic()
    trainer.step()
    for t in threads:
        t.join(10)
    assert len(woke) == 8 and max(woke) - published < 1.0  # not the 10 s timeout, nor a poll interval
    assert clients[0].exists(path)  # the cached "missing" was dropped when it arrived
    assert clients[1].wait_exists(path, 5) is True  # known: answered at once
    for c in clients:
        c.close()


def test_a_wait_times_out_and_its_poller_stops(trainer: Trainer, relay: Relay) -> None:
    client = relay.client()
    path = RunLayout("run").version_manifest(7)
    t0 = time.monotonic()
    assert client.wait_exists(path, 0.3) is False
    assert 0.25 <= time.monotonic() - t0 < 3
    time.sleep(0.1)
    checks = relay.upstream.exist_checks[path]
    time.sleep(0.3)
    assert relay.upstream.exist_checks[path] == checks  # nobody waits: nothing polls the board
    with pytest.raises(StoreError, match="refused"):
        client.wait_exists(path, FAST_CONFIG.max_wait_s + 1)
    client.close()


def test_a_replica_behind_a_relay_learns_of_a_version_before_its_next_poll(trainer: Trainer, relay: Relay) -> None:
    replica = Replica(BoardReader(relay.client(), "run"), tiny_engine(), config=fast_replica(poll=30.0))
    replica.start()
    try:
        assert wait_until(lambda: replica.version == 0, 10)
        time.sleep(0.2)  # the loop is now waiting at the relay for v1
        published = time.monotonic()
        trainer.step()
        assert wait_until(lambda: replica.version == 1, 10)
        assert time.monotonic() - published < 3  # the poll interval is 30 s
        assert same_bits(replica.engine.served, trainer.views[1])  # type: ignore[attr-defined]
        stopping = time.monotonic()
    finally:
        replica.stop()
    assert time.monotonic() - stopping < 3  # the wait is sliced: stop is seen within a second


def test_a_relay_that_cannot_wait_is_polled_instead() -> None:
    from fastapi import FastAPI

    with ServerThread(FastAPI()) as server:  # answers 404 to every route, as a relay from before waiting
        client = HttpStore(server.url, timeout_s=5, retry_timeout_s=1, max_retries=1)
        assert client.wait_exists("runs/run/versions/000000000001/manifest.json", 5) is None
        assert BoardReader(client, "run").wait_for_version(1, 5) is None  # remembered: no second request
        client.close()


def test_while_sidecars_wait_the_relay_caches_what_is_already_in_the_versions_folder(
    trainer: Trainer, relay: Relay, store: ObstoreStore
) -> None:
    layout = RunLayout("run")
    chunk = f"{layout.version_dir(1)}/0123456789abcdef/patch-00000.safetensors.00001"
    elsewhere = f"{layout.version_dir(2)}/0123456789abcdef/patch-00000.safetensors.00001"
    store.put(chunk, b"coded sections" * 100)  # a trainer streaming v1's part, before v1's manifest
    store.put(elsewhere, b"not waited for")
    client = relay.client()
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(client.wait_exists(layout.version_manifest(1), 10)))
    waiter.start()
    assert wait_until(lambda: relay.upstream.gets.get(chunk) == 1, 5)  # fetched while the manifest is missing
    trainer.step()
    waiter.join(10)
    assert woke == [True]
    assert client.get(chunk) == b"coded sections" * 100
    assert relay.upstream.gets[chunk] == 1 and elsewhere not in relay.upstream.gets  # served from the cache
    assert chunk not in relay.upstream.heads  # its size came with the listing
    assert (relay.cache.metrics.registry.get_sample_value("flipsync_relay_fetched_ahead_total") or 0) >= 1
    client.close()


def test_a_relay_told_not_to_fetch_ahead_only_waits(trainer: Trainer, store: ObstoreStore) -> None:
    upstream = FlakyStore(store)
    cache = RelayCache(upstream, RelayConfig(watch_interval_s=0.02, fetch_ahead=False))
    server = ServerThread(create_relay_app(cache)).start()
    try:
        layout = RunLayout("run")
        chunk = f"{layout.version_dir(1)}/0123456789abcdef/patch-00000.safetensors.00001"
        store.put(chunk, b"x" * 100)
        client = HttpStore(server.url, timeout_s=10)
        assert client.wait_exists(layout.version_manifest(1), 0.3) is False
        assert chunk not in upstream.gets
        client.close()
    finally:
        server.stop()


class RefusingBoard(StoreWrapper):
    """The relay's board, refusing every read (as a bucket policy that denies this relay would)."""

    def __init__(self, inner: ObstoreStore) -> None:
        super().__init__(inner)
        self.calls = 0

    def _refuse(self, path: str) -> PermanentStoreError:
        self.calls += 1
        return PermanentStoreError(f"get {self.url}/{path} was refused: HTTP 403 AccessDenied; grant read access")

    def get(self, path: str, *, size: int | None = None) -> bytes:
        raise self._refuse(path)

    def head(self, path: str) -> ObjectInfo:
        raise self._refuse(path)

    def exists(self, path: str) -> bool:
        raise self._refuse(path)


def test_a_board_refusal_through_the_relay_is_raised_at_once_and_not_retried(store: ObstoreStore) -> None:
    upstream = RefusingBoard(store)
    with ServerThread(create_relay_app(RelayCache(upstream, FAST_CONFIG))) as server:
        client = HttpStore(server.url, timeout_s=5, retry_timeout_s=10, max_retries=4)
        for call in (
            lambda: client.get("runs/run/latest.json"),
            lambda: client.head("runs/run/latest.json"),  # no body: the header carries the kind
            lambda: client.wait_exists("runs/run/versions/000000000001/manifest.json", 5),
        ):
            before = upstream.calls
            t0 = time.monotonic()
            with pytest.raises(PermanentStoreError, match=r"the relay's board refused it.*AccessDenied"):
                call()
            assert time.monotonic() - t0 < 2
            assert upstream.calls == before + 1  # neither the client nor the relay tried again
        client.close()


def test_a_transient_board_failure_through_the_relay_is_not_retried_again(store: ObstoreStore) -> None:
    upstream = FlakyStore(store)
    upstream.down = True
    with ServerThread(create_relay_app(RelayCache(upstream, FAST_CONFIG))) as server:
        client = HttpStore(server.url, timeout_s=5, retry_timeout_s=10, max_retries=4)
        with pytest.raises(TransientStoreError, match=r"the relay retried it.*unreachable"):
            client.get("runs/run/latest.json")
        assert sum(upstream.heads.values()) + sum(upstream.gets.values()) <= 1  # one upstream try, by the relay
        client.close()


def test_a_relay_that_is_down_is_retried_within_its_bounds_and_says_so() -> None:
    from flipsync.serving import free_port

    client = HttpStore(
        f"http://127.0.0.1:{free_port()}", timeout_s=1, retry_timeout_s=5, max_retries=2, init_backoff_s=0.05
    )
    t0 = time.monotonic()
    with pytest.raises(TransientStoreError, match=r"failed after 3 tries over .* s \(at most 2 retries within 5 s\)"):
        client.get("runs/run/latest.json")
    assert time.monotonic() - t0 < 5
    client.close()
