"""The hand-off slot: newer steps squash into a pending one, but a snapshot is held apart, never merged."""

from __future__ import annotations

import torch

from flipsync.trainer.slot import Item, Slot


def view(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2,), step, dtype=torch.int16)}


def test_steps_pushed_before_the_initial_snapshot_is_taken_never_merge_into_it() -> None:
    released: list[int] = []
    slot = Slot(lambda item: released.append(item.step))
    slot.push(Item(0, view(0), snapshot=True, meta={"source": "init"}))
    slot.drop_pending_view()  # what the next step's computation does first: a held snapshot keeps its view
    for step in (1, 2, 3):
        slot.push(Item(step, view(step)))
    assert slot.newest() == 0
    first = slot.take()
    assert first is not None and first.step == 0 and first.snapshot
    assert first.view is not None and torch.equal(first.view["w"], view(0)["w"])
    slot.done()
    second = slot.take()
    assert second is not None and second.step == 3 and not second.snapshot
    assert "source" not in second.meta  # the snapshot's metadata stays with its own version
    assert released == [1, 2] and slot.squashed_steps == 2


def test_a_snapshot_covers_the_older_steps_pending_when_it_arrives() -> None:
    released: list[int] = []
    slot = Slot(lambda item: released.append(item.step))
    slot.push(Item(4, view(4)))
    slot.push(Item(5, view(5), snapshot=True))
    assert released == [4] and slot.squashed_steps == 1  # step 4 went into the snapshot
    slot.push(Item(6, view(6)))
    held = slot.take(at_least=5)
    assert held is not None and (held.step, held.snapshot) == (5, True)
    slot.done()
    nxt = slot.take()
    assert nxt is not None and nxt.step == 6 and released == [4]


def test_clear_releases_the_held_snapshot_and_the_pending_step() -> None:
    released: list[int] = []
    slot = Slot(lambda item: released.append(item.step))
    slot.push(Item(0, view(0), snapshot=True))
    slot.push(Item(1, view(1)))
    slot.clear()
    slot.close()
    assert sorted(released) == [0, 1] and slot.take() is None
