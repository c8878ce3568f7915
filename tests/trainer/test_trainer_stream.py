"""Streamed parts: a rank's part goes up in chunks while it is coded, and readers get the very same file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_trainer_ranks import NO_KEYFRAMES, partitions, start, step_all
from trainer_helpers import (
    RefusingStore,
    Replica,
    adam,
    assert_bitwise,
    expected_view,
    follow_and_check,
    tiny_llama,
    train,
)

from flipsync.board import BoardReader, open_store
from flipsync.board.ahead import FetchAhead
from flipsync.board.part_stream import PartStream
from flipsync.codec import Patch, diff_views
from flipsync.codec.container import OWN_TENSOR_BYTES, PatchFileWriter
from flipsync.engines.memory import MemoryEngine
from flipsync.errors import CorruptPatchError, StoreError
from flipsync.sidecar.replica import Replica as Sidecar
from flipsync.sidecar.replica import ReplicaConfig
from flipsync.stores import Store
from flipsync.trainer import Publisher, PublisherConfig


def random_patch(sizes: list[int], seed: int) -> Patch:
    """A patch with one bf16 tensor per size, about that many changed values each."""
    g = torch.Generator().manual_seed(seed)
    old, new = {}, {}
    for i, n in enumerate(sizes):
        t = torch.randn(max(n, 1) * 4, generator=g).bfloat16()
        u = t.clone()
        where = torch.randperm(t.numel(), generator=g)[:n]
        u.view(torch.int16)[where] += torch.randint(-3, 4, (n,), generator=g, dtype=torch.int16) | 1
        old[f"t{i:02d}"], new[f"t{i:02d}"] = t, u
    return diff_views(old, new)[0]


def joined(store: Store, folder: str, part: Any) -> bytes:
    return b"".join(store.get(f"{folder}/{path}") for path, _ in part.objects)


def on_board(store: Store) -> dict[str, int]:
    return {o.path: o.size for o in store.list("v")}


def feed(stream: PartStream, patch: Patch) -> tuple[bytes, bytes]:
    """Stream ``patch``'s data area into ``stream`` as the encoder lays it out; the file's (head, tail)."""
    writer = PatchFileWriter()
    for s in patch.sections:
        data = writer.add(s.name, patch.section_blob(s.name))
        if data is not None:
            stream.add(data)
    return writer.finish(patch.header)


def stream_out(patch: Patch, chunk_bytes: int, *, uploader: Any = None) -> tuple[Store, Any, tuple[bytes, bytes]]:
    store = open_store("memory://")
    stream = PartStream(store, "v", "att", 3, chunk_bytes=chunk_bytes, uploader=uploader)
    return store, stream, feed(stream, patch)


def test_a_streamed_part_with_a_chunk_too_many_is_refused() -> None:
    """Chunks joined with a stray one (a retried upload's chunk listed twice, another attempt's chunk): the
    file runs past its container, and the reader says so instead of applying what the container holds."""
    patch = random_patch([12_000, 9_000, 50], 5)
    store, stream, ends = stream_out(patch, 4096)
    part = stream.finish(*ends)
    assert len(part.objects) > 2
    chunks = [store.get(f"v/{path}") for path, _ in part.objects]
    whole = b"".join(chunks)
    assert Patch.from_bytes(whole).to_bytes() == patch.to_bytes()  # read back, it writes the same file
    for spliced in (chunks + chunks[-1:], chunks[:-1] + chunks[-2:]):
        data = b"".join(spliced)
        with pytest.raises(CorruptPatchError, match=f"{len(data) - len(whole):,} extra bytes past the end"):
            Patch.from_bytes(data)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 12_000), min_size=1, max_size=6),
    chunk=st.integers(4096, 40_000),
    seed=st.integers(0, 2**16),
)
def test_a_streamed_part_joins_into_the_file_to_bytes_writes(sizes: list[int], chunk: int, seed: int) -> None:
    patch = random_patch(sizes, seed)
    store, stream, ends = stream_out(patch, chunk)
    part = stream.finish(*ends)
    data = joined(store, "v", part)
    assert data == patch.to_bytes() == stream.file_bytes()
    assert part.size == len(data) and part.hash == blake3.blake3(data).hexdigest()
    assert on_board(store) == {f"v/{p}": s for p, s in part.objects}
    big = sum(patch.section_bytes(s.name) for s in patch.sections if patch.section_bytes(s.name) >= OWN_TENSOR_BYTES)
    if big < chunk:
        assert not part.chunks  # nothing filled a chunk: one object, as before streaming
    else:
        assert all(c.size >= chunk for c in part.chunks[:-1])
    back = Patch.from_bytes(data)
    assert [s.name for s in back.sections] == [s.name for s in patch.sections]
    for s in patch.sections:
        assert bytes(back.section_blob(s.name)) == bytes(patch.section_blob(s.name))


def test_abort_removes_every_object_unless_the_version_kept_it() -> None:
    patch = random_patch([9000, 9000], seed=2)
    store, stream, ends = stream_out(patch, 4096)
    stream.finish(*ends)
    assert len(on_board(store)) == 4  # head, two large sections, tail (the header tensor)
    stream.keep()
    stream.abort()
    assert len(on_board(store)) == 4
    store, stream, _ = stream_out(patch, 4096)
    assert on_board(store)  # the first chunks went up while "coding"
    stream.abort()
    assert not on_board(store)


def test_a_failed_chunk_upload_fails_finish(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    patch = random_patch([9000, 9000, 9000], seed=3)
    refusing = RefusingStore(open_store(tmp_path), lambda path, *_: path.endswith(".00002"))
    with ThreadPoolExecutor(2) as uploader:
        stream = PartStream(refusing, "v", "att", 0, chunk_bytes=4096, uploader=uploader)  # type: ignore[arg-type]
        ends = feed(stream, patch)
        with pytest.raises(StoreError, match="injected"):
            stream.finish(*ends)
        stream.abort()
    assert not refusing.list("v")


def chunked_model() -> Any:
    return tiny_llama(tie=False, hidden=128, layers=2, vocab=256)


def publish_three_steps(pub: Publisher, model: Any, opt: Any, board: Store, run: str) -> Replica:
    """v0, then three trained steps published by hand, then close; a replica that followed every version,
    checked bitwise against the model's final view."""
    pub.flush()
    for _ in range(3):
        train(model, opt, 1, vocab=256)
        pub.step()
    pub.close()
    return follow_and_check(board, run, model)


@pytest.mark.parametrize("background", [True, False])
def test_a_publisher_streams_its_parts_and_replicas_read_them_bitwise(tmp_path: Path, background: bool) -> None:
    store = open_store(tmp_path)
    model = chunked_model()
    opt = adam(model)
    pub = Publisher(
        model,
        store,
        run="s",
        config=PublisherConfig(background=background, chunk_bytes=4096, keyframe_policy=NO_KEYFRAMES, threads=2),
    )
    replica = publish_three_steps(pub, model, opt, store, "s")
    parts = [p for s in replica.patches for p in s.manifest.parts]
    assert parts and all(len(p.chunks) >= 2 for p in parts)  # streamed in several objects


def test_sharded_ranks_stream_their_parts(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = chunked_model()
    opt = adam(model)
    pubs = start(partitions(model, 2), store, "ss", chunk_bytes=4096, threads=1)
    step_all(pubs, "flush")
    for _ in range(2):
        train(model, opt, 1, vocab=256)
        assert step_all(pubs) == [None, None]
    assert step_all(pubs, "close") == [None, None]
    replica = follow_and_check(store, "ss", model)
    # A busy machine may fold step 1 into step 2's version (the publisher is in the background): count per version.
    assert replica.patches and all(len(s.manifest.parts) == 2 for s in replica.patches)  # one part per rank
    assert all(len(p.chunks) >= 2 for s in replica.patches for p in s.manifest.parts)  # each streamed in several
    # Nothing but the referenced objects and manifests is left in the versions' folders.
    listed = {o.path for o in store.list("runs/ss/versions") if not o.path.endswith("manifest.json")}
    folders = {s.manifest.version: f"runs/ss/versions/{s.manifest.version:012d}" for s in replica.patches}
    referenced = {
        f"{folders[s.manifest.version]}/{path}"
        for s in replica.patches
        for p in s.manifest.parts
        for path, _ in p.objects
    }
    assert referenced <= listed


def test_a_version_whose_chunk_upload_failed_leaves_no_chunks_behind(tmp_path: Path) -> None:
    inner = open_store(tmp_path)
    left = [1]

    def refuse(path: str, create_only: bool, data: bytes) -> bool:
        if "versions/000000000002/" in path and path.endswith(".00002") and left[0]:
            left[0] -= 1
            return True
        return False

    model = chunked_model()
    opt = adam(model)
    store: Store = RefusingStore(inner, refuse)  # type: ignore[assignment]
    pub = Publisher(
        model, store, run="f", config=PublisherConfig(background=False, chunk_bytes=4096, keyframe_policy=NO_KEYFRAMES)
    )
    replica = publish_three_steps(pub, model, opt, inner, "f")
    assert [s.manifest.meta["steps"] for s in replica.patches] == [1, 2]  # step 2 waited for step 3
    # The failed attempt's chunks were removed; only the committed attempt's objects remain in v2.
    v2 = replica.patches[1].manifest
    kept = {f"runs/f/versions/000000000002/{path}" for p in v2.parts for path, _ in p.objects}
    on_board = {o.path for o in inner.list("runs/f/versions/000000000002") if not o.path.endswith("manifest.json")}
    assert on_board == kept
    assert np.all([len(p.chunks) >= 2 for p in v2.parts])


def test_a_sidecar_fetching_ahead_follows_a_streaming_trainer(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = chunked_model()
    opt = adam(model)
    engine = MemoryEngine(expected_view(model), served_format="bf16")
    pub = Publisher(
        model, store, run="live", config=PublisherConfig(chunk_bytes=4096, keyframe_policy=NO_KEYFRAMES, threads=1)
    )
    pub.flush()
    ahead = FetchAhead(open_store(tmp_path), interval_s=0.005)
    rep = Sidecar(BoardReader(ahead, "live"), engine, config=ReplicaConfig(poll_interval_s=0.05, jitter=0.0))
    rep.start()
    try:
        for _ in range(3):
            train(model, opt, 1, vocab=256)
            pub.step()
        pub.flush()
        head = pub.stats.head
        assert head is not None and head >= 1
        assert rep.wait_version(head, 30), rep.status()
        assert_bitwise(expected_view(model), engine.tensors)
        assert ahead.hits >= 3  # every patch's objects came from downloads started by watching its folder
    finally:
        rep.stop()
        pub.close()
        ahead.close()


def test_random_chunk_failures_lose_nothing_and_leave_no_stray_objects(tmp_path: Path) -> None:
    inner = open_store(tmp_path)
    rng = np.random.default_rng(7)

    def refuse(path: str, create_only: bool, data: bytes) -> bool:
        return "/versions/" in path and ".safetensors" in path and bool(rng.random() < 0.05)

    store: Store = RefusingStore(inner, refuse)  # type: ignore[assignment]
    model = chunked_model()
    opt = adam(model)
    pub = Publisher(
        model,
        store,
        run="r",
        optimizer=opt,
        config=PublisherConfig(chunk_bytes=4096, keyframe_policy=NO_KEYFRAMES, max_store_failures=50),
    )
    pub.flush()  # v0 holds the initial weights (else a busy machine may fold step 1 into it)
    train(model, opt, 12, vocab=256)
    pub.close()
    assert store.refused > 0  # type: ignore[attr-defined]
    replica = follow_and_check(inner, "r", model)
    assert sum(s.manifest.meta["steps"] for s in replica.patches) == 12  # every step is in some version
    referenced = {
        f"runs/r/versions/{s.manifest.version:012d}/{path}"
        for s in replica.patches
        for p in s.manifest.parts
        for path, _ in p.objects
    }
    stray = {
        o.path
        for o in inner.list("runs/r/versions")
        if ".safetensors" in o.path and "/versions/000000000000/" not in o.path
    }
    assert stray == referenced  # failed attempts removed their chunks
