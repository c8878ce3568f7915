"""squash's linear merge of two changes is bit-identical to the plain numpy (sort-based) definition."""

from __future__ import annotations

import importlib
from unittest import mock

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from flipsync.codec import squash
from flipsync.codec.bits import dtype_named
from flipsync.codec.section import TensorChange
from tests.strategies import patch_chains

# The package re-exports the function ``squash`` under the submodule's name.
squash_module = importlib.import_module("flipsync.codec.squash")
INT64 = st.integers(-(2**63), 2**63 - 1)


def reference_merge(a: TensorChange, b: TensorChange) -> TensorChange:
    """The definition: union of positions, b's raw value wins, else b's step adds to a's value."""
    positions = np.union1d(a.positions, b.positions)
    in_a = np.isin(positions, a.positions, assume_unique=True)
    in_b = np.isin(positions, b.positions, assume_unique=True)
    n = positions.size
    a_val, a_raw = np.zeros(n, np.int64), np.zeros(n, bool)
    b_val, b_raw = np.zeros(n, np.int64), np.zeros(n, bool)
    a_val[in_a], b_val[in_b] = a.values, b.values
    if a.raw is not None:
        a_raw[in_a] = a.raw
    if b.raw is not None:
        b_raw[in_b] = b.raw
    values = np.where(b_raw, b_val, a_val + b_val)
    raw = b_raw | (a_raw & ~b_raw)
    keep = raw | (values != 0)
    return TensorChange(
        name=a.name,
        dtype=a.dtype,
        shape=a.shape,
        positions=positions[keep],
        values=values[keep],
        raw=raw[keep] if raw.any() else None,
    )


@st.composite
def change_pairs(draw: st.DrawFn) -> tuple[TensorChange, TensorChange]:
    numel = draw(st.integers(1, 300))
    # Small steps so that overlapping steps often cancel; full-range ones so that sums wrap around.
    value = st.one_of(st.integers(-2, 2), INT64)
    out = []
    for _ in range(2):
        pos = np.array(sorted(draw(st.sets(st.integers(0, numel - 1), max_size=numel))), np.int64)
        n = pos.size
        values = np.array(draw(st.lists(value, min_size=n, max_size=n)), np.int64)
        raw_style = draw(st.sampled_from(["none", "some", "all"]))
        raw = None
        if raw_style == "some":
            raw = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool)
        elif raw_style == "all":
            raw = np.ones(n, bool)
        out.append(
            TensorChange(
                name="t",
                dtype=dtype_named("BF16"),
                shape=(numel,),
                positions=pos,
                values=values,
                raw=raw,
            )
        )
    return out[0], out[1]


def assert_same(got: TensorChange, want: TensorChange) -> None:
    for field in ("positions", "values"):
        g, w = getattr(got, field), getattr(want, field)
        assert g.dtype == w.dtype and np.array_equal(g, w), field
    assert (got.raw is None) == (want.raw is None)
    if want.raw is not None:
        assert got.raw is not None and got.raw.dtype == want.raw.dtype and np.array_equal(got.raw, want.raw)
    assert (got.name, got.dtype, got.shape) == (want.name, want.dtype, want.shape)


@given(change_pairs())
def test_merge_matches_the_numpy_definition(pair: tuple[TensorChange, TensorChange]) -> None:
    a, b = pair
    assert_same(squash_module._merge(a, b), reference_merge(a, b))


def test_merge_edge_cases() -> None:
    def change(pos: list[int], values: list[int], raw: list[bool] | None = None) -> TensorChange:
        return TensorChange(
            name="t",
            dtype=dtype_named("F16"),
            shape=(8,),
            positions=np.array(pos, np.int64),
            values=np.array(values, np.int64),
            raw=None if raw is None else np.array(raw, bool),
        )

    cases = [
        (change([], []), change([], [])),
        (change([], []), change([0, 7], [1, -1])),
        (change([3], [5], [True]), change([], [])),
        (change([1, 2], [4, -4]), change([1, 2], [-4, 4])),  # every step cancels: nothing left
        (change([1, 2], [4, 9], [True, False]), change([1, 2], [-4, -9])),  # a raw value keeps its kind
        (change([1], [2**63 - 1]), change([1, 5], [1, 3])),  # int64 wraps like numpy
    ]
    for a, b in cases:
        assert_same(squash_module._merge(a, b), reference_merge(a, b))


@given(patch_chains(max_steps=4))
def test_squash_bytes_match_the_numpy_definition(chain: tuple) -> None:
    _, patches = chain
    got = squash(patches)
    with mock.patch.object(squash_module, "_merge", reference_merge):
        want = squash(patches)
    # Same header (sections, stream parameters, fingerprints) and same decoded changes. (The files' bytes
    # are not compared: safetensors writes its metadata map in no fixed order.)
    assert got.header == want.header
    for g, w in zip(got.changes(), want.changes(), strict=True):
        assert_same(g, w)
