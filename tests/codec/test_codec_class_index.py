"""The receiver's class index (``ClassIndex``): decoding with it gives what decoding without it gives, and
commit and rollback keep it equal to an index built afresh from the tensors they leave."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flipsync.codec import ClassIndex, commit, diff_views, stage
from flipsync.codec.bits import bits_numpy, dtype_of
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.formats import served_view
from tests.codec.class_index_helpers import assert_index_current

FORMATS = ["bf16", "fp8-block", "mxfp4", "nvfp4"]


def _masters(numel: int, steps: int, lr: float, seed: int) -> list[dict[str, torch.Tensor]]:
    """Weight-like FP32 masters moved by correlated Adam-like steps; a small lr changes few served values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(numel, generator=g) * 0.02
    direction = torch.randn(numel, generator=g).sign()
    out = [{"mlp.weight": w.reshape(-1, 256).clone()}]
    for _ in range(steps):
        w = w + lr * (2 * direction + torch.randn(numel, generator=g))
        out.append({"mlp.weight": w.reshape(-1, 256).clone()})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in b)


def _index_all(index: ClassIndex, tensors: dict[str, torch.Tensor], table: FingerprintTable) -> None:
    """Build every tensor's entry, as a receiver could after a full load (stage builds them only where they pay)."""
    for name, t in tensors.items():
        index.tree(name, bits_numpy(t), dtype_of(t), table[name].fp)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(FORMATS), st.sampled_from([3e-7, 1e-6, 1e-5]), st.integers(0, 2**16))
def test_the_index_follows_commits_and_rollbacks(fmt: str, lr: float, seed: int) -> None:
    views = [served_view(m, fmt) for m in _masters(1 << 17, 3, lr, seed)]
    work = {k: v.clone() for k, v in views[0].items()}
    table = FingerprintTable.of(work)
    index = ClassIndex()
    _index_all(index, work, table)
    plain_table = table.copy()
    for before, after in itertools.pairwise(views):
        patch, _ = diff_views(before, after)
        with_index = stage(work, patch, table, index=index)
        without = stage(work, patch, plain_table)
        for a, b in zip(with_index, without, strict=True):  # the index changes how, never what
            assert torch.equal(a.positions, b.positions) and torch.equal(a.new_bits, b.new_bits)
        undo = commit(work, with_index, table, index=index)
        plain_table = table.copy()
        assert _same(work, after)
        assert_index_current(index, work, table)
    undo.rollback(work, table)  # the last version undone: the index moves back with the tensors
    assert _same(work, views[-2])
    assert_index_current(index, work, table)
    assert any(name in index for name in work)


def test_sparse_sections_are_placed_block_by_block_and_apply_bitwise() -> None:
    # 0.05% of the values change: far fewer changes than index blocks, so the positions are placed by block
    views = [served_view(m, "fp8-block") for m in _masters(1 << 20, 2, 2e-7, 1)]
    patch, _ = diff_views(views[0], views[1])
    (s,) = [s for s in patch.sections if s.name == "mlp.weight"]
    w = views[0]["mlp.weight"]
    work = {k: v.clone() for k, v in views[0].items()}
    table, index = FingerprintTable.of(work), ClassIndex()
    commit(work, stage(work, patch, table, index=index), table, index=index)
    assert _same(work, views[1])
    held = index.tree("mlp.weight", bits_numpy(work["mlp.weight"]), dtype_of(w), table["mlp.weight"].fp)
    assert held is not None  # built by stage, where it paid, and kept by the commit
    assert s.pos["codec"] == "ctx" and s.n * held.block <= w.numel()
    assert_index_current(index, work, table)


def test_an_entry_that_no_longer_describes_its_tensor_is_rebuilt_not_used() -> None:
    views = [served_view(m, "bf16") for m in _masters(1 << 16, 2, 1e-6, 2)]
    work = {k: v.clone() for k, v in views[0].items()}
    table, index = FingerprintTable.of(work), ClassIndex()
    _index_all(index, work, table)
    assert index.describes("mlp.weight", table["mlp.weight"].fp)
    work["mlp.weight"].copy_(views[1]["mlp.weight"])  # changed behind the index's back, as by a full load
    table = FingerprintTable.of(work)
    assert not index.describes("mlp.weight", table["mlp.weight"].fp)
    patch, _ = diff_views(views[1], views[2])
    commit(work, stage(work, patch, table, index=index), table, index=index)
    assert _same(work, views[2])
    assert_index_current(index, work, table)


@pytest.mark.parametrize("fmt", [*FORMATS, "fp16", "fp8-tensor"])
def test_the_index_costs_about_an_eighth_of_its_tensors(fmt: str) -> None:
    view = served_view(_masters(1 << 18, 0, 0.0, 3)[0], fmt)
    index = ClassIndex()
    for name, t in view.items():
        index.tree(name, bits_numpy(t), dtype_of(t), fp=0)
    assert "mlp.weight" in index  # the scales are too small to index
    assert 0 < index.nbytes() <= sum(t.numel() * t.element_size() for t in view.values()) / 8 * (1 + 1 / 8)
