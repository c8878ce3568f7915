"""Checks of a receiver's class index against the tensors it describes (shared by the codec and engine tests)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from flipsync.codec import ClassIndex
from flipsync.codec.bits import bits_numpy, dtype_of
from flipsync.codec.class_index import ClassTree, class_rule
from flipsync.codec.fingerprint import FingerprintTable


def _block_counts(held: ClassTree, n_classes: int) -> np.ndarray:
    """Each class's count in each block, from the Fenwick trees (a class without a tree: zeros)."""
    n_blocks = held.tree.shape[1]
    prefix = np.zeros((n_classes, n_blocks + 1), dtype=np.int64)
    for c in range(n_classes):
        if held.slot[c] < 0:
            continue
        row = held.tree[held.slot[c]]
        for b in range(1, n_blocks + 1):
            i, total = b, 0
            while i > 0:
                total += int(row[i - 1])
                i -= i & -i
            prefix[c, b] = total
    return np.diff(prefix, axis=1)


def _counted(t: torch.Tensor, block: int) -> np.ndarray:
    """Each class's count in each block, counted from the tensor's bits."""
    d = dtype_of(t)
    rule = class_rule(d)
    u = bits_numpy(t).reshape(-1).astype(np.uint64)
    cls = ((u >> np.uint64(rule.s1)) & np.uint64(rule.m1)) | (
        ((u >> np.uint64(rule.s2)) & np.uint64(rule.m2)) << np.uint64(rule.w1)
    )
    blocks = np.arange(u.size) // block
    out = np.zeros((rule.n_classes, -(-u.size // block)), dtype=np.int64)
    np.add.at(out, (cls.astype(np.int64), blocks), 1)
    return out


def assert_index_current(index: ClassIndex, tensors: Mapping[str, torch.Tensor], table: FingerprintTable) -> None:
    """Every tensor the index holds is held as of its fingerprint now, and equal to one built afresh."""
    for name, t in tensors.items():
        if name not in index:
            continue
        assert index.describes(name, table[name].fp), f"{name}: the index fell behind the tensor"
        held = index.tree(name, bits_numpy(t), dtype_of(t), table[name].fp)
        assert held is not None
        n_classes = held.slot.size
        assert np.array_equal(_block_counts(held, n_classes), _counted(t, held.block)), f"{name}: the index drifted"
