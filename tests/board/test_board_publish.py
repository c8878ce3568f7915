"""The publish protocol against real stores: create-only manifests, racing and stale publishers, restarts,
crashes at every step, and catch-up over chains, spans and keyframes."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from board_helpers import Recorder, backend_params, build_run, fp, patch_bytes, small_view, span_bytes

from flipsync.board.catalog import content_hash
from flipsync.board.follow import Follower
from flipsync.board.layout import RunLayout, new_attempt_id
from flipsync.board.reader import BoardReader, KeyframeStep, PatchStep
from flipsync.board.signing import Signer, Verifier, generate_keypair
from flipsync.board.writer import BoardWriter
from flipsync.domain.manifest import Kind, Manifest, Part
from flipsync.errors import BoardError, ConflictError, IntegrityError, NotFoundError, StoreError
from flipsync.stores import ObstoreStore, StoreWrapper

ALL = backend_params()


def ends(
    base: int, target: int, lineage: str = "a", *, base_lineage: str = "a", served_format: str = "bf16"
) -> dict[str, Any]:
    """The keyword arguments naming a patch's or a span's two ends: v``base`` to v``target`` of ``lineage``."""
    return {
        "base_version": base,
        "target_version": target,
        "base_view_fp": fp(base, base_lineage),
        "target_view_fp": fp(target, lineage),
        "served_format": served_format,
    }


def patch(pub: BoardWriter, v: int, lineage: str = "a", size: int = 2000) -> None:
    pub.publish_patch([patch_bytes(v, size)], **ends(v - 1, v, lineage, base_lineage=lineage))


@pytest.mark.parametrize("store_factory", ALL, indirect=True)
def test_publish_then_catch_up_from_anywhere(store: ObstoreStore) -> None:
    build_run(store, 6, keyframes=(4,), spans=True)
    reader = BoardReader(store, "run")
    assert reader.head() == 6

    # A new replica boots from the newest keyframe, then patches.
    rec = Recorder()
    f = Follower(reader)
    assert f.sync(rec) == 6
    first = rec.steps[0]
    assert isinstance(first, KeyframeStep) and first.target_version == 4
    assert all(torch.equal(first.tensors[k], small_view(4)[k]) for k in small_view(4))
    assert rec.edges[1:] == [("span", 4, 6)]  # 2250 bytes, the two patches 5000
    assert f.version == 6 and f.view_fp == fp(6)

    # A lagging replica takes the chain or a squashed span, whichever is fewer bytes.
    rec = Recorder()
    f = Follower(reader, version=0, view_fp=fp(0))
    assert f.sync(rec) == 6
    assert rec.edges == [("span", 0, 4), ("span", 4, 6)]
    assert f.bytes_downloaded == sum(s.manifest.total_size for s in rec.steps)
    rec = Recorder()
    assert Follower(reader, version=5, view_fp=fp(5)).sync(rec) == 6
    step = rec.steps[0]
    assert isinstance(step, PatchStep) and step.manifest.base_version == 5
    assert step.parts == [patch_bytes(6), patch_bytes(-6, 500)]

    # Already current: nothing to do.
    rec = Recorder()
    assert Follower(reader, version=6, view_fp=fp(6)).sync(rec) == 6 and rec.steps == []


@pytest.mark.parametrize("store_factory", ALL, indirect=True)
def test_racing_publishers_exactly_one_creates_the_version(store: ObstoreStore) -> None:
    build_run(store, 1)
    pubs = [BoardWriter(store, "run", publisher_id=f"trainer-{i}") for i in range(6)]
    for p in pubs:
        p.resume()
    results: dict[int, object] = {}
    barrier = threading.Barrier(len(pubs))

    def go(i: int) -> None:
        barrier.wait(timeout=10)
        try:
            results[i] = pubs[i].publish_patch([patch_bytes(100 + i)], **ends(1, 2, f"trainer{i}"))
        except ConflictError as e:
            results[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(pubs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    winners = [i for i, r in results.items() if not isinstance(r, Exception)]
    assert len(results) == len(pubs) and len(winners) == 1
    for i, r in results.items():
        if i != winners[0]:
            assert isinstance(r, ConflictError) and "fenced off" in str(r)
    # The board holds the winner's version, and only the winner's parts (losers clean up after themselves).
    reader = BoardReader(store, "run")
    m = reader.catalog.version(2)
    assert m.publisher == f"trainer-{winners[0]}" and m.target_view_fp == fp(2, f"trainer{winners[0]}")
    folder = RunLayout("run").version_dir(2)
    attempts = {o.path[len(folder) + 1 :].split("/")[0] for o in store.list(folder)} - {"manifest.json"}
    assert attempts == {m.parts[0].path.split("/")[0]}
    rec = Recorder()
    assert Follower(reader, version=1, view_fp=fp(1)).sync(rec) == 2
    assert rec.steps[0].parts == [patch_bytes(100 + winners[0])]  # type: ignore[union-attr]


@pytest.mark.parametrize("store_factory", backend_params("file", "s3"), indirect=True)
def test_stale_and_restarted_trainers_are_fenced(store: ObstoreStore) -> None:
    a = build_run(store, 2, publisher_id="trainer-a")
    b = BoardWriter(store, "run", publisher_id="trainer-b")
    assert b.resume() is not None and b.head is not None and b.head.version == 2
    patch(a, 3)  # a moves on; b still believes HEAD is v2
    with pytest.raises(ConflictError, match=r"v3 of run 'run' was already published by trainer-a"):
        b.publish_patch([b"b's patch"], **ends(2, 3, "b"))
    # A trainer restarted from an older checkpoint (its base is v1) is fenced with a clear message.
    c = BoardWriter(store, "run", publisher_id="trainer-c")
    with pytest.raises(ConflictError, match=r"its base is v1 .* board's HEAD is v3"):
        patch(c, 2)
    # Same version number but a different view (a second trainer in lock step) is fenced too.
    with pytest.raises(ConflictError, match="fenced off"):
        c.publish_patch([b"x"], **ends(3, 4, "other", base_lineage="other"))
    # Taking over explicitly: a snapshot on top of HEAD; patches then continue from it.
    c.publish_snapshot(small_view(9), version=4, view_fp=fp(4, "c"), served_format="bf16")
    patch(c, 5, lineage="c")
    with pytest.raises(ConflictError):
        patch(a, 4)
    assert a.resume() is not None and a.head is not None and a.head.publisher == "trainer-c"
    # Replicas follow the takeover: the snapshot is a keyframe.
    rec = Recorder()
    f = Follower(BoardReader(store, "run"), version=3, view_fp=fp(3))
    assert f.sync(rec) == 5
    assert rec.edges == [("keyframe", None, 4), ("patch", 4, 5)]


def test_publish_arguments_are_checked(store: ObstoreStore) -> None:
    pub = BoardWriter(store, "run", publisher_id="t")
    with pytest.raises(ConflictError, match="no version yet"):
        patch(pub, 1)
    with pytest.raises(ConflictError, match="must be v0"):
        pub.publish_snapshot(small_view(), version=3, view_fp=fp(3), served_format="bf16")
    pub.publish_snapshot(small_view(), version=0, view_fp=fp(0), served_format="bf16")
    with pytest.raises(BoardError, match="publish_span"):
        pub.publish_patch([b"x"], **ends(0, 2))
    with pytest.raises(BoardError, match="served format"):
        pub.publish_patch([b"x"], **ends(0, 1, served_format="fp8"))
    patch(pub, 1)
    with pytest.raises(IntegrityError, match="not v1's view"):
        pub.publish_keyframe(small_view(1), version=1, view_fp=fp(1, "zz"), served_format="bf16")
    with pytest.raises(IntegrityError, match="span's target view"):
        pub.publish_span([b"x"], **{**ends(0, 1), "target_view_fp": fp(7)})
    with pytest.raises(NotFoundError):
        pub.publish_keyframe(small_view(1), version=5, view_fp=fp(5), served_format="bf16")
    # Keyframes and spans are idempotent: a second publisher doing the same work gets the same answer.
    k1 = pub.publish_keyframe(small_view(1), version=1, view_fp=fp(1), served_format="bf16")
    other = BoardWriter(store, "run", publisher_id="t2")
    assert other.publish_keyframe(small_view(1), version=1, view_fp=fp(1), served_format="bf16") == k1
    s1 = pub.publish_span([span_bytes(0, 1)], **ends(0, 1))
    s2 = other.publish_span([b"different bytes"], **ends(0, 1))
    assert s1 == s2
    # A snapshot version is its own keyframe.
    assert pub.publish_keyframe(small_view(), version=0, view_fp=fp(0), served_format="bf16").version == 0


class CrashingStore(StoreWrapper):
    """A real store with a fault injected at one step of the protocol (the process 'dies' there)."""

    def __init__(self, inner: ObstoreStore, *, crash_on: str, land_first: bool = False) -> None:
        super().__init__(inner)
        self.crash_on = crash_on  # "manifest", "hint" or "part"
        self.land_first = land_first  # perform the write, then fail (an ambiguous timeout)

    def put(self, path: str, data: bytes | bytearray | memoryview, *, create_only: bool = False) -> None:
        hit = (
            (self.crash_on == "manifest" and create_only)
            or (self.crash_on == "hint" and path.endswith("latest.json"))
            or (self.crash_on == "part" and path.endswith("patch-00001.safetensors"))
        )
        if hit:
            if self.land_first:
                self.inner.put(path, data, create_only=create_only)
                raise StoreError(f"timed out writing {path} (but it landed)")
            raise KeyboardInterrupt(f"simulated crash before {path}")
        self.inner.put(path, data, create_only=create_only)

    def close(self) -> None:
        pass  # the test closes the real store itself


@pytest.mark.parametrize("store_factory", backend_params("file", "memory", "s3"), indirect=True)
@pytest.mark.parametrize("crash_on", ["part", "manifest", "hint"])
def test_crash_at_any_step_leaves_a_usable_board(store: ObstoreStore, crash_on: str) -> None:
    build_run(store, 3)
    crashing = BoardWriter(CrashingStore(store, crash_on=crash_on), "run", publisher_id="trainer-0")
    crashing.resume()
    with pytest.raises(KeyboardInterrupt):
        crashing.publish_patch([patch_bytes(4), patch_bytes(-4)], **ends(3, 4))
    published = crash_on == "hint"  # the manifest was written before the crash
    reader = BoardReader(store, "run")
    assert reader.head() == (4 if published else 3)
    rec = Recorder()
    assert Follower(reader, version=1, view_fp=fp(1)).sync(rec) == (4 if published else 3)
    # The restarted publisher resumes from the newest manifest and carries on.
    restarted = BoardWriter(store, "run", publisher_id="trainer-0")
    head = restarted.resume()
    assert head is not None and head.version == (4 if published else 3)
    for v in range(head.version + 1, 6):
        patch(restarted, v)
    assert BoardReader(store, "run").head() == 5


@pytest.mark.parametrize("store_factory", backend_params("file", "s3"), indirect=True)
def test_ambiguous_manifest_write_is_resolved_by_reading_back(store: ObstoreStore) -> None:
    build_run(store, 1)
    crashing = CrashingStore(store, crash_on="manifest", land_first=True)
    pub = BoardWriter(crashing, "run", publisher_id="trainer-0")
    m = pub.publish_patch([patch_bytes(2)], **ends(1, 2))
    assert BoardReader(store, "run").catalog.version(2) == m


def test_restarted_publisher_restores_cadence(store: ObstoreStore) -> None:
    build_run(store, 5, keyframes=(2,), patch_size=1000)
    pub = BoardWriter(store, "run", publisher_id="trainer-0")
    pub.resume()
    c = pub.cadence
    assert c.keyframe_version == 2 and c.versions_since == 3
    assert c.chain_bytes == 3 * (1000 + 250)
    assert c.keyframe_bytes == BoardReader(store, "run").catalog.keyframe(2).total_size
    assert pub.spans_due(8) == [(6, 8), (4, 8), (0, 8)]
    pub.publish_keyframe(small_view(5), version=5, view_fp=fp(5), served_format="bf16")
    assert pub.cadence.versions_since == 0 and pub.cadence.chain_bytes == 0
    assert not pub.keyframe_due()


def test_hint_is_only_a_hint(store: ObstoreStore) -> None:
    build_run(store, 4)
    layout = RunLayout("run")
    reader = BoardReader(store, "run")
    for hint in (b'{"version": 999}', b'{"version": 1}', b"garbage", b'{"version": -3}'):
        store.put(layout.latest, hint)
        assert BoardReader(store, "run").head() == 4
    store.delete([layout.latest])
    assert reader.head() == 4
    assert reader.catalog.version(4).kind is Kind.PATCH


def upload(store: ObstoreStore, version: int, attempt: str, parts: list[bytes]) -> list[Part]:
    """What each rank of a sharded trainer does: put its part in the shared attempt folder, durably."""
    folder = RunLayout("run").version_dir(version)
    out = []
    for rank, data in enumerate(parts):
        rel = f"{attempt}/patch-{rank:05d}.safetensors"
        store.put(f"{folder}/{rel}", data)
        store.make_durable([f"{folder}/{rel}"])
        out.append(Part(path=rel, size=len(data), hash=content_hash(data)))
    return out


def commit(pub: BoardWriter, parts: list[Part], v: int, lineage: str = "a") -> Manifest:
    return pub.publish_uploaded_patch(parts, **ends(v - 1, v, lineage), meta={"ranks": len(parts)})


@pytest.mark.parametrize("store_factory", ALL, indirect=True)
def test_publish_uploaded_patch_publishes_parts_uploaded_by_others(store: ObstoreStore) -> None:
    private, public = generate_keypair()
    pub = build_run(store, 2, publisher_id="rank-0", signer=Signer.from_pem(private))
    chain_before = pub.cadence.chain_bytes
    data = [patch_bytes(30), patch_bytes(31, 700), patch_bytes(32, 10)]
    m = commit(pub, upload(store, 3, new_attempt_id(), data), 3)
    assert (m.kind, m.base_version, m.version, m.publisher) == (Kind.PATCH, 2, 3, "rank-0")
    assert m.meta == {"ranks": 3, "origin": 0} and m.signature is not None
    # HEAD and the keyframe cadence move exactly as after publish_patch.
    assert pub.head == m and pub.cadence.chain_bytes == chain_before + sum(map(len, data))
    reader = BoardReader(store, "run", verifier=Verifier.from_pem(public))
    rec = Recorder()
    assert Follower(reader, version=2, view_fp=fp(2)).sync(rec) == 3
    assert rec.steps[0].parts == data  # type: ignore[union-attr]
    patch(pub, 4)  # a normal publish continues the chain


@pytest.mark.parametrize("store_factory", backend_params("file", "memory", "s3"), indirect=True)
def test_publish_uploaded_patch_is_fenced_like_publish_patch(store: ObstoreStore) -> None:
    a = build_run(store, 2, publisher_id="trainer-a")
    b = BoardWriter(store, "run", publisher_id="trainer-b")
    b.resume()
    patch(a, 3)  # a moves on; b still believes HEAD is v2
    folder = RunLayout("run").version_dir(3)
    stale = upload(store, 3, new_attempt_id(), [patch_bytes(-30), patch_bytes(-31)])
    with pytest.raises(ConflictError, match=r"fenced off: v3 of run 'run' was already published by trainer-a"):
        commit(b, stale, 3, lineage="b")
    # The loser's parts are unreferenced, so they are removed; the winner's stay.
    left = {o.path for o in store.list(folder)}
    assert not any(f"{folder}/{p.path}" in left for p in stale)
    assert all(f"{folder}/{p.path}" in left for p in BoardReader(store, "run").catalog.version(3).parts)
    # A committer whose base is older than HEAD is refused before anything is written.
    c = BoardWriter(store, "run", publisher_id="trainer-c")
    with pytest.raises(ConflictError, match=r"its base is v2 .* board's HEAD is v3"):
        commit(c, upload(store, 3, new_attempt_id(), [patch_bytes(-32)]), 3, lineage="c")
    with pytest.raises(BoardError, match="served format"):
        parts = upload(store, 4, new_attempt_id(), [patch_bytes(-40)])
        c.publish_uploaded_patch(parts, **ends(3, 4, served_format="fp8"))
    assert BoardReader(store, "run").head() == 3


@pytest.mark.parametrize("store_factory", backend_params("file", "memory", "s3"), indirect=True)
def test_publish_uploaded_patch_refuses_missing_or_wrong_parts(store: ObstoreStore) -> None:
    pub = build_run(store, 1, publisher_id="rank-0")
    attempt = new_attempt_id()
    parts = upload(store, 2, attempt, [patch_bytes(20), patch_bytes(21)])
    lost = Part(path=f"{attempt}/patch-00002.safetensors", size=10, hash=content_hash(b"never uploaded"))
    with pytest.raises(NotFoundError, match=r"1 of 3 part objects are not on the board \(.*patch-00002"):
        commit(pub, [*parts, lost], 2)
    short = Part(path=parts[1].path, size=parts[1].size + 1, hash=parts[1].hash)
    with pytest.raises(IntegrityError, match=r"patch-00001.safetensors is 2000 bytes on the board, not the 2001"):
        commit(pub, [parts[0], short], 2)
    with pytest.raises(BoardError, match="no parts"):
        commit(pub, [], 2)
    # Nothing was created: the version is still free, and the right parts commit.
    assert BoardReader(store, "run").head() == 1
    assert commit(pub, parts, 2).parts == tuple(parts)
