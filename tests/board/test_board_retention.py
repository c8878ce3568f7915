"""Retention: old versions go, readers inside the window and new replicas never break, orphans are swept."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from board_helpers import Recorder, backend_params, build_run, fp, patch_bytes, small_view

from flipsync.board.follow import Follower
from flipsync.board.layout import RunLayout
from flipsync.board.reader import BoardReader
from flipsync.board.retention import RetentionPolicy, collect_garbage
from flipsync.board.writer import BoardWriter
from flipsync.errors import ConfigError
from flipsync.stores import ObstoreStore

L = RunLayout("run")


def paths(store: ObstoreStore) -> set[str]:
    return {o.path for o in store.list(L.root)}


@pytest.mark.parametrize("store_factory", backend_params("file", "memory", "s3"), indirect=True)
def test_gc_keeps_every_reader_in_the_window_working(store: ObstoreStore) -> None:
    build_run(store, 20, keyframes=(10, 15), spans=True)
    before = paths(store)
    dry = collect_garbage(store, "run", RetentionPolicy(keep_versions=5), dry_run=True)
    assert paths(store) == before and dry.deleted_versions
    r = collect_garbage(store, "run", RetentionPolicy(keep_versions=5))
    # Window v16..v20; the newest keyframe is v15, so the cutoff is v15.
    assert (r.head, r.newest_keyframe, r.cutoff) == (20, 15, 15)
    assert r.deleted_versions == list(range(15)) and r.deleted_keyframes == [10]
    assert all(a < 15 for a, _ in r.deleted_spans) and (16, 20) not in r.deleted_spans
    assert r.deleted_versions == dry.deleted_versions and r.deleted_bytes == dry.deleted_bytes
    cat = BoardReader(store, "run").catalog
    assert cat.list_versions() == list(range(15, 21)) and cat.list_keyframes() == [15]
    assert all(a >= 15 for a, _ in cat.list_spans())
    # Every replica inside the window catches up; so does a new one; one outside re-plans via the keyframe.
    for start in [None, 3, 12, *range(15, 21)]:
        rec = Recorder()
        f = Follower(BoardReader(store, "run"), version=start, view_fp=None if start is None else fp(start))
        assert f.sync(rec) == 20, start
        if start is not None and start < 15:
            assert rec.edges[0] == ("keyframe", None, 15)
    # A second pass has nothing left to do.
    again = collect_garbage(store, "run", RetentionPolicy(keep_versions=5))
    assert not (again.deleted_versions or again.deleted_keyframes or again.deleted_spans or again.deleted_orphans)


def test_cutoff_never_passes_the_newest_keyframe(store: ObstoreStore) -> None:
    build_run(store, 12)  # only the v0 snapshot is a keyframe
    r = collect_garbage(store, "run", RetentionPolicy(keep_versions=3))
    assert r.cutoff == 0 and r.deleted_versions == []
    assert Follower(BoardReader(store, "run")).sync(Recorder()) == 12


def test_time_window_widens_the_count_window(store: ObstoreStore) -> None:
    now = datetime(2026, 6, 1, tzinfo=UTC)
    current = [now]

    def clock() -> str:
        return current[0].strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    def at(v: int) -> None:  # version v is created (20 - v) hours before `now`
        current[0] = now - timedelta(hours=20 - v)

    pub = BoardWriter(store, "run", publisher_id="trainer-0", clock=clock)
    at(0)
    pub.publish_snapshot(small_view(0), version=0, view_fp=fp(0), served_format="bf16")
    for v in range(1, 17):
        at(v)
        pub.publish_patch(
            [patch_bytes(v)],
            base_version=v - 1,
            target_version=v,
            base_view_fp=fp(v - 1),
            target_view_fp=fp(v),
            served_format="bf16",
        )
        if v == 2:
            pub.publish_keyframe(small_view(2), version=2, view_fp=fp(2), served_format="bf16")
        if v == 12:
            # By count the window is v11..v12, widened by time to v10; the newest keyframe (v2) bounds
            # the cutoff, so only v0 and v1 go.
            r = collect_garbage(store, "run", RetentionPolicy(keep_versions=2, keep_seconds=10.5 * 3600), now=now)
            assert r.cutoff == 2 and r.deleted_versions == [0, 1]
    pub.publish_keyframe(small_view(16), version=16, view_fp=fp(16), served_format="bf16")
    r = collect_garbage(store, "run", RetentionPolicy(keep_versions=2, keep_seconds=10.5 * 3600), now=now)
    # By count v15..v16; by time every version within 10.5 h of `now` (v10 is 10 h old, v9 11 h).
    assert r.cutoff == 10 and r.deleted_versions == list(range(2, 10)) and r.deleted_keyframes == [2]


@pytest.mark.parametrize("store_factory", backend_params("file", "s3"), indirect=True)
def test_orphans_are_swept_after_the_grace_period_only(store: ObstoreStore) -> None:
    build_run(store, 3)
    lost_race = f"{L.version_dir(3)}/deadbeefdeadbeef/patch-00000.safetensors"  # a loser's parts
    crashed = f"{L.version_dir(4)}/0123456789abcdef/patch-00000.safetensors"  # a publish that never finished
    for p in (lost_race, crashed):
        store.put(p, b"orphan")
    r = collect_garbage(store, "run", RetentionPolicy(keep_versions=100, orphan_grace_s=3600))
    assert r.deleted_orphans == 0 and {lost_race, crashed} <= paths(store)  # could be a publish in flight
    later = datetime.now(UTC) + timedelta(hours=2)
    r = collect_garbage(store, "run", RetentionPolicy(keep_versions=100, orphan_grace_s=3600), now=later)
    assert r.deleted_orphans == 2 and not ({lost_race, crashed} & paths(store))
    assert Follower(BoardReader(store, "run")).sync(Recorder()) == 3


def test_unreadable_manifest_folders_are_left_alone(store: ObstoreStore) -> None:
    build_run(store, 3)
    store.delete([L.version_manifest(3)])
    store.put(L.version_manifest(3), b"garbage", create_only=True)
    later = datetime.now(UTC) + timedelta(hours=2)
    before = paths(store)
    r = collect_garbage(store, "run", RetentionPolicy(keep_versions=100, orphan_grace_s=0), now=later)
    assert r.kept_unreadable == [L.version_dir(3)] and paths(store) == before


def test_policy_validation_and_empty_run(store: ObstoreStore) -> None:
    with pytest.raises(ConfigError):
        RetentionPolicy(keep_versions=0)
    r = collect_garbage(store, "nothing-here")
    assert r.head is None and r.cutoff is None
