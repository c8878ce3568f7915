"""Position and value coders: exact round trips, near-entropy sizes, and clean errors on bad bytes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flipsync.codec import rans, section
from flipsync.codec import rice as rice_mod
from flipsync.codec.bitpack import exp_golomb_bits, pack_codes, pack_exp_golomb, unpack_exp_golomb
from flipsync.codec.coders import position_gaps
from flipsync.errors import CorruptPatchError


@st.composite
def position_sets(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    numel = draw(st.integers(1, 1 << 40))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(0, min(numel, 3000)))
    kind = draw(st.sampled_from(["uniform", "runs", "edges"]))
    if kind == "uniform":
        pos = np.unique(rng.integers(0, numel, size=n))
    elif kind == "runs":
        start = int(rng.integers(0, numel))
        pos = np.arange(start, min(numel, start + n))
    else:
        pos = np.unique(np.array([0, numel - 1, numel // 2][: max(1, n % 4)], dtype=np.int64))
    return pos.astype(np.int64), numel


@given(position_sets())
def test_positions_round_trip(case: tuple[np.ndarray, int]) -> None:
    pos, numel = case
    params, blob = section.encode_positions(pos)
    out = section.decode_positions(params, blob, pos.size, numel)
    assert out.dtype == np.int64 and np.array_equal(out, pos)


@given(st.lists(st.integers(0, (1 << 64) - 1), max_size=500), st.sampled_from(["zstd", "ans", "bits", "best"]))
def test_symbols_round_trip(values: list[int], coder: str) -> None:
    sym = np.array(values, dtype=np.uint64)
    if coder == "best":
        params, blob = section.encode_symbols(sym)
    else:
        chosen = section.SYMBOL_CODERS.coder({"codec": coder})
        if not chosen.accepts(sym):
            return
        params, blob = chosen.encode(sym)
        params["codec"] = coder
    assert np.array_equal(section.decode_symbols(params, blob, sym.size), sym)


@given(position_sets(), st.sampled_from(["rice", "zstd"]))
def test_each_position_coder_round_trips(case: tuple[np.ndarray, int], coder: str) -> None:
    pos, numel = case
    chosen = section.POSITION_CODERS.coder({"codec": coder})
    params, blob = chosen.encode(pos)
    assert np.array_equal(chosen.decode(params, blob, pos.size, numel), pos)


def test_registries_name_every_coder_once() -> None:
    assert section.POSITION_CODERS.ids() == ("rice", "zstd", "ctx")
    assert section.SYMBOL_CODERS.ids() == ("zstd", "bits", "ans")
    with pytest.raises(CorruptPatchError, match="unknown value codec 'huffman'"):
        section.decode_symbols({"codec": "huffman"}, b"", 1)
    with pytest.raises(CorruptPatchError, match="unknown position codec None"):
        section.decode_positions({}, b"", 1, 10)


def _log2_binom(u: int, n: int) -> float:
    return (math.lgamma(u + 1) - math.lgamma(n + 1) - math.lgamma(u - n + 1)) / math.log(2)


@pytest.mark.parametrize("density", [0.0005, 0.003, 0.01, 0.05, 0.13])
def test_scattered_positions_cost_within_2_percent_of_entropy(density: float) -> None:
    rng = np.random.default_rng(1)
    numel = 4_000_000
    pos = np.flatnonzero(rng.random(numel) < density)
    _, blob = section.encode_positions(pos)
    assert len(blob) * 8 <= 1.02 * _log2_binom(numel, pos.size)


def test_clustered_positions_are_cheap() -> None:
    pos = np.arange(1000, 101_000, dtype=np.int64)  # one run of 100k changes
    _, blob = section.encode_positions(pos)
    assert len(blob) < pos.size / 8 + 64  # about one bit per position or less


def test_value_steps_reach_empirical_entropy() -> None:
    rng = np.random.default_rng(2)
    steps = rng.choice([1, 2, 3, 4, 5, 6, 40_000], size=200_000, p=[0.45, 0.45, 0.04, 0.03, 0.015, 0.0149, 0.0001])
    params, blob = section.encode_symbols(steps.astype(np.uint64))
    _, counts = np.unique(steps, return_counts=True)
    p = counts / counts.sum()
    entropy_bytes = float(-(counts * np.log2(p)).sum()) / 8
    assert params["codec"] == "ans"
    assert len(blob) <= 1.01 * entropy_bytes + 64


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 4095, 16383, 16384, 16385, 16386, 16387, 200_003])
@pytest.mark.parametrize("kind", ["steps", "constant", "escapes"])
def test_ans_round_trips_at_every_lane_layout(n: int, kind: str) -> None:
    """One lane below 2**14 values (starting from state 0), four interleaved lanes from there, any tail."""
    rng = np.random.default_rng(n)
    if kind == "steps":
        sym = rng.integers(0, 4, size=n)
    elif kind == "constant":
        sym = np.full(n, 7)
    else:
        sym = np.where(rng.random(n) < 0.02, rng.integers(0, 1 << 40, size=n), rng.integers(0, 6, size=n))
    sym = sym.astype(np.uint64)
    params, blob = rans.RansCoder().encode(sym)
    assert np.array_equal(rans.RansCoder().decode(params, blob, n), sym)


def test_ans_refuses_a_table_that_does_not_count_the_values() -> None:
    sym = np.random.default_rng(5).integers(0, 3, size=1000).astype(np.uint64)
    params, blob = rans.RansCoder().encode(sym)
    for n in (999, 1001):
        with pytest.raises(CorruptPatchError):
            rans.RansCoder().decode(params, blob, n)


@pytest.mark.parametrize("cut", [0, 1, 5, -1])
def test_truncated_streams_raise(cut: int) -> None:
    rng = np.random.default_rng(3)
    pos = np.unique(rng.integers(0, 1 << 20, size=5000))
    params, blob = section.encode_positions(pos)
    bad = blob[:cut]
    with pytest.raises(CorruptPatchError):
        section.decode_positions(params, bad, pos.size, 1 << 20)
    sym = rng.integers(0, 9, size=5000).astype(np.uint64)
    vparams, vblob = section.encode_symbols(sym)
    with pytest.raises(CorruptPatchError):
        section.decode_symbols(vparams, vblob[: max(0, cut if cut >= 0 else len(vblob) - 9)], sym.size)


@given(st.binary(max_size=300), st.integers(0, 5000), st.sampled_from(["rice", "zstd"]), st.integers(0, 70))
def test_garbage_positions_never_crash(blob: bytes, n: int, codec: str, k: int) -> None:
    params = {"codec": codec, "k": k, "width": [1, 2, 4, 8][k % 4]}
    try:
        out = section.decode_positions(params, blob, n, 1 << 20)
    except CorruptPatchError:
        return
    assert out.size == n and (n == 0 or (out[-1] < 1 << 20 and np.all(np.diff(out) > 0)))


@given(st.binary(max_size=300), st.integers(0, 3000), st.sampled_from(["ans", "zstd", "bits"]), st.integers(0, 300))
def test_garbage_symbols_never_crash(blob: bytes, n: int, codec: str, a: int) -> None:
    params = {"codec": codec, "alphabet": a, "escapes": a % 7, "esc_width": 1, "bits": a % 70, "width": 2}
    try:
        out = section.decode_symbols(params, blob, n)
    except CorruptPatchError:
        return
    assert out.size == n


@pytest.mark.parametrize("values", [[0], [0, 0, 0], [5], [7] * 100, [1, 0]])
def test_one_symbol_alphabets(values: list[int]) -> None:
    sym = np.array(values, dtype=np.uint64)
    params, blob = rans.RansCoder().encode(sym)
    params["codec"] = "ans"
    assert np.array_equal(section.decode_symbols(params, blob, sym.size), sym)


def _reference_bits(values: list[int], param: int, rice: bool) -> bytes:
    """The MSB-first bit writer, one bit at a time: what ``pack_codes`` must produce, whatever its fast paths."""
    bits = []
    for v in values:
        if rice:
            bits += [0] * (v >> param) + [1]
        bits += [(v >> i) & 1 for i in range(param - 1, -1, -1)]
    bits += [0] * (-len(bits) % 8)
    return bytes(int("".join(map(str, bits[i : i + 8])), 2) for i in range(0, len(bits), 8))


@given(
    st.lists(st.integers(0, (1 << 64) - 1), max_size=60),
    st.integers(0, 64),
    st.booleans(),
)
def test_pack_codes_matches_a_bit_at_a_time_writer(values: list[int], param: int, rice: bool) -> None:
    # both the accumulator's fast path and the long-code fallback (wide fields, long quotients)
    if rice:
        param = min(param, rice_mod.MAX_RICE_K)
        values = [v % (401 << param) for v in values]  # quotients up to 400: past the fast path's 56
    else:
        param = max(1, param)
        values = [v & ((1 << param) - 1) for v in values]
    want = _reference_bits(values, param, rice)
    out = np.zeros(len(want) + 8, dtype=np.uint8)
    used = pack_codes(np.array(values, dtype=np.uint64), param, rice, out)
    assert out[:used].tobytes() == want


@given(position_sets())
def test_rice_from_positions_equals_rice_of_gaps(case: tuple[np.ndarray, int]) -> None:
    positions, _ = case
    assert rice_mod.RiceCoder().encode(positions) == rice_mod.rice_encode(position_gaps(positions))


@given(st.lists(st.integers(0, (1 << 62) - 1), max_size=80), st.integers(0, 15))
def test_exp_golomb_round_trips(values: list[int], k: int) -> None:
    v = np.array(values, dtype=np.uint64)
    out = np.zeros((exp_golomb_bits(v, k) + 7) // 8, dtype=np.uint8)
    used = pack_exp_golomb(v, k, out)
    assert used == out.size
    back = np.zeros(v.size, dtype=np.uint64)
    assert unpack_exp_golomb(out, k, back) == 0
    assert back.tolist() == values


@given(st.binary(max_size=64), st.integers(0, 200), st.integers(0, 15))
def test_exp_golomb_garbage_is_refused_or_decoded_in_bounds(blob: bytes, n: int, k: int) -> None:
    out = np.zeros(n, dtype=np.uint64)
    status = unpack_exp_golomb(np.frombuffer(blob, dtype=np.uint8), k, out)
    assert status in (0, -1, -3)  # OK, TRUNCATED, CORRUPT: never a read past the bytes


def test_ans_tables_code_skewed_counts_compactly_and_refuse_a_cut_table() -> None:
    rng = np.random.default_rng(3)
    symbols = np.minimum(rng.geometric(0.02, 20_000), 255).astype(np.uint64)  # a long tail of rare steps
    params, blob = rans.RansCoder().encode(symbols)
    kind = rans._ANS_HEADER.unpack_from(blob)[2]
    assert kind >= rans._EXP_GOLOMB  # the tail's many small counts beat a fixed width
    assert rans.RansCoder().decode(params, blob, symbols.size).tolist() == symbols.tolist()
    used, k, _, sym_len, _, words_len = rans._ANS_HEADER.unpack_from(blob)
    cut = rans._ANS_HEADER.pack(used, k, kind, sym_len, 1, words_len) + blob[rans._ANS_HEADER.size :]
    with pytest.raises(CorruptPatchError):
        rans.RansCoder().decode(params, cut, symbols.size)
