"""Order keys and zigzag: exhaustive over every 8- and 16-bit pattern, property-based for wider types."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flipsync.codec.bits import dtype_named, from_key, key_steps, to_key, unzigzag, zigzag

ALL_16 = np.arange(1 << 16, dtype=np.uint16)
ALL_8 = np.arange(1 << 8, dtype=np.uint8)


@pytest.mark.parametrize(
    ("name", "patterns"),
    [
        ("BF16", ALL_16),
        ("F16", ALL_16),
        ("I16", ALL_16),
        ("F8_E4M3", ALL_8),
        ("F8_E5M2", ALL_8),
        ("U8", ALL_8),
        ("I8", ALL_8),
        ("F8_E8M0", ALL_8),
    ],
)
def test_key_is_a_bijection(name: str, patterns: np.ndarray) -> None:
    d = dtype_named(name)
    keys = to_key(patterns, d)
    assert np.unique(keys).size == patterns.size
    assert np.array_equal(from_key(keys, d), patterns)


@pytest.mark.parametrize(
    ("name", "np_dtype"),
    [
        ("BF16", ml_dtypes.bfloat16),
        ("F16", np.float16),
        ("F8_E4M3", ml_dtypes.float8_e4m3fn),
        ("F8_E5M2", ml_dtypes.float8_e5m2),
    ],
)
def test_key_order_is_numeric_order(name: str, np_dtype: type) -> None:
    d = dtype_named(name)
    patterns = ALL_16 if d.bits == 16 else ALL_8
    with np.errstate(invalid="ignore"):
        values = patterns.view(np_dtype).astype(np.float64)
    finite = ~np.isnan(values)
    keys = to_key(patterns[finite], d)
    order = np.argsort(keys, kind="stable")
    assert np.all(np.diff(values[finite][order]) >= 0)
    # -0 and +0 are neighbours: the step between them is exactly one.
    neg_zero = np.uint64(1 << (d.bits - 1))
    assert int(to_key(np.array([0], patterns.dtype), d)[0] - to_key(np.array([neg_zero], patterns.dtype), d)[0]) == 1


def test_one_ulp_is_one_step() -> None:
    d = dtype_named("BF16")
    x = np.array([1.0, -1.0, 3e-39, -3e-39], dtype=ml_dtypes.bfloat16)  # includes subnormals
    bits = x.view(np.uint16)
    # the next larger bf16: one more in the magnitude bits for positives, one less for negatives
    nxt = np.where(x.astype(np.float32) >= 0, bits + 1, bits - 1).astype(np.uint16)
    assert np.all(nxt.view(ml_dtypes.bfloat16).astype(np.float32) > x.astype(np.float32))
    assert np.all(to_key(nxt, d) - to_key(bits, d) == 1)


@pytest.mark.parametrize(("names", "np_dtype"), [(("F32", "I32"), np.uint32), (("F64", "I64"), np.uint64)])
@given(data=st.data())
def test_key_round_trip_wide(names: tuple[str, ...], np_dtype: type, data: st.DataObject) -> None:
    top = int(np.iinfo(np_dtype).max)
    values = data.draw(st.lists(st.integers(min_value=0, max_value=top), min_size=1, max_size=200))
    for name in names:
        d = dtype_named(name)
        bits = np.array(values, dtype=np_dtype)
        assert np.array_equal(from_key(to_key(bits, d), d), bits)


@given(st.lists(st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1), max_size=200))
def test_zigzag_round_trip(values: list[int]) -> None:
    v = np.array(values, dtype=np.int64)
    z = zigzag(v)
    assert np.array_equal(unzigzag(z), v)
    small = (v > -1000) & (v < 1000)
    assert np.all(z[small] <= 2 * np.abs(v[small]).astype(np.uint64))


@pytest.mark.parametrize("name", ["BF16", "F16", "I16", "F8_E4M3", "F8_E8M0", "U8", "BOOL"])
def test_key_steps_is_the_key_difference_exhaustively(name: str) -> None:
    """Every (old, new) pair of a shuffled full pattern set: the compiled pass equals numpy's to_key arithmetic."""
    d = dtype_named(name)
    patterns = ALL_16 if d.bits == 16 else ALL_8
    new = np.random.default_rng(0).permutation(patterns)
    assert np.array_equal(key_steps(patterns, new, d), to_key(new, d) - to_key(patterns, d))


@given(
    st.sampled_from(["F32", "I32", "F64", "I64"]),
    st.lists(st.tuples(st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1)), max_size=200),
)
def test_key_steps_wide_types_wrap_like_numpy(name: str, pairs: list[tuple[int, int]]) -> None:
    d = dtype_named(name)
    width = np.dtype(f"<u{d.bits // 8}")
    old = np.array([a & ((1 << d.bits) - 1) for a, _ in pairs], dtype=width)
    new = np.array([b & ((1 << d.bits) - 1) for _, b in pairs], dtype=width)
    with np.errstate(over="ignore"):
        expect = to_key(new, d) - to_key(old, d)
    assert np.array_equal(key_steps(old, new, d), expect)
