"""Property-based tests: flipsync's bytes equal the independent numpy/ml_dtypes reference, bit for bit.

Also: dequantize(serve(x)) stays within each format's error bound, serving bf16(master) gives the
same bytes as serving the master, fused groups share one scale, and NaN/inf is refused by name.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from formats_reference import RefOverflow, bits, engine_input, reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flipsync.errors import FormatError, NonFiniteError
from flipsync.formats import FORMAT_NAMES, dequantize_view, get_format, served_view

# The reference comparisons are cheap: run 3x the active hypothesis profile's example count
# (tests/conftest.py: "ci" by default, HYPOTHESIS_PROFILE=thorough for a deep search).
PROPERTY_SETTINGS = settings(
    max_examples=3 * settings.default.max_examples,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

FP4 = ("mxfp4", "nvfp4")

# Values that stress rounding: signed zeros, fp32/bf16/fp16/e4m3 subnormal edges, e4m3 and e2m1 ties
# and maxima. They are inserted both as they are and scaled by the example's power of two.
SPECIALS = np.array(
    [0.0, -0.0, 2.0**-149, -(2.0**-149), 2.0**-133, 2.0**-126, 2.0**-24, 2.0**-9, 2.0**-10, 3 * 2.0**-10,
     0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -6.0, 1.0625, 1.1875, 448.0, -448.0, 464.0, 480.0,
     1 + 2.0**-8, 1 + 3 * 2.0**-8, 65504.0, 65520.0],
    dtype=np.float32,
)  # fmt: skip


@st.composite
def master_arrays(draw: st.DrawFn, *, even_k: bool = False, big: bool = False) -> np.ndarray:
    """Random float32 [N, K] masters: several distributions, magnitudes 2**-140..2**40, specials,
    zero rows / zero blocks, single outliers."""
    n = draw(st.integers(1, 300 if big else 40))
    k = draw(st.integers(1, 300 if big else 96))
    if even_k:
        k += k % 2
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    log2_scale = draw(st.one_of(st.integers(-30, 12), st.sampled_from([-140, -128, -120, -60, 20, 40])))
    kind = draw(st.sampled_from(["normal", "uniform", "heavy", "grid", "zeros"]))
    if kind == "normal":
        x = rng.standard_normal((n, k))
    elif kind == "uniform":
        x = rng.uniform(-1.0, 1.0, (n, k))
    elif kind == "heavy":
        x = rng.standard_t(2, (n, k))
    elif kind == "grid":  # multiples of 1/16: exact ties once scaled
        x = rng.integers(-128, 129, (n, k)) / 16.0
    else:
        x = np.zeros((n, k))
    x = (x * 2.0**log2_scale).astype(np.float32)
    special_fraction = draw(st.sampled_from([0.0, 0.02, 0.2]))
    if special_fraction:
        mask = rng.random((n, k)) < special_fraction
        picks = rng.choice(SPECIALS, size=int(mask.sum()))
        scaled = rng.random(picks.shape) < 0.5
        with np.errstate(over="ignore"):
            picks = np.where(scaled, picks * np.float32(2.0**log2_scale), picks).astype(np.float32)
        x[mask] = np.where(np.isfinite(picks), picks, 0.0)
    if draw(st.booleans()):
        x[rng.integers(0, n)] = 0.0  # a zero row (zero blocks in every blocked format)
    if draw(st.booleans()):
        i, j = rng.integers(0, n), rng.integers(0, k)
        x[i, j] = np.float32(x[i, j] * 2.0**20 if x[i, j] != 0 else 2.0 ** (log2_scale + 20))
    return x


def torch_bits(t: torch.Tensor) -> np.ndarray:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return bits(t.contiguous().view(width).numpy())


def assert_same_bits(ours: dict[str, torch.Tensor], ref: dict[str, np.ndarray]) -> None:
    assert list(ours) == list(ref)
    for key, expected in ref.items():
        got = torch_bits(ours[key])
        assert got.shape == expected.shape, key
        if not np.array_equal(got, expected):
            bad = np.argwhere(got != expected)[:5].tolist()
            raise AssertionError(f"{key}: {int((got != expected).sum())} differing elements, first at {bad}")


# --- bitwise equality with the reference ------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_bytes_match_reference(fmt: str, data: st.DataObject) -> None:
    x = data.draw(master_arrays(even_k=fmt in FP4, big=fmt == "fp8-block"), label="master")
    from_fp32 = data.draw(st.booleans(), label="from_fp32")
    master = torch.from_numpy(x)
    if data.draw(st.booleans(), label="bf16 master"):
        try:
            x = engine_input(x, from_fp32=False)
        except RefOverflow:
            return
        master = torch.from_numpy(x).to(torch.bfloat16)
    # A publisher hands plain casts reused buffers: stale bits in them must never show through.
    alloc = dirty_alloc if data.draw(st.booleans(), label="reused buffers") else None
    try:
        expected = reference(fmt, "w.weight", x, from_fp32=from_fp32)
    except RefOverflow:
        with pytest.raises(FormatError, match="overflow"):
            served_view({"w.weight": master}, fmt, from_fp32=from_fp32, alloc=alloc)
        return
    assert_same_bits(served_view({"w.weight": master}, fmt, from_fp32=from_fp32, alloc=alloc), expected)


def dirty_alloc(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer full of all-ones bytes (NaN in every float format), as a reused one may hold anything."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.reshape(-1).view(torch.uint8).fill_(0xFF)
    return t


@pytest.mark.parametrize("fmt", ["fp8-tensor", "nvfp4"])
@PROPERTY_SETTINGS
@given(data=st.data())
def test_fused_group_matches_reference(fmt: str, data: st.DataObject) -> None:
    from formats_reference import ref_fp8_tensor, ref_nvfp4

    members = data.draw(st.lists(master_arrays(even_k=True), min_size=2, max_size=3), label="members")
    names = ["l.q_proj.weight", "l.k_proj.weight", "l.v_proj.weight"][: len(members)]
    try:
        inputs = [engine_input(m, from_fp32=False) for m in members]
    except RefOverflow:
        return
    amax = np.float32(max(np.max(np.abs(v)) for v in inputs))
    ref_fn = ref_fp8_tensor if fmt == "fp8-tensor" else ref_nvfp4
    out = served_view({n: torch.from_numpy(m) for n, m in zip(names, members, strict=True)}, fmt)
    scale_key = "_scale" if fmt == "fp8-tensor" else "_scale_2"
    assert len({torch_bits(out[n + scale_key]).tobytes() for n in names}) == 1
    for name, value in zip(names, inputs, strict=True):
        assert_same_bits({k: v for k, v in out.items() if k.startswith(name)}, ref_fn(name, value, amax))


# --- error bounds -------------------------------------------------------------------------------------


def error_bound(fmt: str, name: str, x: torch.Tensor, served: dict[str, torch.Tensor]) -> torch.Tensor:
    """Max allowed |dequant - x| per element (x is the recipe's input)."""
    ax = x.abs()
    slack = 1 + 2.0**-20
    if fmt == "bf16":
        return (ax * 2.0**-8 + 2.0**-134) * slack
    if fmt == "fp16":
        return (ax * 2.0**-11 + 2.0**-25) * slack
    if fmt == "fp8-tensor":  # e4m3: half an ulp (2**-4 relative) plus half the subnormal step
        s = served[name + "_scale"].float()
        return (ax * 2.0**-4 + 2.0**-10 * s) * slack + 4 * 2.0**-23 * ax
    if fmt == "fp8-channel":
        s = served[name + "_scale"].float()
        return (ax * 2.0**-4 + 2.0**-10 * s) * slack + 4 * 2.0**-23 * ax
    if fmt == "int8-channel":  # half a step of the scale (plus the scale's own rounding), clamped at -128 / 127
        s = served[name + "_scale"].float()
        return (0.5 * s + torch.clamp(ax - 127 * s, min=0)) * slack + 4 * 2.0**-23 * ax
    if fmt == "fp8-block":
        n, k = x.shape
        s = served[name + "_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        return (ax * 2.0**-4 + 2.0**-10 * s) * slack + 4 * 2.0**-23 * ax
    if fmt == "mxfp8":  # FLOOR: |y| may reach 512; the part above 448 is lost to saturation
        k = x.shape[1]
        s = served[name + "_scale"].float().sub(127).exp2().repeat_interleave(32, 1)[:, :k]
        return (ax * 2.0**-4 + 2.0**-10 * s + torch.clamp(ax - 448 * s, min=0)) * slack
    if fmt == "mxfp4":  # e2m1 steps: error <= max(|y|, 1) / 4 in units of the block scale
        k = x.shape[1]
        s = served[name + "_scale"].float().sub(127).exp2().repeat_interleave(32, 1)[:, :k]
        return torch.maximum(ax, s) * 0.25 * slack
    if fmt == "nvfp4":
        k = x.shape[1]
        d = served[name + "_scale"].float() * served[name + "_scale_2"].float()
        d = d.repeat_interleave(16, 1)[:, :k]
        # A block scale in the e4m3 subnormal range (an outlier elsewhere in the tensor) can round down
        # by far more than 1/16, and then |y| exceeds 6 and saturates: those elements lose |x| - 6d.
        saturation = torch.clamp(ax - 6 * d, min=0)
        return (torch.maximum(ax, d) * 0.25 + saturation) * slack + 2.0**-20 * ax
    raise AssertionError(fmt)


@st.composite
def moderate_masters(draw: st.DrawFn, even_k: bool) -> np.ndarray:
    """Masters whose magnitudes keep every scale a normal fp32 number (bounds hold without caveats)."""
    x = draw(master_arrays(even_k=even_k))
    keep = (np.abs(x) < 2.0**60) & (np.abs(x) > 2.0**-60)
    return np.where(keep, x, np.float32(0.0)).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@PROPERTY_SETTINGS
@given(data=st.data())
def test_dequantize_within_error_bound(fmt: str, data: st.DataObject) -> None:
    x = data.draw(moderate_masters(even_k=fmt in FP4), label="master")
    from_fp32 = data.draw(st.booleans(), label="from_fp32")
    master = torch.from_numpy(x)
    try:
        served = served_view({"w.weight": master}, fmt, from_fp32=from_fp32)
    except FormatError:
        assert fmt == "fp16"  # only fp16 overflows at these magnitudes
        return
    fmt_obj = get_format(fmt)
    inp = master if fmt in ("bf16", "fp16") else fmt_obj.prepare("w.weight", master, from_fp32=from_fp32)
    deq = dequantize_view(served, fmt)["w.weight"]
    err = (deq.double() - inp.double()).abs()
    bound = error_bound(fmt, "w.weight", inp, served).double()
    assert bool((err <= bound).all()), float((err - bound).max())


# --- idempotence, non-finite ----------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_serving_the_high_precision_view_again_gives_same_bytes(fmt: str, data: st.DataObject) -> None:
    """Quantized formats and bf16: serve(bf16(master)) == serve(master); fp16: serve(fp16(master)) == ...

    So a replica holding the bf16 (fp16) view can recompute every served byte from it.
    """
    x = torch.from_numpy(data.draw(moderate_masters(even_k=fmt in FP4), label="master"))
    try:
        first = served_view({"w.weight": x}, fmt)
    except FormatError:
        return
    high = x.to(torch.float16 if fmt == "fp16" else torch.bfloat16)
    for again in (high, high.float()):
        second = served_view({"w.weight": again}, fmt)
        assert first.keys() == second.keys()
        for key in first:
            assert np.array_equal(torch_bits(first[key]), torch_bits(second[key])), key
    if not get_format(fmt).quantized:
        assert np.array_equal(torch_bits(first["w.weight"]), torch_bits(high))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
@settings(max_examples=max(10, settings.default.max_examples // 3), deadline=None)
@given(
    shape=st.tuples(st.integers(1, 8), st.integers(1, 20).map(lambda k: 2 * k)),
    where=st.integers(0, 10**6),
    bad=st.sampled_from([float("nan"), float("inf"), -float("inf")]),
    name=st.from_regex(r"[a-z]{1,8}\.[a-z_]{1,8}\.weight", fullmatch=True),
)
def test_nonfinite_refused_naming_the_tensor(
    fmt: str, shape: tuple[int, int], where: int, bad: float, name: str
) -> None:
    x = torch.randn(shape)
    x.view(-1)[where % x.numel()] = bad
    masters = {"fine.weight": torch.randn(4, 8), name: x}
    with pytest.raises(NonFiniteError) as info:
        served_view(masters, fmt)
    assert repr(name) in str(info.value)
    with pytest.raises(NonFiniteError, match=re.escape(repr(name))):
        served_view(masters, fmt, alloc=dirty_alloc)
