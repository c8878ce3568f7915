"""The quantized formats' numba kernels: encode rows of FP32 masters into codes and scales, store the codes and
emit the bytes that differ from the previous payload (`CastDiffer.quantize_diff` runs them on chunks)."""

from __future__ import annotations

import numpy as np
import torch
from numba.cpython.unsafe.numbers import viewer

from flipsync.codec.jit import kernel
from flipsync.formats.cast_kernels import BF16, GROUP, emit_lanes, round16

_U = np.uint32
_Q = np.uint64

_E4M3_MAX = np.float32(448.0)
_EPS32 = np.float32(2.0**-23)  # compressed-tensors' replacement of a zero channel scale


@kernel(inline="always")
def _e4m3(v: np.uint32) -> np.uint8:
    """fp32 bits of a finite ``|y| <= 448`` -> e4m3fn bits, round to nearest even (subnormals from 2**-9)."""
    sign = _U(_U(v >> _U(24)) & _U(0x80))
    a = _U(v & _U(0x7FFFFFFF))
    an = _U(a - _U(0x3C000000))  # rebias the exponent 127 -> 7, round the mantissa at bit 20
    normal = _U(_U(_U(an + _U(0x7FFFF)) + _U(_U(an >> _U(20)) & _U(1))) >> _U(20))
    e = _U(a >> _U(23))
    shift = min(_U(_U(141) - e), _U(25))  # subnormal: the mantissa in units of 2**-9
    m = _U(_U(a & _U(0x7FFFFF)) | _U(0x800000))
    half = _U(_U(_U(1) << _U(shift - _U(1))) - _U(1))
    sub = _U(_U(_U(m + half) + _U(_U(m >> shift) & _U(1))) >> shift)
    sub = sub if e >= _U(117) else _U(0)  # below 2**-10 (ties included) rounds to zero
    return np.uint8(sign | (normal if a >= _U(0x3C800000) else sub))


@kernel(inline="always")
def _store_diff(
    codes: np.ndarray,
    out: np.ndarray,
    ref: np.ndarray,
    at: int,
    pos: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    n: int,
) -> int:
    """Copies one row of codes into ``out`` (a row of the payload) and records where ``ref`` (the previous
    row) held another byte, positions from ``at``, in groups of 64 as `cast_diff_bits`; the next free slot."""
    size = codes.shape[0]
    full = size - size % GROUP
    for g in range(0, full, GROUP):
        m = _Q(0)
        for j in range(GROUP):
            q = codes[g + j]
            m |= _Q(_Q(q != ref[g + j]) << _Q(j))
            out[g + j] = q
        n = emit_lanes(m, g, at, ref, out, pos, old, new, n)
    for i in range(full, size):
        q = codes[i]
        out[i] = q
        if q != ref[i]:
            pos[n], old[n], new[n] = at + i, ref[i], q
            n += 1
    return n


@kernel(inline="always")
def _load_row(src: np.ndarray, bits: np.ndarray, round_bf16: bool, top: np.uint32) -> np.uint32:
    """One row of fp32 master bits into ``bits`` (rounded to bf16 first when the recipe starts from bf16);
    the running max of |master| bits, which tells a row with a non-finite or out-of-range master."""
    if round_bf16:  # two loops, not a select per element: each vectorizes
        for j in range(src.shape[0]):
            u = src[j]
            top = max(top, _U(u & _U(0x7FFFFFFF)))
            bits[j] = _U(round16(u, BF16) << _U(16))
    else:
        for j in range(src.shape[0]):
            u = src[j]
            top = max(top, _U(u & _U(0x7FFFFFFF)))
            bits[j] = u
    return top


@kernel(inline="always")
def _abs_max_bits(src: np.ndarray) -> np.uint32:
    """max |x| of fp32 bit patterns, as a bit pattern (sign cleared: the order of |x|, NaN's above inf's).
    An integer max vectorizes; a float one does not (LLVM keeps its NaN order)."""
    top = _U(0)
    for i in range(src.shape[0]):
        top = max(top, _U(src[i] & _U(0x7FFFFFFF)))
    return top


FP8_TENSOR, FP8_CHANNEL, INT8_CHANNEL = 0, 1, 2  # the recipes `rows8` runs
_I8_HALF_RANGE = np.float32(127.5)  # compressed-tensors' symmetric int8 divisor: (127 - (-128)) / 2
_I8_MIN, _I8_MAX = np.float32(-128.0), np.float32(127.0)


@kernel(error_model="numpy")
def rows8(
    src: np.ndarray,
    ref: np.ndarray,
    out: np.ndarray,
    scales: np.ndarray,
    recipe: int,
    inv: np.float32,
    round_bf16: bool,
    pos: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
) -> tuple[int, np.uint32]:
    """Rows of fp32 bits ``src`` [R, K] -> e4m3 or int8 bytes ``out``, and the changes against ``ref`` (positions
    from the first row). FP8_TENSOR: vLLM per-tensor (``fmax(-448, fmin(x * inv, 448))``, NaN-ignoring: 0 * inf
    gives 448); FP8_CHANNEL / INT8_CHANNEL: compressed-tensors (row scale amax/448 or amax/127.5 into ``scales``,
    a zero one 2**-23; ``clamp(x / scale)``, int8 then ``rint``, half to even). ``round_bf16``: the input is
    bf16(master). Returns (changes, max |master| bits)."""
    rows, k = src.shape
    vals = np.empty(k, np.float32)
    bits = vals.view(np.uint32)
    codes = np.empty(k, np.uint8)
    n = 0
    top = _U(0)
    for r in range(rows):
        top = _load_row(src[r], bits, round_bf16, top)
        if recipe == FP8_TENSOR:
            for j in range(k):
                y = np.float32(vals[j] * inv)
                vals[j] = _E4M3_MAX if y != y else min(max(y, -_E4M3_MAX), _E4M3_MAX)
        else:
            amax = viewer(_abs_max_bits(bits), np.float32)
            scale = np.float32(amax / (_I8_HALF_RANGE if recipe == INT8_CHANNEL else _E4M3_MAX))
            if scale == 0:
                scale = _EPS32
            scales[r] = scale
            if recipe == INT8_CHANNEL:
                for j in range(k):
                    y = np.rint(min(max(np.float32(vals[j] / scale), _I8_MIN), _I8_MAX))
                    codes[j] = np.uint8(np.int32(y) & 0xFF)
            else:
                for j in range(k):
                    vals[j] = min(max(np.float32(vals[j] / scale), -_E4M3_MAX), _E4M3_MAX)
        if recipe != INT8_CHANNEL:
            for j in range(k):
                codes[j] = _e4m3(bits[j])
        n = _store_diff(codes, out[r], ref[r], r * k, pos, old, new, n)
    return n, top


TILE = 128  # fp8-block: DeepGEMM's 128x128 tiles
_TILE_AMAX_FLOOR = np.float32(1e-4)


@kernel(error_model="numpy")
def fp8_tile_rows(
    src: np.ndarray,
    ref: np.ndarray,
    out: np.ndarray,
    sf: np.ndarray,
    round_bf16: bool,
    pos: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
) -> tuple[int, np.uint32]:
    """One row of 128x128 tiles (``src`` [<= 128, K] fp32 bits) -> e4m3 ``out`` and its tiles' ``sf``
    (amax floored at 1e-4, / 448), ``x * (1 / sf)`` clamped: DeepGEMM's `per_block_cast_to_fp8`. Returns
    (changes against ``ref``, positions from the first row; max |master| bits)."""
    rows, k = src.shape
    vals = np.empty((rows, k), np.float32)
    bits = vals.view(np.uint32)
    tiles = sf.shape[0]
    amax = np.zeros(tiles, np.uint32)  # as |x| bit patterns
    codes = np.empty(k, np.uint8)
    top = _U(0)
    for r in range(rows):
        top = _load_row(src[r], bits[r], round_bf16, top)
        for t in range(tiles):
            amax[t] = max(amax[t], _abs_max_bits(bits[r, t * TILE : (t + 1) * TILE]))
    inv = np.empty(tiles, np.float32)
    for t in range(tiles):
        s = np.float32(max(viewer(amax[t], np.float32), _TILE_AMAX_FLOOR) / _E4M3_MAX)
        sf[t] = s
        inv[t] = np.float32(np.float32(1.0) / s)
    n = 0
    for r in range(rows):
        for j in range(k):
            y = np.float32(vals[r, j] * inv[j // TILE])
            vals[r, j] = min(max(y, -_E4M3_MAX), _E4M3_MAX)
        for j in range(k):
            codes[j] = _e4m3(bits[r, j])
        n = _store_diff(codes, out[r], ref[r], r * k, pos, old, new, n)
    return n, top


MX = 32  # MX block: 32 consecutive elements along K
_F32_MIN_NORMAL = np.float32(2.0**-126)


@kernel(inline="always")
def _e2m1(y: np.float32, sign_bits: np.uint32) -> np.uint8:
    """fp32 -> e2m1 code: RNE saturating at 6 by counting thresholds passed; sign = signbit (-0.0 -> 0x8)."""
    a = abs(y)
    idx = (
        np.uint8(a > 0.25)
        + np.uint8(a >= 0.75)
        + np.uint8(a > 1.25)
        + np.uint8(a >= 1.75)
        + np.uint8(a > 2.5)
        + np.uint8(a >= 3.5)
        + np.uint8(a > 5.0)
    )
    return np.uint8(idx | np.uint8((sign_bits >> _U(31)) << _U(3)))


@kernel(error_model="numpy")
def mx_rows(
    src: np.ndarray,
    ref: np.ndarray,
    out: np.ndarray,
    scale: np.ndarray,
    emax: int,
    fp4: bool,
    round_bf16: bool,
    pos: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
) -> tuple[int, np.uint32]:
    """Rows of fp32 bits ``src`` [R, K] -> MX (torchao FLOOR) payload ``out`` (e4m3 [R, K], or e2m1 codes
    packed two per byte [R, K/2], element 2i low) and E8M0 ``scale`` [R, ceil(K/32)]; the payload's changes
    against ``ref``, positions from the first row. Returns (changes, max |master| bits)."""
    rows, k = src.shape
    width = out.shape[1]
    vals = np.empty(k, np.float32)
    bits = vals.view(np.uint32)
    divisors = np.empty(k, np.float32)  # each element's block divisor: the division then vectorizes
    codes = np.empty(k, np.uint8)
    packed = np.empty(width, np.uint8)
    n = 0
    top = _U(0)
    for r in range(rows):
        top = _load_row(src[r], bits, round_bf16, top)
        for b0 in range(0, k, MX):
            b1 = min(k, b0 + MX)
            amax = _abs_max_bits(bits[b0:b1])
            field = np.int64(amax >> _U(23)) & 0xFF
            e = min(max(field - 127 - emax, -127), 127)
            byte = e + 127
            scale[r, b0 // MX] = byte
            divisor = max(viewer(_U(_U(byte) << _U(23)), np.float32), _F32_MIN_NORMAL)
            for j in range(b0, b1):
                divisors[j] = divisor
        for j in range(k):
            vals[j] = np.float32(vals[j] / divisors[j])
        if fp4:
            for j in range(k):
                codes[j] = _e2m1(vals[j], bits[j])
            for j in range(width):
                packed[j] = np.uint8(codes[2 * j] | (codes[2 * j + 1] << 4))
            n = _store_diff(packed, out[r], ref[r], r * width, pos, old, new, n)
        else:
            for j in range(k):
                vals[j] = min(max(vals[j], -_E4M3_MAX), _E4M3_MAX)
            for j in range(k):
                codes[j] = _e4m3(bits[j])
            n = _store_diff(codes, out[r], ref[r], r * width, pos, old, new, n)
    return n, top


NV = 16  # NVFP4 block: 16 consecutive elements along K
E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()


@kernel(error_model="numpy")
def nv_rows(
    src: np.ndarray,
    ref: np.ndarray,
    out: np.ndarray,
    scale: np.ndarray,
    s2: np.float32,
    six_s2: np.float32,
    e4m3_values: np.ndarray,
    round_bf16: bool,
    pos: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
) -> tuple[int, np.uint32]:
    """Rows of fp32 bits ``src`` [R, K] -> NVFP4 (ModelOpt) codes packed two per byte ``out`` [R, K/2] and
    e4m3 block scales ``scale`` [R, ceil(K/16)] (as bytes), given the global ``s2`` and ``6 * s2`` (fp32);
    the payload's changes against ``ref``, positions from the first row. Returns (changes, max |master|)."""
    rows, k = src.shape
    width = out.shape[1]
    vals = np.empty(k, np.float32)
    bits = vals.view(np.uint32)
    divisors = np.empty(k, np.float32)  # each element's block divisor: the division then vectorizes
    codes = np.empty(k, np.uint8)
    packed = np.empty(width, np.uint8)
    n = 0
    top = _U(0)
    for r in range(rows):
        top = _load_row(src[r], bits, round_bf16, top)
        for b0 in range(0, k, NV):
            b1 = min(k, b0 + NV)
            amax = viewer(_abs_max_bits(bits[b0:b1]), np.float32)
            bs = np.float32(amax / six_s2)
            if bs == 0:
                bs = np.float32(1.0)
            bs8 = _e4m3(viewer(min(max(bs, np.float32(2.0**-9)), _E4M3_MAX), np.uint32))
            scale[r, b0 // NV] = bs8
            d = np.float32(e4m3_values[bs8] * s2)
            for j in range(b0, b1):
                divisors[j] = d
        for j in range(k):
            y = np.float32(vals[j] / divisors[j])
            codes[j] = _e2m1(y, _U(0x80000000) if y < 0 else _U(0))
        for j in range(width):
            packed[j] = np.uint8(codes[2 * j] | (codes[2 * j + 1] << 4))
        n = _store_diff(packed, out[r], ref[r], r * width, pos, old, new, n)
    return n, top


def tensor_amax(x: torch.Tensor, group_amax: torch.Tensor | None, *, from_fp32: bool) -> torch.Tensor | None:
    """The amax a per-tensor recipe starts from (0-dim fp32): the group's, or max |bf16(x)| (RNE is
    monotone, so that is bf16(max |x|): no cast of the whole tensor); None when it is not finite."""
    amax = group_amax
    if amax is None:
        # max |x| from the bit patterns (sign cleared, the order of |x|; NaN's sort above inf's): one
        # vectorized pass, no |x| tensor. ``x`` is a contiguous fp32 CPU tensor here.
        bits = _abs_max_bits(x.detach().reshape(-1).view(torch.int32).numpy().view(np.uint32))
        top = torch.tensor(int(bits), dtype=torch.int32).view(torch.float32)
        amax = top if from_fp32 else top.to(torch.bfloat16).float()
    amax = amax.float().reshape(())
    return amax if bool(torch.isfinite(amax)) else None
