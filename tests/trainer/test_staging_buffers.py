"""CPU served views are cast into pooled buffers: reused once released, returned if the computation fails,
and never handed out twice."""

from __future__ import annotations

import pytest
import torch

from flipsync.errors import NonFiniteError
from flipsync.formats import served_view
from flipsync.trainer.pieces import Piece
from flipsync.trainer.staging import Stager


def _view(stager: Stager, masters: dict[str, torch.Tensor]) -> dict[str, Piece]:
    with stager.buffers() as alloc:
        served = served_view(masters, "bf16", alloc=alloc)
    return {k: Piece(t, 0, tuple(t.shape)) for k, t in served.items()}


def _ptrs(view: dict[str, Piece]) -> set[int]:
    return {p.tensor.data_ptr() for p in view.values()}


def test_released_buffers_are_reused_and_hold_the_new_cast() -> None:
    stager = Stager("host")
    masters = {"a": torch.randn(64, 32), "b": torch.randn(7)}
    first = _view(stager, masters)
    second = _view(stager, masters)  # the first is still held: new buffers
    assert not _ptrs(first) & _ptrs(second)
    stager.release(first)
    masters = {k: v + 1 for k, v in masters.items()}
    third = _view(stager, masters)
    assert _ptrs(third) == _ptrs(first)
    for k, t in masters.items():
        assert torch.equal(third[k].tensor.view(torch.int16), t.to(torch.bfloat16).view(torch.int16))


def test_a_failed_cast_gives_its_buffers_back() -> None:
    stager = Stager("host")
    good = torch.randn(16, 16)
    bad = torch.randn(16, 16)
    bad[3, 4] = float("nan")
    handed: list[int] = []
    with pytest.raises(NonFiniteError), stager.buffers() as alloc:

        def spy(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
            t = alloc(shape, dtype, device)
            handed.append(t.data_ptr() if t is not None else 0)
            return t

        served_view({"a": good, "z": bad}, "bf16", alloc=spy)
    assert len(handed) == 2 and len(set(handed)) == 2
    with stager.buffers() as alloc:
        again = [alloc((16, 16), torch.bfloat16, torch.device("cpu")) for _ in range(3)]
    ptrs = [t.data_ptr() for t in again if t is not None]
    assert set(ptrs[:2]) == set(handed) and ptrs[2] not in handed  # both came back, each handed out once


def test_a_view_released_twice_is_pooled_once() -> None:
    stager = Stager("host")
    view = _view(stager, {"a": torch.randn(8, 8)})
    stager.release(view)
    stager.release(view)
    one, two = _view(stager, {"a": torch.randn(8, 8)}), _view(stager, {"a": torch.randn(8, 8)})
    assert not _ptrs(one) & _ptrs(two)


def test_tensors_the_stager_did_not_make_are_not_pooled() -> None:
    stager = Stager("host")
    foreign = {"a": Piece(torch.randn(8, 8).to(torch.bfloat16), 0, (8, 8))}
    stager.release(foreign)
    mine = _view(stager, {"a": torch.randn(8, 8)})
    assert _ptrs(mine) != _ptrs(foreign)
