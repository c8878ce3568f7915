"""Size estimates and the registry's pruned choice: exact where claimed, close where sampled, the same choice
(or one within the margin) as coding every candidate, and bitwise round trips; the reciprocal rANS encoder
writes exactly what a divide-per-value encoder writes."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from flipsync.codec import Patch, apply_patch, diff_views, rans, section
from flipsync.codec.coders import ESTIMATE_FROM, ESTIMATE_MARGIN, ESTIMATE_SLACK, CoderRegistry, Params
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.codec.zstd import SAMPLE_FROM
from tests.strategies import same_bits


@st.composite
def positions(draw: st.DrawFn, max_n: int = 100_000) -> np.ndarray:
    """Sorted unique positions: scattered at some density, in runs, scattered and dense halves, or a few."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.sampled_from([0, 1, 2, 7, 300, ESTIMATE_FROM - 1, ESTIMATE_FROM, 40_000, max_n]))
    kind = draw(st.sampled_from(["scattered", "runs", "halves", "sparse"]))
    if kind == "scattered":
        pos = np.cumsum(rng.geometric(draw(st.sampled_from([0.5, 0.05, 0.02, 0.003])), n)) - 1
    elif kind == "runs":
        run = draw(st.sampled_from([2, 4, 16, 200]))
        starts = np.cumsum(rng.geometric(0.01, n // run + 1) + run)
        pos = (starts[:, None] + np.arange(run)).reshape(-1)[:n]
    elif kind == "halves":
        pos = np.concatenate([np.cumsum(rng.geometric(0.02, n // 2)), 10**9 + np.arange(n - n // 2) * 3])
    else:
        pos = np.unique(rng.integers(0, 1 << 40, n))
    return np.unique(pos.astype(np.int64))


@st.composite
def symbols(draw: st.DrawFn, max_n: int = 100_000) -> np.ndarray:
    """Unsigned symbols: zigzagged small steps (some escaping), raw FP8 bytes, raw BF16 patterns, one value."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.sampled_from([1, 2, 9, 300, ESTIMATE_FROM - 1, ESTIMATE_FROM, 40_000, max_n]))
    kind = draw(st.sampled_from(["steps", "escapes", "fp8", "bf16", "one", "skewed"]))
    if kind == "steps":
        steps = rng.choice([-2, -1, 1, 2, -3, 3], size=n, p=[0.1, 0.4, 0.4, 0.05, 0.03, 0.02])
        return ((steps << 1) ^ (steps >> 63)).astype(np.uint64)
    if kind == "escapes":
        v = rng.geometric(0.4, n).astype(np.uint64)
        v[rng.random(n) < 0.01] = 40_000
        return v
    if kind == "fp8":
        return rng.binomial(255, 0.3, n).astype(np.uint64)
    if kind == "bf16":
        return (0x3C00 + rng.integers(-3000, 3000, n)).astype(np.uint64)
    if kind == "one":
        return np.full(n, draw(st.integers(0, (1 << 64) - 1)), dtype=np.uint64)
    return (rng.random(n) < 0.001).astype(np.uint64)  # a symbol seen once or never: frequency 1


def _every_candidate(registry: CoderRegistry, data: np.ndarray) -> dict[str, tuple[Params, bytes]]:
    return {c.codec_id: c.encode(data) for c in registry._by_id.values() if not c.needs_base and c.accepts(data)}


@given(positions())
def test_rice_estimate_is_exact(pos: np.ndarray) -> None:
    coder = section.POSITION_CODERS.coder({"codec": "rice"})
    assert coder.estimate(pos) == len(coder.encode(pos)[1])


@given(st.one_of(symbols(), st.lists(st.integers(0, (1 << 64) - 1), max_size=300)))
def test_fixed_width_estimate_is_exact(values: np.ndarray | list[int]) -> None:
    values = np.array(values, dtype=np.uint64)
    coder = section.SYMBOL_CODERS.coder({"codec": "bits"})
    assert coder.estimate(values) == len(coder.encode(values)[1])


@given(symbols())
def test_ans_estimate_is_within_a_few_bytes(values: np.ndarray) -> None:
    """Off by the final states' bits at most, when the escapes are few enough to be coded, not sampled."""
    if int((values >= rans.ANS_MAX_ALPHABET).sum()) >= SAMPLE_FROM:
        return
    assert abs(rans.RansCoder().estimate(values) - len(rans.RansCoder().encode(values)[1])) <= ESTIMATE_SLACK


def _within_margin(registry: CoderRegistry, data: np.ndarray) -> None:
    params, blob = registry.encode(data)
    every = _every_candidate(registry, data)
    smallest = min(len(b) for _, b in every.values())
    assert len(blob) <= smallest * ESTIMATE_MARGIN + ESTIMATE_SLACK
    if data.size < ESTIMATE_FROM:  # every candidate coded, as before estimates
        assert len(blob) == smallest
    assert blob == every[params["codec"]][1]
    if len(blob) == smallest:  # a tie keeps the first listed, as when every candidate was coded
        assert params["codec"] == next(c for c, (_, b) in every.items() if len(b) == smallest)


@given(positions())
def test_position_choice_is_within_the_margin_of_the_smallest(pos: np.ndarray) -> None:
    _within_margin(section.POSITION_CODERS, pos)
    params, blob = section.encode_positions(pos)
    numel = int(pos[-1]) + 1 if pos.size else 1
    assert np.array_equal(section.decode_positions(params, blob, pos.size, numel), pos)


@given(symbols())
def test_value_choice_is_within_the_margin_of_the_smallest(values: np.ndarray) -> None:
    _within_margin(section.SYMBOL_CODERS, values)
    params, blob = section.encode_symbols(values)
    assert np.array_equal(section.decode_symbols(params, blob, values.size), values)


def test_clear_losers_are_not_coded(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Scattered positions and small steps: rice and ans are coded, zstd and fixed width are not."""
    rng = np.random.default_rng(3)
    pos = np.cumsum(rng.geometric(0.02, 100_000)).astype(np.int64)
    steps = rng.choice([-2, -1, 1, 2], size=pos.size, p=[0.1, 0.4, 0.4, 0.1])
    coded: list[str] = []
    for registry in (section.POSITION_CODERS, section.SYMBOL_CODERS):
        for c in registry._by_id.values():
            monkeypatch.setattr(c, "encode", lambda d, b=None, _c=c, _e=c.encode: coded.append(_c.codec_id) or _e(d, b))
    assert section.encode_positions(pos)[0]["codec"] == "rice"
    assert section.encode_symbols(((steps << 1) ^ (steps >> 63)).astype(np.uint64))[0]["codec"] == "ans"
    assert coded == ["rice", "ans"]


def _division_encoder(symbols: np.ndarray, freq: np.ndarray, prec: int, lanes: int) -> list[int]:
    """The rANS encoder with a division per value (as it was), in Python integers: the reference."""
    cum = np.concatenate([[0], np.cumsum(freq.astype(np.int64))]).tolist()
    f_of = freq.astype(np.int64).tolist()
    x = [rans.ANS_LOW if lanes > 1 else 0] * lanes
    bound = (rans.ANS_LOW >> prec) << 32
    words: list[int] = []
    for i in range(len(symbols) - 1, -1, -1):
        s = min(int(symbols[i]), len(f_of) - 1)
        f, v = f_of[s], x[i % lanes]
        if v >= bound * f:
            words.append(v & 0xFFFFFFFF)
            v >>= 32
        x[i % lanes] = ((v // f) << prec) + v % f + cum[s]
    words.reverse()
    if lanes == 1 and not words:
        return [x[0] >> 32, x[0] & 0xFFFFFFFF] if x[0] >= 1 << 32 else [x[0]] if x[0] else []
    return [w for v in x for w in (v >> 32, v & 0xFFFFFFFF)] + words


@given(symbols(max_n=20_000), st.sampled_from([1, 4]))
def test_reciprocal_rans_writes_what_division_writes(values: np.ndarray, lanes: int) -> None:
    counts = rans.ans_counts(values)
    prec = rans._ans_shape(values.size)[0]
    freq = rans.ans_quantize(counts, prec)
    out = np.empty(values.size + 2 * lanes, dtype=np.uint32)
    start = rans.ans_pack(values, freq, prec, lanes, out)
    assert out[start:].tolist() == _division_encoder(values, freq, prec, lanes)


@given(st.integers(2, 1 << 16), st.lists(st.integers(0, (1 << 63) - 1), max_size=50))
def test_reciprocals_divide_exactly_below_2_63(f: int, xs: list[int]) -> None:
    rcp, shift = rans.ans_reciprocals(np.array([0, 1, f], dtype=np.uint32))
    r, s = int(rcp[2]), int(shift[2])
    edges = [0, 1, f - 1, f, f + 1, (1 << 63) - 1, ((1 << 63) - 1) // f * f, ((1 << 63) - 1) // f * f - 1]
    assert all(((x * r) >> 64) >> s == x // f for x in xs + edges)


def test_a_view_with_large_sections_round_trips_bitwise() -> None:
    """Sections large enough for sampled estimates: scattered one-ulp steps, a dense run, a sign flip."""
    rng = np.random.default_rng(4)
    old = {
        "w": torch.randn(1_500_000).to(torch.bfloat16),
        "dense": torch.randn(300_000).to(torch.bfloat16),
        "e4m3": (torch.randn(800_000) * 4).to(torch.float8_e4m3fn),
    }
    new = {k: v.clone() for k, v in old.items()}
    bits = new["w"].view(torch.int16)
    hit = torch.from_numpy(rng.random(bits.numel()) < 0.02)
    bits[hit] += torch.from_numpy(rng.choice([-2, -1, 1, 2], size=int(hit.sum())).astype(np.int16))
    new["dense"].view(torch.int16)[1000:101_000] += 1
    new["dense"][5] = -new["dense"][5]
    e = new["e4m3"].view(torch.uint8)
    hit = torch.from_numpy(rng.random(e.numel()) < 0.03)
    e[hit] ^= 1
    patch, new_table = diff_views(old, new, context=False)
    work = {k: v.clone() for k, v in old.items()}
    table = FingerprintTable.of(work)
    apply_patch(work, Patch.from_bytes(patch.to_bytes()), table, verify="digest")
    assert all(same_bits(work[k], new[k]) for k in new)
    assert table == new_table
