"""The diff kernel finds exactly the elements whose bits differ: any dtype, size, density and chunking."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flipsync.codec import diff
from flipsync.codec.bits import bits_numpy
from flipsync.codec.diff import Changes, DiffEngine, changed_positions_reference
from flipsync.errors import PatchError
from tests.strategies import CODEC_DTYPES, edit, random_tensor


@pytest.fixture(scope="module")
def engine() -> DiffEngine:
    with DiffEngine(threads=2) as e:
        yield e


@given(
    dtype=st.sampled_from(CODEC_DTYPES),
    numel=st.integers(0, 5000),
    frac=st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]),
    style=st.sampled_from(["ulp", "bits", "runs"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_the_obvious_method(dtype: torch.dtype, numel: int, frac: float, style: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a = random_tensor(rng, dtype, (numel,))
    b = edit(rng, a, frac, style=style)
    with DiffEngine(threads=2) as e:
        assert np.array_equal(e.changed_positions(a, b), changed_positions_reference(a, b))
        assert_changes_exact(e.changes(a, b), a, b)


def assert_changes_exact(found: Changes, a: torch.Tensor, b: torch.Tensor) -> None:
    """Positions as the obvious method finds them, and both sides' bit patterns there, bit for bit."""
    expect = changed_positions_reference(a, b)
    assert np.array_equal(found.positions, expect) and found.positions.dtype == np.int64
    for side, t in ((found.old, a), (found.new, b)):
        bits = bits_numpy(t.contiguous()).reshape(-1)
        assert side.dtype == bits.dtype and np.array_equal(side, bits[expect])


@pytest.mark.parametrize("frac", [0.0005, 0.05, 0.5])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
def test_many_chunks_sparse_and_dense(
    engine: DiffEngine, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, frac: float
) -> None:
    """Small chunks force many tasks, the density probe and both kernels; odd sizes leave a tail."""
    monkeypatch.setattr(diff, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(diff, "MIN_CHUNK_BYTES", 4096)
    monkeypatch.setattr(diff, "_PROBE_WORDS", 16)
    rng = np.random.default_rng(5)
    a = random_tensor(rng, dtype, (200_003,))
    b = edit(rng, a, frac, style="ulp")
    assert np.array_equal(engine.changed_positions(a, b), changed_positions_reference(a, b))
    assert_changes_exact(engine.changes(a, b), a, b)
    found = engine.changes_many([(a, b), (b, a)])  # several tensors share the pool's tasks
    assert_changes_exact(found[0], a, b)
    assert_changes_exact(found[1], b, a)


def test_signed_zero_and_nan_payloads_count_as_changes(engine: DiffEngine) -> None:
    a = torch.tensor([0.0, float("nan"), 1.0], dtype=torch.float32)
    b = a.clone()
    b[0] = -0.0
    b.view(torch.int32)[1] += 1  # another NaN payload: float == cannot see it, the bits can
    assert engine.changed_positions(a, b).tolist() == [0, 1]


def test_layout_mismatch_is_an_error(engine: DiffEngine) -> None:
    with pytest.raises(PatchError, match="different layouts"):
        engine.changed_positions(torch.zeros(3), torch.zeros(4))


def test_many_small_tensors_of_mixed_dtypes_share_jobs(engine: DiffEngine) -> None:
    """Small tensors are packed several to a pool job; each result must still belong to its own pair."""
    rng = np.random.default_rng(11)
    dtypes = [torch.bfloat16, torch.float32, torch.uint8, torch.float16, torch.int64]
    pairs = []
    for i in range(60):
        a = random_tensor(rng, dtypes[i % len(dtypes)], (int(rng.integers(0, 3000)),))
        pairs.append((a, edit(rng, a, float(rng.choice([0.0, 0.01, 0.3])), style="ulp")))
    for (a, b), found in zip(pairs, engine.changes_many(pairs), strict=True):
        assert_changes_exact(found, a, b)
