"""The one-pass cast-and-diff pass gives exactly `served_view`'s bits and the integer diff's changes.

Bitwise: the new view is compared with `served_view` and with the numpy/ml_dtypes reference as integer
views, and the changes with ``np.flatnonzero`` over integer views of the previous and new view. Both the
CPU kernel and the torch path (what CUDA tensors take, forced here on the CPU) are checked.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from formats_reference import RefOverflow, reference
from hypothesis import given
from hypothesis import strategies as st
from test_formats_properties import PROPERTY_SETTINGS, SPECIALS, master_arrays

from flipsync.errors import FormatError, NonFiniteError
from flipsync.formats import cast_diff, get_format, served_view
from flipsync.formats.cast_diff import CastDiffer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
E4M3 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def caster() -> CastDiffer:
    with CastDiffer(2, chunk_elements=4096) as c:  # small chunks: several per tensor, on both threads
        yield c


def ints(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.int16).numpy().view(np.uint16)


def check(caster: CastDiffer, fmt: str, master: torch.Tensor, ref: torch.Tensor, *, torch_path: bool) -> None:
    """One cast_diff against served_view and flatnonzero, bit for bit."""
    dtype = DTYPES[fmt]
    before = ints(ref).copy()
    out = torch.full(master.shape, 7.0, dtype=dtype)  # stale bits must never show through
    new, changes = caster.cast_diff("w", master, dtype, ref, out, torch_path=torch_path)
    expected = ints(served_view({"w": master}, fmt)["w"])
    assert new.dtype == dtype and tuple(new.shape) == tuple(master.shape)
    np.testing.assert_array_equal(ints(new), expected)
    positions = np.flatnonzero(before != expected)
    assert changes.positions.dtype == np.int64 and changes.old.dtype == changes.new.dtype == np.uint16
    np.testing.assert_array_equal(changes.positions, positions)
    np.testing.assert_array_equal(changes.old, before[positions])
    np.testing.assert_array_equal(changes.new, expected[positions])
    np.testing.assert_array_equal(ints(ref), before)  # the previous view is only read


@st.composite
def previous_views(draw: st.DrawFn, x: np.ndarray, fmt: str) -> torch.Tensor:
    """A previous served view of the same shape: the cast of a nearby master, random bits, or identical."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["nearby", "random", "same", "sparse"]))
    dtype = DTYPES[fmt]
    if kind == "random":
        return torch.from_numpy(rng.integers(0, 1 << 16, x.shape, dtype=np.uint16).view(np.int16)).view(dtype)
    base = torch.from_numpy(x).to(dtype)
    if kind == "same":
        return base.clone()
    if kind == "sparse":  # a few lanes off by one step of their integer pattern, as an optimizer step does
        bits = base.view(torch.int16).clone().reshape(-1)
        picks = rng.random(bits.numel()) < draw(st.sampled_from([0.001, 0.02, 0.3]))
        bits[torch.from_numpy(picks)] ^= 1
        return bits.view(dtype).reshape(x.shape)
    step = np.float32(draw(st.sampled_from([1e-7, 1e-5, 1e-3]))) * rng.standard_normal(x.shape).astype(np.float32)
    return torch.from_numpy(x - step * np.abs(x)).to(dtype)


@pytest.mark.parametrize("fmt", list(DTYPES))
@pytest.mark.parametrize("torch_path", [False, True], ids=["kernel", "torch"])
@PROPERTY_SETTINGS
@given(data=st.data())
def test_cast_diff_is_served_view_and_its_diff(caster: CastDiffer, fmt: str, torch_path: bool, data: st.DataObject):
    x = data.draw(master_arrays(big=True), label="master")
    try:
        reference(fmt, "w", x)
    except RefOverflow:  # covered by test_refuses_what_cast_master_refuses
        x = np.clip(x, -60000.0, 60000.0)
    ref = data.draw(previous_views(x, fmt), label="previous view")
    check(caster, fmt, torch.from_numpy(x), ref, torch_path=torch_path)
    np.testing.assert_array_equal(
        ints(caster.cast_diff("w", torch.from_numpy(x), DTYPES[fmt], ref)[0]),
        reference(fmt, "w", x)["w"].reshape(-1).view(np.uint16),
    )


def edge_masters(fmt: str) -> np.ndarray:
    """Every finite 16-bit value's fp32 image, the midpoints between neighbours (ties) and one fp32 step
    either side of each midpoint, both signs; plus fp32 subnormals and the specials."""
    dtype = DTYPES[fmt]
    every = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype).float().numpy()
    every = every[np.isfinite(every)]
    lo, hi = every[:-1].astype(np.float64), every[1:].astype(np.float64)
    mid = ((lo + hi) / 2).astype(np.float32)  # exact: a 16-bit format's midpoint fits fp32
    below = np.nextafter(mid, np.float32(0))
    above = np.nextafter(mid, np.float32(np.inf))
    sub = np.arange(0, 1 << 16, 37, dtype=np.uint32).view(np.float32)
    x = np.concatenate([every, mid, below, above, sub, SPECIALS])
    limit = np.float32(3.3e38 if fmt == "bf16" else 65519.0)
    x = x[np.isfinite(x) & (np.abs(x) <= limit)]
    x = np.concatenate([x, -x]).astype(np.float32)
    return x[np.abs(x) < (np.float32(3.389e38) if fmt == "bf16" else np.float32(65520.0))]


@pytest.mark.parametrize("fmt", list(DTYPES))
@pytest.mark.parametrize("torch_path", [False, True], ids=["kernel", "torch"])
def test_every_value_and_tie(caster: CastDiffer, fmt: str, torch_path: bool) -> None:
    x = edge_masters(fmt)
    rng = np.random.default_rng(0)
    prev = torch.from_numpy(x).to(DTYPES[fmt]).clone()
    flip = torch.from_numpy(rng.random(x.size) < 0.05)
    prev.view(torch.int16)[flip] ^= 1
    check(caster, fmt, torch.from_numpy(x), prev, torch_path=torch_path)
    # odd sizes and offsets: tails shorter than a word, buffers that are not 8-byte aligned
    for start, stop in ((1, 4099), (3, 2050), (0, 5), (2, 3)):
        check(caster, fmt, torch.from_numpy(x[start:stop]), prev[start:stop], torch_path=torch_path)


def test_fp16_without_a_native_conversion(caster: CastDiffer, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 takes the hardware conversion where it matches the integer recipe; the recipe's kernel (what a
    platform without one gets) gives the same bits."""
    x = edge_masters("fp16")
    prev = torch.from_numpy(x[::-1].copy()).to(torch.float16)
    check(caster, "fp16", torch.from_numpy(x), prev, torch_path=False)
    monkeypatch.setattr(cast_diff, "_hw_fp16", lambda: False)
    check(caster, "fp16", torch.from_numpy(x), prev, torch_path=False)
    check(caster, "fp16", torch.from_numpy(x[5:1234]), prev[5:1234], torch_path=False)


@pytest.mark.parametrize("fmt", list(DTYPES))
def test_random_bit_patterns(caster: CastDiffer, fmt: str) -> None:
    """Uniform fp32 bit patterns (every exponent, every mantissa bit) below the format's limit."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 1 << 32, 1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32)
    limit = np.float32(3.389e38 if fmt == "bf16" else 65519.0)
    x = np.where(np.isfinite(x) & (np.abs(x) < limit), x, np.float32(1.5))
    check(caster, fmt, torch.from_numpy(x), torch.from_numpy(x[::-1].copy()).to(DTYPES[fmt]), torch_path=False)


def group_flips(size: int, rng: np.random.Generator) -> np.ndarray:
    """Lanes to flip: each run of 64 lanes (the kernel's mask groups, from any chunk start) gets 0, 1, 2, 3,
    5, 63 or 64 of them, so every path of the emission (two branch-free slots, the loop) and the tail shorter
    than a group is taken."""
    flips = np.zeros(size, bool)
    counts = (0, 1, 2, 3, 5, 63, 64)
    for i, g in enumerate(range(0, size, 64)):
        lanes = min(64, size - g)
        flips[g + rng.choice(lanes, min(counts[i % len(counts)], lanes), replace=False)] = True
    return flips


@pytest.mark.parametrize("fmt", list(DTYPES))
@pytest.mark.parametrize("size", [64 * 7, 64 * 7 + 37, 4096 * 2 + 64 * 3 + 5, 63])
def test_every_group_pattern(caster: CastDiffer, fmt: str, size: int) -> None:
    rng = np.random.default_rng(size)
    x = (rng.standard_normal(size) * 0.02).astype(np.float32)
    prev = torch.from_numpy(x).to(DTYPES[fmt])
    prev.view(torch.int16)[torch.from_numpy(group_flips(size, rng))] ^= 1
    check(caster, fmt, torch.from_numpy(x), prev, torch_path=False)


@pytest.mark.parametrize("torch_path", [False, True], ids=["kernel", "torch"])
def test_never_written_over_the_previous_view(caster: CastDiffer, torch_path: bool) -> None:
    x = torch.randn(10_001) * 0.02
    prev = (x + 1e-5).to(torch.bfloat16)
    before = ints(prev).copy()
    new, changes = caster.cast_diff("w", x, torch.bfloat16, prev, prev, torch_path=torch_path)
    assert new.data_ptr() != prev.data_ptr()
    np.testing.assert_array_equal(ints(prev), before)
    expected = ints(x.to(torch.bfloat16))
    np.testing.assert_array_equal(ints(new), expected)
    np.testing.assert_array_equal(changes.positions, np.flatnonzero(before != expected))
    np.testing.assert_array_equal(changes.old, before[changes.positions])


@pytest.mark.parametrize("fmt", list(DTYPES))
@pytest.mark.parametrize("torch_path", [False, True], ids=["kernel", "torch"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 3.4e38, -70000.0, 65520.0])
def test_refuses_what_cast_master_refuses(caster: CastDiffer, fmt: str, torch_path: bool, bad: float) -> None:
    x = torch.randn(9000)
    x[8191] = bad
    try:
        served_view({"w": x}, fmt)
    except (NonFiniteError, FormatError) as e:
        expected: BaseException = e
    else:
        assert fmt == "bf16" and abs(bad) < 3.39e38  # in bf16's range: cast as usual
        check(caster, fmt, x, torch.zeros(9000, dtype=DTYPES[fmt]), torch_path=torch_path)
        return
    with pytest.raises(type(expected)) as got:
        caster.cast_diff("w", x, DTYPES[fmt], torch.zeros(9000, dtype=DTYPES[fmt]), torch_path=torch_path)
    assert str(got.value) == str(expected)


def test_other_masters_take_the_torch_path(caster: CastDiffer) -> None:
    x = torch.randn(64, 33)
    for master in (x.to(torch.bfloat16), x.t()):  # a bf16 master; a non-contiguous one
        assert not caster.kernel_covers(master, torch.bfloat16, x.to(torch.bfloat16))
        check(caster, "bf16", master, torch.zeros(master.shape, dtype=torch.bfloat16), torch_path=False)


def test_refuses_a_previous_view_of_another_layout(caster: CastDiffer) -> None:
    x = torch.randn(16)
    with pytest.raises(FormatError, match="previous view"):
        caster.cast_diff("w", x, torch.bfloat16, torch.zeros(16, dtype=torch.float16))
    with pytest.raises(FormatError, match="previous view"):
        caster.cast_diff("w", x, torch.bfloat16, torch.zeros(17, dtype=torch.bfloat16))


# --- fp8 and MX: quantize and diff the payload in one pass ---------------------------------------------

QUANTIZED = ("fp8-tensor", "fp8-channel", "fp8-block", "mxfp8", "mxfp4", "nvfp4", "int8-channel")
FP4 = ("mxfp4", "nvfp4")


def zero_payload(fmt: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A previous payload of the right layout, all zero bytes."""
    if fmt in FP4:
        return torch.zeros((shape[0], shape[1] // 2), dtype=torch.uint8)
    if fmt == "int8-channel":
        return torch.zeros(shape, dtype=torch.int8)
    return torch.zeros(shape, dtype=E4M3)


def bytes_of(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def check_quantized(
    caster: CastDiffer, fmt: str, x: torch.Tensor, ref: torch.Tensor, *, from_fp32: bool, group_amax=None
) -> None:
    before = bytes_of(ref).copy()
    got = caster.quantize_diff(fmt, "w.weight", x, ref, group_amax, from_fp32=from_fp32)
    assert got is not None
    parts, changes = got
    if group_amax is None:
        want = served_view({"w.weight": x}, fmt, from_fp32=from_fp32)
    else:
        want = get_format(fmt).encode("w.weight", x, group_amax)
    assert list(parts) == list(want)
    for key in want:
        assert parts[key].dtype == want[key].dtype and parts[key].shape == want[key].shape, key
        np.testing.assert_array_equal(bytes_of(parts[key]), bytes_of(want[key]), err_msg=key)
    expected = bytes_of(want["w.weight"])
    positions = np.flatnonzero(before != expected)
    np.testing.assert_array_equal(changes.positions, positions)
    np.testing.assert_array_equal(changes.old, before[positions])
    np.testing.assert_array_equal(changes.new, expected[positions])


def global_scale_underflows(fmt: str, x: np.ndarray, *, from_fp32: bool) -> bool:
    """An nvfp4 tensor whose amax is so small (subnormal) that amax / (6 * 448) is 0 in fp32."""
    if fmt != "nvfp4":
        return False
    amax = torch.from_numpy(x).abs().amax()
    amax = amax if from_fp32 else amax.to(torch.bfloat16).float()
    return bool(amax > 0) and bool(amax / (6.0 * 448.0) == 0)


@pytest.mark.parametrize("fmt", QUANTIZED)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_quantize_diff_is_served_view_and_its_diff(caster: CastDiffer, fmt: str, data: st.DataObject) -> None:
    x = data.draw(master_arrays(big=True, even_k=fmt in FP4), label="master")
    from_fp32 = data.draw(st.booleans(), label="from_fp32")
    master = torch.from_numpy(x)
    try:
        expected = reference(fmt, "w.weight", x, from_fp32=from_fp32)
    except RefOverflow:  # the recipe refuses it: so does the one-pass cast (the caller then raises the error)
        assert caster.quantize_diff(fmt, "w.weight", master, zero_payload(fmt, x.shape), None,
                                    from_fp32=from_fp32) is None  # fmt: skip
        return
    if global_scale_underflows(fmt, x, from_fp32=from_fp32):  # NaN block scales: left to the recipe itself
        assert caster.quantize_diff(fmt, "w.weight", master, zero_payload(fmt, x.shape), None,
                                    from_fp32=from_fp32) is None  # fmt: skip
        return
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    if data.draw(st.booleans(), label="random previous bytes"):
        prev = zero_payload(fmt, x.shape)
        ref = torch.from_numpy(rng.integers(0, 256, tuple(prev.shape), dtype=np.uint8)).view(prev.dtype)
    else:
        nearby = x * (1 + np.float32(1e-3) * rng.standard_normal(x.shape).astype(np.float32))
        ref = served_view({"w.weight": torch.from_numpy(nearby.astype(np.float32))}, fmt)["w.weight"]
    check_quantized(caster, fmt, master, ref, from_fp32=from_fp32)
    parts, _ = caster.quantize_diff(fmt, "w.weight", master, ref, None, from_fp32=from_fp32)  # type: ignore[misc]
    for key, bits in expected.items():
        np.testing.assert_array_equal(
            parts[key].contiguous().view(torch.uint8 if parts[key].element_size() == 1 else torch.int32).numpy()
            .reshape(-1).view(bits.dtype), bits.reshape(-1), err_msg=key,
        )  # fmt: skip


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantize_edge_values(caster: CastDiffer, fmt: str) -> None:
    """Every e4m3 value, its midpoints and one fp32 step either side (times 2**k scales), zero rows, -0; for
    int8, every integer code's ties and neighbours too (the e4m3 grid holds all integers up to 16)."""
    every = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).float().numpy().astype(np.float64)
    mid = (every[:-1] + every[1:]) / 2
    vals = np.concatenate([every, mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf)]).astype(np.float32)
    vals = np.concatenate([vals, -vals, SPECIALS[np.abs(SPECIALS) < 60000]])
    vals = vals[: vals.size // 2 * 2]
    rows = [vals * np.float32(2.0**s) for s in (-20, -8, 0, 3)]
    x = np.zeros((len(rows) + 2, vals.size), np.float32)
    x[: len(rows)] = rows
    x[-1] = -0.0  # an all -0 row
    for from_fp32 in (False, True):
        check_quantized(caster, fmt, torch.from_numpy(x), zero_payload(fmt, x.shape), from_fp32=from_fp32)
    zeros = torch.zeros(3, 40)
    check_quantized(caster, fmt, zeros, zero_payload(fmt, (3, 40)), from_fp32=False)  # tensor: every byte 0x7E
    tiny = torch.full((2, 64), 2.0**-130)  # MX: a zero exponent field, the 2**-126 divisor
    tiny[1] = torch.linspace(-(2.0**-120), 2.0**-121, 64)
    check_quantized(caster, fmt, tiny, zero_payload(fmt, (2, 64)), from_fp32=True)
    codes = np.arange(-128, 128, dtype=np.float64)  # scale 1 (amax 127.5): every code, its ties and neighbours
    ties = np.concatenate([codes, codes + 0.5, np.nextafter(codes + 0.5, 0), np.nextafter(codes + 0.5, 200)])
    row = np.clip(ties, -127.5, 127.5).astype(np.float32)
    row[0] = 127.5
    check_quantized(caster, fmt, torch.from_numpy(np.stack([row, -row])), zero_payload(fmt, (2, row.size)),
                    from_fp32=True)  # fmt: skip


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantize_every_group_pattern(caster: CastDiffer, fmt: str) -> None:
    """Payload rows of 2 * 64 + 40 bytes whose previous bytes differ in 0..64 lanes of each group of 64."""
    rng = np.random.default_rng(3)
    width = 2 * 64 + 40
    x = (rng.standard_normal((5, width * 2 if fmt in FP4 else width)) * 0.02).astype(np.float32)
    ref = served_view({"w.weight": torch.from_numpy(x)}, fmt)["w.weight"].clone()
    payload = ref.view(torch.uint8)
    for r in range(x.shape[0]):
        payload[r][torch.from_numpy(group_flips(width, rng))] ^= 1
    check_quantized(caster, fmt, torch.from_numpy(x), ref, from_fp32=False)


@pytest.mark.parametrize("fmt", ["fp8-tensor", "nvfp4"])
def test_a_shared_scale_takes_the_group_amax_and_the_prepared_input(caster: CastDiffer, fmt: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 70, generator=g) * 0.02).bfloat16().float()  # what served_view prepares for a group
    amax = torch.tensor(0.5)  # a fused group's, above this member's own
    check_quantized(caster, fmt, x, zero_payload(fmt, (33, 70)), from_fp32=False, group_amax=amax)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_quantize_leaves_what_it_does_not_cover_to_the_recipe(caster: CastDiffer, fmt: str) -> None:
    x = torch.randn(8, 16)
    ref = zero_payload(fmt, (8, 16))
    bad = x.clone()
    bad[3, 3] = float("nan")
    for args in (
        ("bf16", x, ref),  # another format
        (fmt, x.t(), ref.t()),  # not contiguous
        (fmt, x.reshape(-1), ref.reshape(-1)),  # not 2-D
        (fmt, x, zero_payload(fmt, (8, 18))),  # a previous view of another layout
        (fmt, bad, ref),  # non-finite: the recipe raises NonFiniteError
        (fmt, torch.where(x > 0, x, float("-inf")), ref),  # -inf (its bits sort above every finite |x|)
        (fmt, torch.full((8, 16), 3.4e38), ref),  # bf16 overflow: the recipe raises FormatError
    ):
        assert caster.quantize_diff(args[0], "w.weight", args[1], args[2], None, from_fp32=False) is None


def test_nvfp4_with_an_underflowing_global_scale_falls_back_to_the_recipe(caster: CastDiffer) -> None:
    """Found by hypothesis: a subnormal amax makes amax / (6 * 448) zero and the recipe's block scales NaN;
    the one-pass cast must not guess them, so it hands the tensor back to the recipe."""
    x = np.array([[0.0, 0.0], [4.6e-43, 7.6e-44]], dtype=np.float32)
    assert global_scale_underflows("nvfp4", x, from_fp32=True)
    got = caster.quantize_diff("nvfp4", "w.weight", torch.from_numpy(x), zero_payload("nvfp4", x.shape), None,
                               from_fp32=True)  # fmt: skip
    assert got is None


@pytest.fixture(scope="module")
def casters() -> dict[tuple[int, int], CastDiffer]:
    """Casters kept across examples (their spare change buffers are reused from call to call), by (threads,
    chunk elements); chunks of 100 round up to 128: not a power of two of the default's."""
    made = {(t, c): CastDiffer(t, chunk_elements=c) for t in (1, 2, 3) for c in (64, 100, 4096, 1 << 22)}
    yield made
    for c in made.values():
        c.close()


@PROPERTY_SETTINGS
@given(
    fmt=st.sampled_from(list(DTYPES)),
    size=st.integers(0, 20_000),
    threads=st.sampled_from([1, 2, 3]),
    chunk=st.sampled_from([64, 100, 4096]),
    density=st.sampled_from([0.0, 0.001, 0.05, 0.6, 1.0]),
    bad=st.sampled_from([None, float("nan"), 3.4e38]),  # refused by both formats
    seed=st.integers(0, 2**32 - 1),
)
def test_chunked_changes_are_the_single_chunk_ones(
    casters: dict[tuple[int, int], CastDiffer],
    fmt: str,
    size: int,
    threads: int,
    chunk: int,
    density: float,
    bad: float | None,
    seed: int,
) -> None:
    """Any chunking on any thread count gives the changes of one chunk on one thread and of flatnonzero, in
    order (chunks append to shared change buffers, copied out once); a refused master leaves the casters
    as correct for the next call."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[fmt]
    x = torch.from_numpy((rng.standard_normal(size) * 0.02).astype(np.float32))
    prev = x.to(dtype)
    prev.view(torch.int16)[torch.from_numpy(rng.random(size) < density)] ^= 1
    chunked, whole = casters[threads, chunk], casters[1, 1 << 22]
    if bad is not None and size:
        worse = x.clone()
        worse[int(rng.integers(size))] = bad
        with pytest.raises((NonFiniteError, FormatError)):
            chunked.cast_diff("w", worse, dtype, prev)
    before = ints(prev)
    expected = ints(x.to(dtype))
    positions = np.flatnonzero(before != expected)
    for caster in (chunked, whole):
        new, changes = caster.cast_diff("w", x, dtype, prev)
        np.testing.assert_array_equal(ints(new), expected)
        assert changes.positions.dtype == np.int64 and changes.old.dtype == changes.new.dtype == np.uint16
        np.testing.assert_array_equal(changes.positions, positions)
        np.testing.assert_array_equal(changes.old, before[positions])
        np.testing.assert_array_equal(changes.new, expected[positions])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("density", [0.0, 0.02, 1.0])
def test_quantized_row_chunks_in_order(threads: int, density: float) -> None:
    """fp8-block runs a task per 128 rows: several tasks, several threads, their changes in row order."""
    rng = np.random.default_rng(int(density * 100) + threads)
    x = torch.from_numpy((rng.standard_normal((1000, 200)) * 0.02).astype(np.float32))
    with CastDiffer(threads) as caster:
        first = caster.quantize_diff("fp8-block", "w", x, torch.zeros(1000, 200, dtype=E4M3), None, from_fp32=True)
        assert first is not None
        prev = first[0]["w"].view(torch.uint8).clone()
        prev[torch.from_numpy(rng.random((1000, 200)) < density)] ^= 1
        for _ in range(2):  # the second call reuses the first's change buffers
            got = caster.quantize_diff("fp8-block", "w", x, prev.view(E4M3), None, from_fp32=True)
            assert got is not None
            payload = got[0]["w"].view(torch.uint8).numpy().reshape(-1)
            was = prev.numpy().reshape(-1)
            positions = np.flatnonzero(was != payload)
            np.testing.assert_array_equal(payload, first[0]["w"].view(torch.uint8).numpy().reshape(-1))
            np.testing.assert_array_equal(got[1].positions, positions)
            np.testing.assert_array_equal(got[1].old, was[positions])
            np.testing.assert_array_equal(got[1].new, payload[positions])
