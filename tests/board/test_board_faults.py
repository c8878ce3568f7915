"""Bad input and faults: each gives a clear error, the replica stays on its last good version, and nothing
on the board is lost or overwritten."""

from __future__ import annotations

import json

import pytest
from board_helpers import Recorder, SilentS3, backend_params, build_run, fp, patch_bytes

from flipsync.board.follow import Follower
from flipsync.board.layout import RunLayout
from flipsync.board.reader import BoardReader, Step
from flipsync.errors import BoardError, IntegrityError, StoreError
from flipsync.stores import ObstoreStore

L = RunLayout("run")


def snapshot_of_board(store: ObstoreStore) -> dict[str, bytes]:
    return {o.path: store.get(o.path) for o in store.list(L.root) if not o.path.endswith("latest.json")}


def part_path(store: ObstoreStore, v: int, i: int = 0) -> str:
    m = BoardReader(store, "run").catalog.version(v)
    return f"{L.version_dir(v)}/{m.parts[i].path}"


@pytest.mark.parametrize("store_factory", backend_params("file", "s3"), indirect=True)
def test_missing_part_with_no_alternative_stays_on_last_good(store: ObstoreStore) -> None:
    build_run(store, 5)
    store.delete([part_path(store, 4, 1)])
    rec = Recorder()
    f = Follower(BoardReader(store, "run"), version=2, view_fp=fp(2))
    with pytest.raises(IntegrityError, match=r"patch-00001.safetensors is missing.*no other way to v5"):
        f.sync(rec)
    # v3 was verified and applied before v4 failed; the replica sits on v3, its last good version.
    assert f.version == 3 and f.view_fp == fp(3)
    assert rec.edges == [("patch", 2, 3)]


@pytest.mark.parametrize("store_factory", backend_params("file", "memory"), indirect=True)
def test_corrupt_part_is_routed_around(store: ObstoreStore) -> None:
    build_run(store, 6, keyframes=(6,), patch_size=4000)
    path = part_path(store, 4)
    good = store.get(path)
    store.put(path, bytes(len(good)))  # same size, wrong bytes
    rec = Recorder()
    f = Follower(BoardReader(store, "run"), version=3, view_fp=fp(3))
    assert f.sync(rec) == 6
    # The chain 3->6 was cheaper, but v4's part fails its hash: the keyframe of v6 is used instead.
    assert rec.edges == [("keyframe", None, 6)]


def test_corrupt_part_error_is_clear(store: ObstoreStore) -> None:
    build_run(store, 3)
    path = part_path(store, 3)
    store.put(path, b"x" * len(store.get(path)))
    f = Follower(BoardReader(store, "run"), version=2, view_fp=fp(2), max_replans=0)
    with pytest.raises(IntegrityError, match=r"corrupt: BLAKE3 .* manifest says"):
        f.sync(Recorder())
    assert f.version == 2


@pytest.mark.parametrize("store_factory", backend_params("file", "s3"), indirect=True)
@pytest.mark.parametrize(
    "damage",
    [b"{not json", b"[]", b'{"schema": 1}', "wrong-run", "wrong-version", "escaping-path"],
)
def test_bad_head_manifest_is_refused(store: ObstoreStore, damage: bytes | str) -> None:
    build_run(store, 4)
    path = L.version_manifest(4)
    d = json.loads(store.get(path))
    if damage == "wrong-run":
        d["run"] = "other"
    elif damage == "wrong-version":
        d.update(version=3, target_version=3, base_version=2)
    elif damage == "escaping-path":
        d["parts"][0]["path"] = "../../000000000003/" + d["parts"][0]["path"]
    raw = damage if isinstance(damage, bytes) else json.dumps(d).encode()
    store.delete([path])
    store.put(path, raw, create_only=True)  # the forger wins the race for v4
    before = snapshot_of_board(store)
    rec = Recorder()
    f = Follower(BoardReader(store, "run"), version=2, view_fp=fp(2))
    with pytest.raises(IntegrityError) as err:
        f.sync(rec)
    assert str(err.value)  # a clear message naming the manifest
    assert "000000000004/manifest.json" in str(err.value)
    assert f.version == 2 and rec.steps == []
    assert snapshot_of_board(store) == before  # the reader changed nothing on the board


@pytest.mark.parametrize("store_factory", backend_params("file", "s3"), indirect=True)
def test_head_moving_backwards_is_refused(store: ObstoreStore) -> None:
    build_run(store, 5)
    reader = BoardReader(store, "run")
    f = Follower(reader, version=None)
    assert f.sync(Recorder()) == 5
    # Someone rolls the board back (deletes v5): HEAD would move backwards.
    store.delete([L.version_manifest(5)])
    with pytest.raises(BoardError, match=r"moved backwards from v5 to v4"):
        f.sync(Recorder())
    assert f.version == 5
    # A fresh reader (which never saw v5) with a replica at v5 refuses too.
    fresh = Follower(BoardReader(store, "run"), version=5, view_fp=fp(5))
    with pytest.raises(BoardError, match="moved backwards"):
        fresh.sync(Recorder())
    assert fresh.version == 5


def test_replica_whose_view_disagrees_boots_from_keyframe(store: ObstoreStore) -> None:
    build_run(store, 3)
    rec = Recorder()
    f = Follower(BoardReader(store, "run"), version=2, view_fp=fp(2, "some other board"))
    assert f.sync(rec) == 3
    assert rec.edges[0] == ("keyframe", None, 0)


def test_apply_failure_keeps_last_good_version(store: ObstoreStore) -> None:
    build_run(store, 4)
    seen: list[int] = []

    def flaky(step: Step) -> None:
        if step.manifest.version == 3:
            raise RuntimeError("engine refused the patch")
        seen.append(step.manifest.version)

    f = Follower(BoardReader(store, "run"), version=1, view_fp=fp(1))
    with pytest.raises(RuntimeError, match="engine refused"):
        f.sync(flaky)
    assert seen == [2] and f.version == 2 and f.view_fp == fp(2)
    assert f.sync(Recorder()) == 4  # once the engine recovers, it carries on


def test_store_timing_out_keeps_last_good_version(silent_s3: SilentS3) -> None:
    store = silent_s3(max_retries=1)
    f = Follower(BoardReader(store, "run"), version=7, view_fp=fp(7))
    with pytest.raises(StoreError, match="failed"):
        f.sync(Recorder())
    assert f.version == 7


def test_nothing_on_the_board_is_overwritten(store: ObstoreStore) -> None:
    pub = build_run(store, 3)
    before = snapshot_of_board(store)
    from flipsync.board.writer import BoardWriter
    from flipsync.errors import ConflictError

    intruder = BoardWriter(store, "run", publisher_id="intruder")
    intruder.resume()
    for v in (1, 2, 3):
        with pytest.raises(ConflictError):
            intruder.publish_patch(
                [patch_bytes(99)],
                base_version=v - 1,
                target_version=v,
                base_view_fp=fp(v - 1),
                target_view_fp=fp(v, "evil"),
                served_format="bf16",
            )
    with pytest.raises(ConflictError):
        store.put(L.version_manifest(2), b"{}", create_only=True)
    after = snapshot_of_board(store)
    assert {k: v for k, v in after.items() if k in before} == before
    assert pub.head is not None and pub.head.version == 3


def test_corrupt_span_falls_back_to_the_chain(store: ObstoreStore) -> None:
    build_run(store, 8, spans=True)
    reader = BoardReader(store, "run")
    span = reader.catalog.span(0, 8)
    path = f"{L.span_dir(0, 8)}/{span.parts[0].path}"
    store.delete([path])
    rec = Recorder()
    f = Follower(reader, version=0, view_fp=fp(0))
    assert f.sync(rec) == 8
    assert ("span", 0, 8) not in rec.edges and rec.edges[0] == ("span", 0, 4)


def test_chain_that_does_not_line_up_is_refused(store: ObstoreStore) -> None:
    """A well-formed manifest whose base view is not the previous version's view (a forged or confused
    publisher) is caught before the sidecar sees it."""
    build_run(store, 4)
    path = L.version_manifest(4)
    d = json.loads(store.get(path))
    d["base_view_fp"] = fp(3, "elsewhere")
    store.delete([path])
    store.put(path, json.dumps(d).encode(), create_only=True)
    rec = Recorder()
    f = Follower(BoardReader(store, "run"), version=2, view_fp=fp(2))
    with pytest.raises(IntegrityError, match="does not line up"):
        f.sync(rec)
    assert f.version == 3 and rec.edges == [("patch", 2, 3)]
