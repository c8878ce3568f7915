"""Mirrored boards: a replica follows a regional copy of a board that a replicator fills late and out of order.

Two moto S3 buckets on loopback: the trainer's publisher writes real codec patches to the origin; a replicator
thread copies objects to the mirror with random delays in random order, manifests before their parts, and can
be told never to copy an object. The replica reads only through `MirrorStore` and must end bitwise on the
trainer's view, wait or fall back as its policy says, and never apply part of a version.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from board_helpers import make_s3_store

from flipsync.board import KeyframePolicy
from flipsync.board.layout import MANIFEST
from flipsync.board.mirror import MirrorCollector, MirrorPolicy, MirrorStore
from flipsync.codec.bits import int_view
from flipsync.errors import ConfigError, StoreError
from flipsync.formats import served_view
from flipsync.stores import ObstoreStore, open_store
from flipsync.trainer import Publisher, PublisherConfig
from tests.trainer.trainer_helpers import Replica as CodecReplica

pytestmark = pytest.mark.network_services
RUN = "mirrored"


class Trainer:
    """Real training-like updates of a few float32 masters, published inline (one version per step)."""

    def __init__(self, store: ObstoreStore, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.gen = g
        self.masters = {
            "model.embed_tokens.weight": torch.randn(96, 32, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(64, 32, generator=g),
            "model.norm.weight": torch.ones(32),
        }
        self.pub = Publisher(
            lambda: self.masters,
            store,
            run=RUN,
            config=PublisherConfig(
                background=False,
                spans=False,  # one way from v-1 to v: a dropped part cannot be routed around
                keyframe_policy=KeyframePolicy(chain_fraction=1e9),
                chunk_bytes=4096,  # several objects per part, so replication can split a version many ways
            ),
        )
        self.views = {0: self.view()}

    def view(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in served_view(self.masters, "bf16").items()}

    def step(self) -> int:
        for m in self.masters.values():
            mask = torch.rand(m.shape, generator=self.gen) < 0.3
            m.add_(0.05 * m.abs().clamp_min(1e-3) * torch.randn(m.shape, generator=self.gen) * mask)
        self.pub.step()
        head = self.pub.stats.head
        assert head is not None
        self.views[head] = self.view()
        return head


class Replicator(threading.Thread):
    """Copies new origin objects to the mirror, each after a random delay, due copies in random order.

    ``delay(path)`` gives an object's delay; ``drop`` names objects never copied (until ``copy`` is called).
    ``hold_parts`` (an Event) keeps every non-manifest object back until it is set.
    """

    def __init__(
        self,
        origin: ObstoreStore,
        mirror: ObstoreStore,
        *,
        seed: int,
        delay: Callable[[random.Random, str], float],
        drop: Callable[[str], bool] = lambda _p: False,
        hold_parts: threading.Event | None = None,
    ) -> None:
        super().__init__(name="replicator", daemon=True)
        self.origin, self.mirror = origin, mirror
        self.rng = random.Random(seed)
        self.delay, self.drop, self.hold_parts = delay, drop, hold_parts
        self.due: dict[str, float] = {}
        self.copied: list[str] = []
        self.dropped: set[str] = set()
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def copy(self, path: str) -> None:
        self.mirror.put(path, self.origin.get(path))
        self.copied.append(path)

    def run(self) -> None:
        seen: dict[str, object] = {}
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                for info in self.origin.list(""):
                    p, tag = info.path, (info.etag, info.size, info.modified)
                    if seen.get(p) == tag or p in self.dropped:
                        continue
                    if self.drop(p):
                        self.dropped.add(p)
                        continue
                    seen[p] = tag  # new, or rewritten (the HEAD hint): copy it after a delay
                    self.due[p] = now + self.delay(self.rng, p)
                ready = [p for p, t in self.due.items() if t <= time.monotonic()]
                if self.hold_parts is not None and not self.hold_parts.is_set():
                    ready = [p for p in ready if p.endswith((MANIFEST, "latest.json"))]
                self.rng.shuffle(ready)
                for p in ready:
                    self.copy(p)
                    del self.due[p]
                self.stop.wait(0.01)
        except BaseException as e:  # surfaced by the test
            self.error = e

    def close(self) -> None:
        self.stop.set()
        self.join(10)
        assert not self.is_alive()
        if self.error is not None:
            raise self.error


class Replica(CodecReplica):
    """The trainer tests' replica (every step applied with the codec, each view fingerprint checked), here
    reading the run through a mirror."""

    def __init__(self, store: MirrorStore) -> None:
        super().__init__(store, RUN)

    def follow_each(self, head: int) -> None:  # type: ignore[override]
        """Version by version (every patch applied), the way a polling sidecar meets them."""
        while self.follower.version != head:
            nxt = 0 if self.follower.version is None else self.follower.version + 1
            assert self.sync(goal=nxt) == nxt


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(int_view(a[k]), int_view(b[k])) for k in a)


def reopen(store: ObstoreStore) -> ObstoreStore:
    return open_store(store.url, store.options)


@pytest.fixture
def buckets(moto_endpoint: str, no_cloud_env: None) -> Iterator[tuple[ObstoreStore, ObstoreStore]]:
    origin, mirror = make_s3_store(moto_endpoint), make_s3_store(moto_endpoint)
    yield origin, mirror
    origin.close()
    mirror.close()


def test_replica_follows_a_live_mirror_bitwise_and_measures_lag(buckets: tuple[ObstoreStore, ObstoreStore]) -> None:
    """Trainer, replicator and replica run at once; manifests lag 0.2-0.4 s, parts 0.05-0.6 s, any order."""
    origin, mirror = buckets
    trainer = Trainer(origin)

    def delay(rng: random.Random, path: str) -> float:
        return rng.uniform(0.2, 0.4) if path.endswith(MANIFEST) else rng.uniform(0.05, 0.6)

    rep = Replicator(origin, mirror, seed=1, delay=delay)
    rep.start()
    store = MirrorStore(reopen(mirror), policy=MirrorPolicy(wait_s=30.0, poll_s=0.02))
    replica = Replica(store)
    steps = 6

    def train() -> None:
        for _ in range(steps):
            trainer.step()
            time.sleep(0.1)

    training = threading.Thread(target=train)
    training.start()
    try:
        deadline = time.monotonic() + 60
        while replica.follower.version != steps:
            assert time.monotonic() < deadline, f"the replica is at v{replica.follower.version}"
            head = replica.reader.head()
            if head is not None:
                replica.follow_each(head)
            time.sleep(0.02)
    finally:
        training.join(60)
        rep.close()
        trainer.pub.close()
    assert same_bits(replica.tensors, trainer.views[steps])
    s = store.stats
    assert s.origin_reads == 0 and s.unavailable == 0
    # A lag sample per version manifest the reader saw appear (it polls every 20 ms, the replicator holds
    # each manifest back 0.2 s or more): every one reached the mirror at least 0.2 s after it was created.
    assert 1 <= s.manifests <= steps + 1
    assert s.lag_sum_s / s.manifests >= 0.2 and s.lag_max_s >= 0.2
    store.close()


def test_manifests_before_their_parts_are_waited_for(buckets: tuple[ObstoreStore, ObstoreStore]) -> None:
    """Every manifest (shuffled) is on the mirror before any part: the reader waits, then ends bitwise."""
    origin, mirror = buckets
    trainer = Trainer(origin, seed=2)
    for _ in range(4):
        trainer.step()
    trainer.pub.close()
    hold = threading.Event()
    rep = Replicator(origin, mirror, seed=2, delay=lambda rng, _p: rng.uniform(0.0, 0.05), hold_parts=hold)
    rep.start()
    store = MirrorStore(reopen(mirror), policy=MirrorPolicy(wait_s=30.0, poll_s=0.02))
    replica = Replica(store)
    done: list[BaseException | None] = []

    def follow() -> None:
        try:
            deadline = time.monotonic() + 30
            while replica.reader.head() != 4:  # the manifests arrive first, in random order
                assert time.monotonic() < deadline
                time.sleep(0.02)
            replica.follow_each(4)
            done.append(None)
        except BaseException as e:
            done.append(e)

    t = threading.Thread(target=follow)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while store.stats.waits == 0:  # the reader holds a manifest and waits for its parts
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.02)
        assert replica.follower.version is None  # nothing applied while parts are missing
        hold.set()
        t.join(60)
    finally:
        hold.set()
        rep.close()
    assert done == [None]
    assert same_bits(replica.tensors, trainer.views[4])
    s = store.stats
    assert s.waits >= 1 and s.waited_s > 0 and s.origin_reads == 0
    store.close()


def test_an_object_never_replicated(buckets: tuple[ObstoreStore, ObstoreStore]) -> None:
    """One part object of v3 never reaches the mirror. Without fallback the replica stays on v2, bitwise,
    with an error naming the object, and moves on once the object arrives; with fallback it reads the object
    from the origin."""
    origin, mirror = buckets
    trainer = Trainer(origin, seed=3)
    for _ in range(5):
        trainer.step()
    trainer.pub.close()
    v3 = "runs/mirrored/versions/000000000003/"
    v3_parts = [o.path for o in origin.list(v3.rstrip("/")) if not o.path.endswith(MANIFEST)]
    lost = sorted(v3_parts)[-1]
    rep = Replicator(origin, mirror, seed=3, delay=lambda rng, _p: rng.uniform(0.0, 0.1), drop=lambda p: p == lost)
    rep.start()
    try:
        deadline = time.monotonic() + 30
        while len(rep.copied) < len(origin.list("")) - 1:  # everything but the lost object
            assert time.monotonic() < deadline
            time.sleep(0.02)

        strict = MirrorStore(reopen(mirror), policy=MirrorPolicy(wait_s=0.3, poll_s=0.05, fallback=False))
        replica = Replica(strict)
        replica.follow_each(2)
        with pytest.raises(StoreError, match="mirror still lacks this object") as err:
            replica.sync(goal=3)
        assert lost in str(err.value)
        assert replica.follower.version == 2 and same_bits(replica.tensors, trainer.views[2])  # nothing partial
        with pytest.raises(StoreError):
            replica.sync()  # keeps refusing while the object is missing ...
        assert replica.follower.version == 2 and same_bits(replica.tensors, trainer.views[2])
        assert strict.stats.unavailable >= 2 and strict.stats.origin_reads == 0
        assert strict.stats.manifests == 0  # it booted on a full copy: catching up is not replication lag

        fallback = MirrorStore(reopen(mirror), reopen(origin), MirrorPolicy(wait_s=0.3, poll_s=0.05))
        other = Replica(fallback)
        other.follow_each(5)
        assert same_bits(other.tensors, trainer.views[5])
        assert fallback.stats.origin_reads >= 1 and fallback.stats.origin_bytes > 0
        fallback.close()

        rep.copy(lost)  # ... and moves on once the mirror has it
        assert replica.sync() == 5 and same_bits(replica.tensors, trainer.views[5])
        strict.close()
    finally:
        rep.close()


def test_mirror_is_read_only_and_exports_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    store = MirrorStore(open_store("memory://"), policy=MirrorPolicy(wait_s=0.0))
    with pytest.raises(ConfigError, match="read-only"):
        store.put("runs/r/latest.json", b"{}")
    with pytest.raises(ConfigError):
        MirrorPolicy(wait_s=-1)
    registry = CollectorRegistry()
    registry.register(MirrorCollector(store))
    text = generate_latest(registry).decode()
    assert "flipsync_mirror_lag_seconds -1.0" in text and "flipsync_mirror_origin_reads_total 0.0" in text
    store.close()
