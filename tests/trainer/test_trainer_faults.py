"""Bad input: layout changes, non-finite weights, a board that refuses writes. Clear errors, no half versions."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from trainer_helpers import RefusingStore, adam, follow_and_check, tiny_llama, train, versions_are_whole

from flipsync.board import open_store
from flipsync.board.catalog import Catalog
from flipsync.domain.manifest import Kind
from flipsync.errors import ConflictError, FormatError, NonFiniteError, PatchError, PermanentStoreError, StoreError
from flipsync.trainer import Publisher, PublisherConfig
from tests.store_faults import immutable, read_only


def refuse_v2_parts_once() -> Callable[[str, bool, bytes], bool]:
    """A RefusingStore rule: the first upload of a v2 part object fails."""
    left = [1]

    def refuse(path: str, create_only: bool, data: bytes) -> bool:
        if "versions/000000000002/" in path and "patch-" in path and left[0]:
            left[0] -= 1
            return True
        return False

    return refuse


def test_a_shape_change_is_refused_then_a_snapshot_continues(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama(tie=False)
    opt = adam(model)
    pub = Publisher(model, store, run="resize", optimizer=opt, config=PublisherConfig(background=False))
    train(model, opt, 1)
    model.resize_token_embeddings(72)
    with pytest.raises(PatchError, match=r"changed layout.*publisher\.snapshot\(\)"):
        pub.step()
    assert Catalog(store, "resize").list_versions() == [0, 1]  # nothing published for the bad step
    pub.snapshot()  # the new layout goes out as a full view; patches continue from it
    pub.step()
    pub.close()
    replica = follow_and_check(store, "resize", model)
    assert [s.manifest.kind for s in replica.steps] == [Kind.KEYFRAME, Kind.PATCH, Kind.KEYFRAME, Kind.PATCH]


def test_dtype_changes_are_refused_by_name(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama()
    model.model.register_buffer("counter", torch.zeros(3, dtype=torch.int64))
    with Publisher(model, store, run="dtypes", config=PublisherConfig(background=False)) as pub:
        model.double()
        with pytest.raises(FormatError, match="float64"):
            pub.step()
        model.float()
        model.model.counter = torch.zeros(3, dtype=torch.int32)
        with pytest.raises(PatchError, match=r"model\.counter.*changed layout"):
            pub.step()
        model.model.counter = torch.ones(3, dtype=torch.int64)
        pub.step()
    follow_and_check(store, "dtypes", model)
    assert versions_are_whole(store, "dtypes") == [0, 1]


@pytest.mark.parametrize("background", [False, True])
def test_non_finite_weights_are_refused_and_nothing_is_published(tmp_path: Path, background: bool) -> None:
    store = open_store(tmp_path)
    model = tiny_llama()
    opt = adam(model)
    pub = Publisher(model, store, run="nan", optimizer=opt, config=PublisherConfig(background=background))
    train(model, opt, 1)
    pub.flush()
    head = pub.stats.head
    w = model.model.layers[0].mlp.up_proj.weight
    saved = w.detach().clone()
    with torch.no_grad():
        w[1, 2] = float("inf")
    with pytest.raises(NonFiniteError, match="up_proj"):
        pub.step()
    assert pub.flush() is not None and pub.stats.head == head
    with torch.no_grad():
        w.copy_(saved)
    train(model, opt, 1)
    pub.close()
    follow_and_check(store, "nan", model)


@pytest.mark.parametrize("where", ["manifest", "part"])
def test_a_refused_write_skips_the_version_and_the_next_one_covers_it(tmp_path: Path, where: str) -> None:
    inner = open_store(tmp_path)
    parts_left = [2]

    def refuse(path: str, create_only: bool, data: bytes) -> bool:
        if where == "manifest":  # the manifests of steps 1 and 2
            return create_only and any(f'"step":{i},'.encode() in data for i in (1, 2))
        if "patch-" in path and parts_left[0] > 0:
            parts_left[0] -= 1
            return True
        return False

    store = RefusingStore(inner, refuse)
    model = tiny_llama()
    opt = adam(model)
    with Publisher(
        model,
        store,
        run="flaky",
        optimizer=opt,
        config=PublisherConfig(background=False, max_store_failures=3),
    ) as pub:
        train(model, opt, 4)
    assert store.refused >= 2 and pub.stats.store_failures == 0
    replica = follow_and_check(inner, "flaky", model)
    steps = [s.manifest.meta["steps"] for s in replica.patches]
    assert sum(steps) == 4 and steps[0] == 3  # steps 1 and 2 went out with step 3
    assert versions_are_whole(inner, "flaky") == [0, 1, 2]


@pytest.mark.parametrize("background", [False, True])
def test_a_board_that_keeps_refusing_stops_the_publisher_with_the_store_error(tmp_path: Path, background: bool) -> None:
    inner = open_store(tmp_path)
    store = RefusingStore(inner, lambda path, create_only, data: "patch-" in path)
    model = tiny_llama()
    opt = adam(model)
    pub = Publisher(
        model, store, run="down", optimizer=opt, config=PublisherConfig(background=background, max_store_failures=2)
    )
    with pytest.raises(StoreError, match=r"gave up after 2 failed publications.*resume the run"):
        for _ in range(6):
            train(model, opt, 1)
            pub.flush()
    with pytest.raises(StoreError):
        pub.step()  # a stopped publisher stays stopped
    pub.close()  # the error was reported already
    assert versions_are_whole(inner, "down") == [0]  # readers never saw a half-published version
    parts = [o.path for o in inner.list("runs/down/versions/000000000001")]
    assert not parts  # the refused part left nothing behind


@pytest.mark.parametrize("background", [False, True])
def test_a_last_step_whose_publication_failed_is_published_again_by_flush(tmp_path: Path, background: bool) -> None:
    inner = open_store(tmp_path)
    store = RefusingStore(inner, refuse_v2_parts_once())
    model = tiny_llama()
    opt = adam(model)
    pub = Publisher(model, store, run="last", optimizer=opt, config=PublisherConfig(background=background))
    pub.flush()  # v0 holds the initial weights (else a busy machine may fold step 1 into it)
    train(model, opt, 1)
    pub.flush()
    train(model, opt, 1)  # its publication fails, and no later step comes to cover it
    published = pub.flush()
    assert store.refused == 1 and published is not None and (published.version, published.step) == (2, 2)
    assert pub.stats.store_failures == 0
    pub.close()
    follow_and_check(inner, "last", model)


def test_a_fenced_off_background_publisher_raises_on_the_next_step(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama()
    opt = adam(model)
    pub = Publisher(model, store, run="fence", optimizer=opt)
    pub.flush()
    with Publisher(tiny_llama(seed=5), store, run="fence", resume=True, config=PublisherConfig(background=False)):
        pass
    train(model, opt, 1)
    with pytest.raises(ConflictError, match="fenced off"):
        pub.flush()
    with pytest.raises(ConflictError):
        train(model, opt, 1)
    pub.close()


def test_a_non_finite_view_computed_in_the_background_stops_the_next_optimizer_step(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama()
    opt = adam(model)
    pub = Publisher(model, store, run="nan-bg", optimizer=opt)  # attached: views are computed off-thread
    train(model, opt, 1)
    pub.flush()  # changing weights outside the optimizer: first let the last step's view finish
    w = model.model.norm.weight
    with torch.no_grad():
        w[3] = float("nan")
    opt.step()  # no gradients: nothing moves, but the hook publishes this (non-finite) state
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteError, match=r"model\.norm\.weight"):
        opt.step()  # refused before it changes any weight
    assert all(torch.equal(v, before[k]) or torch.isnan(v).any() for k, v in model.state_dict().items())
    with torch.no_grad():
        w[3] = 1.0
    train(model, opt, 1)
    pub.close()
    follow_and_check(store, "nan-bg", model)


def test_the_slot_hears_that_an_item_is_done_only_after_the_workers_bookkeeping(tmp_path: Path) -> None:
    """flush() reads ``unpublished`` and the stats once the slot is idle: by then a version that covers a failed
    step must have dropped it (else flush publishes that older step again, over the newer one)."""
    model = tiny_llama()
    opt = adam(model)
    pub = Publisher(
        model,
        RefusingStore(open_store(tmp_path), refuse_v2_parts_once()),
        run="order",
        config=PublisherConfig(background=False),
    )
    seen: list[tuple[int, bool, int]] = []
    done = pub.slot.done

    def spy() -> None:
        seen.append((len(pub.worker.published), pub.worker.unpublished is not None, pub.worker.store_failures))
        done()

    pub.slot.done = spy  # type: ignore[method-assign]
    for _ in range(3):  # v1; step 2's publication fails; v2 = step 3 covers it
        train(model, opt, 1)
        pub.step()
    assert seen == [(2, False, 0), (2, True, 1), (3, False, 0)]
    assert pub.flush() is not None and pub.stats.head == 2
    pub.close()


# -- a board that refuses for good: the publisher stops within seconds, training keeps what it has -------------


@pytest.mark.parametrize("way", [None, "chattr +i"], ids=["read-only", "immutable"])
@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
def test_an_existing_board_that_cannot_be_written_stops_the_publisher_within_seconds(
    tmp_path: Path, background: bool, way: str | None
) -> None:
    board = tmp_path / "board"
    with Publisher(tiny_llama(seed=3), board, run="earlier", config=PublisherConfig(background=False)):
        pass  # an earlier run: the board folder exists, readable, with its runs/ folder
    model = tiny_llama()
    opt = adam(model)
    with read_only(board, way) as how:
        t0 = time.monotonic()
        with pytest.raises(PermanentStoreError) as err:
            # nice=0: a nice-19 worker on a machine whose cores others keep busy can wait seconds to run
            config = PublisherConfig(background=background, nice=0)
            pub = Publisher(model, board, run="new", optimizer=opt, config=config)
            for _ in range(20):  # in the background, v0 fails on the worker: the next optimizer step raises
                train(model, opt, 1)
                time.sleep(0.05)
        elapsed = time.monotonic() - t0
        if background:
            t1 = time.monotonic()
            pub.close()  # reported already: close neither waits nor raises again
            assert time.monotonic() - t1 < 5
    text = str(err.value)
    print(f"\nunwritable board ({how}, {'background' if background else 'inline'}): error after {elapsed:.2f} s")
    assert elapsed < 5, text
    assert "was refused" in text and str(board) in text and "v0 was not published" in text
    assert "not writable" in text and "\n" not in text
    assert Catalog(open_store(board), "earlier").list_versions() == [0]  # the earlier run is untouched


def test_a_board_that_becomes_unwritable_mid_run_stops_the_next_step_and_keeps_what_landed(tmp_path: Path) -> None:
    board = tmp_path / "board"
    model = tiny_llama()
    opt = adam(model)
    pub = Publisher(model, board, run="mid", optimizer=opt, config=PublisherConfig(nice=0))  # nice=0: see above
    train(model, opt, 2)
    pub.flush()
    landed = versions_are_whole(open_store(board), "mid")
    with read_only(board):
        t0 = time.monotonic()
        with pytest.raises(PermanentStoreError, match=r"v\d+ was not published and the publisher stopped"):
            train(model, opt, 1)  # this step's publication is refused ...
            pub.flush()  # ... and reported here at the latest
        elapsed = time.monotonic() - t0
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(PermanentStoreError):
            train(model, opt, 1)  # a stopped publisher stays stopped: the pre-step hook refuses the next step
        t1 = time.monotonic()
        pub.close()
        close_s = time.monotonic() - t1
    print(f"\nboard unwritable mid-run: error after {elapsed:.2f} s, close {close_s:.2f} s")
    assert elapsed < 5 and close_s < 5
    # What the user keeps: the model and optimizer as of the last step that ran (the refused step did not
    # move the weights), and every version that landed, whole and readable.
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert opt.state and versions_are_whole(open_store(board), "mid") == landed


def test_an_immutable_head_hint_does_not_stop_publishing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``latest.json`` is the only object a publisher overwrites; refused, it is a stale hint, and readers find
    HEAD without it: the versions still land, each at once."""
    board = tmp_path / "board"
    store = open_store(board)
    model = tiny_llama()
    opt = adam(model)
    pub = Publisher(model, store, run="hint", optimizer=opt, config=PublisherConfig(background=False))
    with immutable(board / "runs" / "hint" / "latest.json"):
        t0 = time.monotonic()
        train(model, opt, 3)
        elapsed = time.monotonic() - t0
        pub.close()
    assert elapsed < 10
    assert versions_are_whole(store, "hint") == [0, 1, 2, 3]
    assert any(
        "could not update the HEAD hint" in r.getMessage() and "was refused" in r.getMessage() for r in caplog.records
    )
    follow_and_check(store, "hint", model)
