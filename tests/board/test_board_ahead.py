"""Parts stored as several objects (streamed by a trainer), and readers that fetch them ahead of the manifest."""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime, timedelta

import blake3
import pytest
from board_helpers import backend_params, build_run, fp

from flipsync.board.ahead import FetchAhead
from flipsync.board.layout import RunLayout
from flipsync.board.reader import BoardReader, PatchStep
from flipsync.board.retention import RetentionPolicy, collect_garbage
from flipsync.board.writer import BoardWriter
from flipsync.domain.manifest import Chunk, Part
from flipsync.errors import IntegrityError, StoreError
from flipsync.stores import ObstoreStore, StoreWrapper

L = RunLayout("run")


class Counting(StoreWrapper):
    """Counts reads per path; fails the ones in ``broken``."""

    def __init__(self, inner: ObstoreStore) -> None:
        super().__init__(inner)
        self.gets: dict[str, int] = {}
        self.broken: set[str] = set()

    def get(self, path: str, *, size: int | None = None) -> bytes:
        self.gets[path] = self.gets.get(path, 0) + 1
        if path in self.broken:
            raise StoreError(f"{path}: 503 (injected)")
        return super().get(path, size=size)


def upload_chunked(store: ObstoreStore, version: int, data: bytes, cuts: list[int], attempt: str = "a1") -> Part:
    """Put ``data`` as a part of several objects cut at ``cuts``; return its manifest entry."""
    folder = L.version_dir(version)
    bounds = [0, *cuts, len(data)]
    names = [f"{attempt}/patch-00000.safetensors"] + [
        f"{attempt}/patch-00000.safetensors.{i:05d}" for i in range(1, len(bounds) - 1)
    ]
    for name, a, b in zip(names, bounds[:-1], bounds[1:], strict=True):
        store.put(f"{folder}/{name}", data[a:b])
    chunks = tuple(Chunk(n, b - a) for n, a, b in zip(names[1:], bounds[1:-1], bounds[2:], strict=True))
    return Part(names[0], len(data), blake3.blake3(data).hexdigest(), chunks)


def publish_chunked(store: ObstoreStore, data: bytes, cuts: list[int]) -> None:
    pub = build_run(store, 1)
    part = upload_chunked(store, 2, data, cuts)
    pub.publish_uploaded_patch(
        [part], base_version=1, target_version=2, base_view_fp=fp(1), target_view_fp=fp(2), served_format="bf16"
    )


DATA = hashlib.shake_256(b"a streamed part").digest(10_000)


@pytest.mark.parametrize("store_factory", backend_params("file", "s3"), indirect=True)
def test_a_part_of_several_objects_reads_back_whole(store: ObstoreStore) -> None:
    publish_chunked(store, DATA, [100, 4000, 9000])
    reader = BoardReader(store, "run")
    step = reader.fetch(reader.catalog.version(2))
    assert isinstance(step, PatchStep) and step.parts == [DATA]
    assert [o for o in reader.catalog.version(2).parts[0].objects] == [
        ("a1/patch-00000.safetensors", 100),
        ("a1/patch-00000.safetensors.00001", 3900),
        ("a1/patch-00000.safetensors.00002", 5000),
        ("a1/patch-00000.safetensors.00003", 1000),
    ]


def test_a_tampered_or_missing_chunk_is_an_integrity_error(store: ObstoreStore) -> None:
    publish_chunked(store, DATA, [100, 4000])
    reader = BoardReader(store, "run")
    m = reader.catalog.version(2)
    chunk = f"{L.version_dir(2)}/a1/patch-00000.safetensors.00002"
    good = store.get(chunk)
    store.put(chunk, bytes([good[0] ^ 1]) + good[1:])
    with pytest.raises(IntegrityError, match="is corrupt: BLAKE3"):
        reader.fetch(m)
    store.put(chunk, good[:-1])
    with pytest.raises(IntegrityError, match="5999 bytes, its manifest says 6000"):
        reader.fetch(m)
    store.delete([chunk])
    with pytest.raises(IntegrityError, match="missing, though its manifest lists it"):
        reader.fetch(m)


def test_commit_refuses_a_part_whose_chunk_is_not_up(store: ObstoreStore) -> None:
    pub = build_run(store, 1)
    part = upload_chunked(store, 2, DATA, [100, 4000])
    store.delete([f"{L.version_dir(2)}/a1/patch-00000.safetensors.00001"])
    with pytest.raises(Exception, match="1 of 3 part objects are not on the board"):
        pub.publish_uploaded_patch(
            [part], base_version=1, target_version=2, base_view_fp=fp(1), target_view_fp=fp(2), served_format="bf16"
        )
    assert not store.exists(L.version_manifest(2))


def test_retention_keeps_every_chunk_of_a_kept_part(store: ObstoreStore) -> None:
    publish_chunked(store, DATA, [100, 4000])
    stray = f"{L.version_dir(2)}/zz/patch-00000.safetensors.00001"  # a failed attempt's chunk
    store.put(stray, b"x")
    later = datetime.now(UTC) + timedelta(hours=2)
    r = collect_garbage(store, "run", RetentionPolicy(keep_versions=100, orphan_grace_s=60), now=later)
    assert r.deleted_orphans == 1 and not store.exists(stray)
    assert BoardReader(store, "run").fetch(BoardReader(store, "run").catalog.version(2)).parts == [DATA]  # type: ignore[union-attr]


def test_fetch_ahead_downloads_a_folder_once_and_answers_reads_from_it(store: ObstoreStore) -> None:
    counting = Counting(store)
    ahead = FetchAhead(counting, interval_s=0.01)
    build_run(store, 1)
    folder = L.version_dir(2)
    part = upload_chunked(store, 2, DATA, [100, 4000])
    assert ahead.watch(folder) is False  # parts are up, the manifest is not
    assert ahead.watch(folder) is False
    paths = [f"{folder}/{p}" for p, _ in part.objects]
    reader = BoardReader(ahead, "run")
    BoardWriter(store, "run").publish_uploaded_patch(
        [part], base_version=1, target_version=2, base_view_fp=fp(1), target_view_fp=fp(2), served_format="bf16"
    )
    assert ahead.watch(folder) is True
    assert reader.fetch(reader.catalog.version(2)).parts == [DATA]  # type: ignore[union-attr]
    assert all(counting.gets[p] == 1 for p in paths)  # each object crossed the wire once
    assert ahead.hits == 3 and ahead.held == 0
    ahead.close()


def test_fetch_ahead_bounds_what_it_holds_and_falls_back_to_plain_reads(store: ObstoreStore) -> None:
    counting = Counting(store)
    ahead = FetchAhead(counting, max_bytes=4000)
    build_run(store, 1)
    folder = L.version_dir(2)
    part = upload_chunked(store, 2, DATA, [100, 4000])  # objects of 100, 3900 and 6000 bytes
    first, second, third = (f"{folder}/{p}" for p, _ in part.objects)
    counting.broken.add(second)
    ahead.watch(folder)
    assert ahead.held == 2  # the 6000-byte object would pass the limit: read on demand
    assert ahead.get(first) == DATA[:100] and ahead.hits == 1
    deadline = time.monotonic() + 10
    while second not in counting.gets and time.monotonic() < deadline:  # the early download may not have run yet
        time.sleep(0.001)
    counting.broken.clear()
    assert ahead.get(second) == DATA[100:4000]  # its early download failed: read again
    assert ahead.get(third) == DATA[4000:]
    assert counting.gets == {first: 1, second: 2, third: 1} and ahead.hits == 1
    ahead.watch(folder)  # nothing new: already seen
    assert ahead.held == 0
    ahead.watch(L.version_dir(3))
    assert ahead.held == 0 and ahead.wait_exists("x", 0.1) is None  # a directory cannot wait
    ahead.close()
