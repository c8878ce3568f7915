"""Every served format round-trips through the codec bit for bit, for any Adam-like step of the masters."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from flipsync.codec import FingerprintTable, Patch, apply_patch, diff_views
from flipsync.formats import FORMAT_NAMES, served_view
from tests.strategies import same_bits


@given(
    fmt=st.sampled_from(FORMAT_NAMES),
    seed=st.integers(0, 2**31),
    rows=st.integers(1, 40),
    cols=st.sampled_from([2, 16, 32, 48, 130]),
    lr=st.sampled_from([1e-7, 1e-6, 1e-5, 1e-3]),
    mode=st.sampled_from(["step", "raw"]),
)
def test_served_views_round_trip(fmt: str, seed: int, rows: int, cols: int, lr: float, mode: str) -> None:
    g = torch.Generator().manual_seed(seed)
    before = {
        "layers.0.q_proj.weight": torch.randn(rows, cols, generator=g) * 0.02,
        "layers.0.k_proj.weight": torch.randn(rows, cols, generator=g) * 0.05,
        "layers.0.norm.weight": 1 + 0.01 * torch.randn(cols, generator=g),
    }
    after = {k: v + lr * torch.randn(v.shape, generator=g).sign() for k, v in before.items()}
    old, new = served_view(before, fmt), served_view(after, fmt)
    patch, _ = diff_views(old, new, mode=mode, served_format=fmt)  # type: ignore[arg-type]
    replica = {k: v.clone() for k, v in old.items()}
    apply_patch(replica, Patch.from_bytes(patch.to_bytes()), FingerprintTable.of(replica), verify="digest")
    assert set(replica) == set(new)
    assert all(same_bits(replica[k], new[k]) for k in new)
