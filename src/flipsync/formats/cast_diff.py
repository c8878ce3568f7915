"""One fused pass for the element-wise served formats: cast an FP32 master and diff it against a served view.

The publisher used to cast each master (`cast_master`), then read the new view and the previous one again
to find the changed elements. `CastDiffer.cast_diff` does both in one pass over the master and the
previous view: it writes the new view (bf16 or fp16, round to nearest even, exactly torch's ``.to``) and
emits the changed flat positions with the old and new bit patterns, the same arrays the codec's diff gives.

CPU: a numba kernel works on groups of 64 lanes: one vectorized loop rounds the masters, stores them and
sets a bit of a 64-bit mask per lane that differs from the previous view; only the set bits (few at RL
learning rates) are then visited, by trailing-zero count. The quantized families below encode a row into
a code buffer and store and compare it the same way. Chunks run on a thread pool with the GIL released
(inline on one thread); each worker appends its chunks' changes to one buffer, and the caller copies them
all, in chunk order, into the result once.
Any other device (CUDA) or master dtype takes the torch path: `cast_master`, then a compare on the
tensors' device; both give the same bits.

Masters that are not finite, or values that round beyond the format's range, are not handled here: the
kernel flags them and the tensor goes through `cast_master`, which raises the formats module's error
(`NonFiniteError` / `FormatError`) word for word.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic
from numba.cpython.unsafe.numbers import trailing_zeros, viewer

from flipsync.codec import Changes
from flipsync.errors import FormatError
from flipsync.formats.base import cast_master

logger = logging.getLogger(__name__)

#: Served dtypes the CPU kernel computes (an element-wise RNE cast of an FP32 master).
FUSED_DTYPES = (torch.bfloat16, torch.float16)

CHUNK_ELEMENTS = 1 << 21  # per task: 8 MiB of masters, enough to amortise the hand-over to the pool
MIN_CHUNK_ELEMENTS = 1 << 18

# |x| bit patterns (sign cleared) from which the cast gives inf or NaN: refused by `cast_master`.
_BF16_LIMIT = 0x7F7F8000  # rounds to bf16 inf (and every inf / NaN)
_FP16_LIMIT = 0x477FF000  # 65520: rounds beyond fp16's 65504

_BF16, _FP16 = 0, 1
_FP4 = ("mxfp4", "nvfp4")  # two e2m1 codes per payload byte
_QUANTIZED = ("fp8-tensor", "fp8-channel", "fp8-block", "mxfp8", "mxfp4", "nvfp4", "int8-channel")
_GROUP = 64  # lanes whose differences make one 64-bit mask

_U = np.uint32
_Q = np.uint64


# Every step is wrapped in a uint32 cast: numba widens integer arithmetic to 64 bits, which would halve the
# lanes per vector of the block loop; truncated back at each step, LLVM keeps it in 32-bit lanes.
@numba.njit(nogil=True, cache=True, inline="always")
def _round16(u: np.uint32, kind: int) -> np.uint32:
    """fp32 bits ``u`` -> bf16 / fp16 bits, round to nearest even (finite, in-range inputs).

    Branch-free (every case computed, then selected) so that the block loop vectorizes.
    """
    if kind == _BF16:  # c10's round_to_nearest_even
        return _U(_U(_U(u + _U(0x7FFF)) + _U(_U(u >> _U(16)) & _U(1))) >> _U(16))
    sign = _U(_U(u >> _U(16)) & _U(0x8000))
    a = _U(u & _U(0x7FFFFFFF))
    # a normal fp16: rebias the exponent (127 -> 15), round the mantissa at bit 13
    an = _U(a - _U(0x38000000))
    normal = _U(_U(_U(an + _U(0xFFF)) + _U(_U(an >> _U(13)) & _U(1))) >> _U(13))
    # an fp16 subnormal: the mantissa with its hidden bit, in units of 2**-24, rounded at bit `shift`
    e = _U(a >> _U(23))
    shift = min(_U(_U(126) - e), _U(25))  # wraps for normal inputs, clamped: that result is unused
    m = _U(_U(a & _U(0x7FFFFF)) | _U(0x800000))
    half = _U(_U(_U(1) << _U(shift - _U(1))) - _U(1))
    sub = _U(_U(_U(m + half) + _U(_U(m >> shift) & _U(1))) >> shift)
    sub = sub if e >= _U(102) else _U(0)  # below 2**-25 (ties included) rounds to zero
    return _U(sign | (normal if a >= _U(0x38800000) else sub))


@numba.njit(nogil=True, cache=True, inline="always")
def _emit(
    m: np.uint64,
    base: int,
    at: int,
    ref: np.ndarray,
    out: np.ndarray,
    pos: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    n: int,
) -> int:
    """Records the lanes set in mask ``m`` (lane ``j``: element ``base + j`` of ``ref`` / ``out``, position
    ``at + base + j``) at slots ``n``...; the next free slot. The first two lanes are written
    unconditionally and counted only when present (at RL learning rates a group rarely holds more), so the
    common case takes no branch: the buffers need two spare slots. ``trailing_zeros(0)`` is 64, masked
    back into the group."""
    j = base + (trailing_zeros(m) & _Q(63))
    pos[n], old[n], new[n] = at + j, ref[j], out[j]
    n += m != 0
    m &= m - _Q(1)
    j = base + (trailing_zeros(m) & _Q(63))
    pos[n], old[n], new[n] = at + j, ref[j], out[j]
    n += m != 0
    m &= m - _Q(1)
    while m != 0:
        j = base + trailing_zeros(m)
        pos[n], old[n], new[n] = at + j, ref[j], out[j]
        n += 1
        m &= m - _Q(1)
    return n


@numba.njit(nogil=True, cache=True)
def _cast_diff(
    src: np.ndarray, ref: np.ndarray, out: np.ndarray, kind: int, pos: np.ndarray, old: np.ndarray, new: np.ndarray
) -> tuple[int, np.uint32]:
    """Cast fp32 bits ``src`` into 16-bit ``out`` and emit every lane that differs from ``ref``.

    Groups of 64 lanes: one loop casts, stores, tracks max |master| and sets a bit per lane that differs
    (LLVM vectorizes it: vector compares into mask registers), then only the set bits are visited.
    ``pos`` gets chunk-relative positions and needs ``len(src) + 2`` slots (see `_emit`).
    Returns (changes written to pos/old/new, max |master| bits: the caller checks the range).
    """
    n = 0
    top = _U(0)
    size = src.shape[0]
    full = size - size % _GROUP
    for g in range(0, full, _GROUP):
        m = _Q(0)
        for j in range(_GROUP):
            u = src[g + j]
            r = np.uint16(_round16(u, kind))
            top = max(top, _U(u & _U(0x7FFFFFFF)))
            m |= _Q(_Q(r != ref[g + j]) << _Q(j))
            out[g + j] = r
        n = _emit(m, g, 0, ref, out, pos, old, new, n)
    for i in range(full, size):
        u = src[i]
        r = np.uint16(_round16(u, kind))
        top = max(top, _U(u & _U(0x7FFFFFFF)))
        out[i] = r
        if r != ref[i]:
            pos[n], old[n], new[n] = i, ref[i], r
            n += 1
    return n, top


@intrinsic
def _f16_bits(typingctx: Any, u: Any) -> tuple[Any, Callable[..., Any]]:
    """fp32 bits -> fp16 bits by LLVM's ``fptrunc`` (x86 F16C ``vcvtps2ph``, Arm ``fcvt``: IEEE round to
    nearest even, subnormals kept), which vectorizes; `_hw_fp16` checks it against `_round16` first."""

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list[ir.Value]) -> ir.Value:
        half = builder.fptrunc(builder.bitcast(args[0], ir.FloatType()), ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))

    return types.uint16(types.uint32), codegen


@numba.njit(nogil=True, cache=True)
def _cast_diff_f16(
    src: np.ndarray, ref: np.ndarray, out: np.ndarray, pos: np.ndarray, old: np.ndarray, new: np.ndarray
) -> tuple[int, np.uint32]:
    """`_cast_diff` for fp16 with the hardware conversion (three times faster than `_round16`'s)."""
    n = 0
    top = _U(0)
    size = src.shape[0]
    full = size - size % _GROUP
    for g in range(0, full, _GROUP):
        m = _Q(0)
        for j in range(_GROUP):
            u = src[g + j]
            r = _f16_bits(u)
            top = max(top, _U(u & _U(0x7FFFFFFF)))
            m |= _Q(_Q(r != ref[g + j]) << _Q(j))
            out[g + j] = r
        n = _emit(m, g, 0, ref, out, pos, old, new, n)
    for i in range(full, size):
        u = src[i]
        r = _f16_bits(u)
        top = max(top, _U(u & _U(0x7FFFFFFF)))
        out[i] = r
        if r != ref[i]:
            pos[n], old[n], new[n] = i, ref[i], r
            n += 1
    return n, top


@functools.cache
def _hw_fp16() -> bool:
    """Whether `_cast_diff_f16` compiles here and gives `_round16`'s bits on every fp16 value, every tie
    between neighbours and one fp32 step either side (a platform without a native conversion may lack the
    runtime routine LLVM calls instead, or round otherwise): else fp16 takes the integer recipe."""
    every = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    mid = ((every[:-1].astype(np.float64) + every[1:]) / 2).astype(np.float32)
    x = np.concatenate([every, mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))])
    x = np.concatenate([x, -x, np.array([1e-40, -1e-45, 2.0**-25, 65519.0], np.float32)]).view(np.uint32)
    want = np.empty(x.size, np.uint16)
    got = np.empty(x.size, np.uint16)
    scratch = (np.empty(x.size + 2, np.int64), np.empty(x.size + 2, np.uint16), np.empty(x.size + 2, np.uint16))
    try:
        _cast_diff(x, got, want, _FP16, *scratch)
        _cast_diff_f16(x, want, got, *scratch)
    except Exception:  # numba's lowering and linking errors have no common base
        logger.info("no native fp16 conversion for the fused pass: fp16 takes the integer recipe")
        return False
    return bool(np.array_equal(got, want))


_E4M3_MAX = np.float32(448.0)
_EPS32 = np.float32(2.0**-23)  # compressed-tensors' replacement of a zero channel scale


@numba.njit(nogil=True, cache=True, inline="always")
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


@numba.njit(nogil=True, cache=True, inline="always")
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
    row) held another byte, positions from ``at``, in groups of 64 as `_cast_diff`; the next free slot."""
    size = codes.shape[0]
    full = size - size % _GROUP
    for g in range(0, full, _GROUP):
        m = _Q(0)
        for j in range(_GROUP):
            q = codes[g + j]
            m |= _Q(_Q(q != ref[g + j]) << _Q(j))
            out[g + j] = q
        n = _emit(m, g, at, ref, out, pos, old, new, n)
    for i in range(full, size):
        q = codes[i]
        out[i] = q
        if q != ref[i]:
            pos[n], old[n], new[n] = at + i, ref[i], q
            n += 1
    return n


@numba.njit(nogil=True, cache=True, inline="always")
def _load_row(src: np.ndarray, bits: np.ndarray, round_bf16: bool, top: np.uint32) -> np.uint32:
    """One row of fp32 master bits into ``bits`` (rounded to bf16 first when the recipe starts from bf16);
    the running max of |master| bits, which tells a row with a non-finite or out-of-range master."""
    if round_bf16:  # two loops, not a select per element: each vectorizes
        for j in range(src.shape[0]):
            u = src[j]
            top = max(top, _U(u & _U(0x7FFFFFFF)))
            bits[j] = _U(_round16(u, _BF16) << _U(16))
    else:
        for j in range(src.shape[0]):
            u = src[j]
            top = max(top, _U(u & _U(0x7FFFFFFF)))
            bits[j] = u
    return top


@numba.njit(nogil=True, cache=True, inline="always")
def _abs_max_bits(src: np.ndarray) -> np.uint32:
    """max |x| of fp32 bit patterns, as a bit pattern (sign cleared: the order of |x|, NaN's above inf's).
    An integer max vectorizes; a float one does not (LLVM keeps its NaN order)."""
    top = _U(0)
    for i in range(src.shape[0]):
        top = max(top, _U(src[i] & _U(0x7FFFFFFF)))
    return top


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _fp8_rows(
    src: np.ndarray,
    ref: np.ndarray,
    out: np.ndarray,
    scales: np.ndarray,
    channel: bool,
    inv: np.float32,
    round_bf16: bool,
    pos: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
) -> tuple[int, np.uint32]:
    """Rows of fp32 bits ``src`` [R, K] -> e4m3 ``out``, and the changes against ``ref`` (positions from the
    first row). ``channel``: compressed-tensors (row scale amax/448 into ``scales``, a zero one 2**-23,
    ``clamp(x / scale)``); else vLLM per-tensor (``fmax(-448, fmin(x * inv, 448))``, NaN-ignoring: 0 * inf
    gives 448). ``round_bf16``: the input is bf16(master). Returns (changes, max |master| bits)."""
    rows, k = src.shape
    vals = np.empty(k, np.float32)
    bits = vals.view(np.uint32)
    codes = np.empty(k, np.uint8)
    n = 0
    top = _U(0)
    for r in range(rows):
        top = _load_row(src[r], bits, round_bf16, top)
        if channel:
            amax = viewer(_abs_max_bits(bits), np.float32)
            scale = np.float32(amax / _E4M3_MAX)
            if scale == 0:
                scale = _EPS32
            scales[r] = scale
            for j in range(k):
                vals[j] = min(max(np.float32(vals[j] / scale), -_E4M3_MAX), _E4M3_MAX)
        else:
            for j in range(k):
                y = np.float32(vals[j] * inv)
                vals[j] = _E4M3_MAX if y != y else min(max(y, -_E4M3_MAX), _E4M3_MAX)
        for j in range(k):
            codes[j] = _e4m3(bits[j])
        n = _store_diff(codes, out[r], ref[r], r * k, pos, old, new, n)
    return n, top


_I8_HALF_RANGE = np.float32(127.5)  # compressed-tensors' symmetric int8 divisor: (127 - (-128)) / 2
_I8_MIN, _I8_MAX = np.float32(-128.0), np.float32(127.0)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _i8_rows(
    src: np.ndarray,
    ref: np.ndarray,
    out: np.ndarray,
    scales: np.ndarray,
    round_bf16: bool,
    pos: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
) -> tuple[int, np.uint32]:
    """Rows of fp32 bits ``src`` [R, K] -> int8 codes (as bytes) in ``out`` and the changes against ``ref``:
    compressed-tensors symmetric int8 (row scale amax/127.5 into ``scales``, a zero one 2**-23,
    ``rint(clamp(x / scale, -128, 127))``, round half to even). Returns (changes, max |master| bits)."""
    rows, k = src.shape
    vals = np.empty(k, np.float32)
    bits = vals.view(np.uint32)
    codes = np.empty(k, np.uint8)
    n = 0
    top = _U(0)
    for r in range(rows):
        top = _load_row(src[r], bits, round_bf16, top)
        amax = viewer(_abs_max_bits(bits), np.float32)
        scale = np.float32(amax / _I8_HALF_RANGE)
        if scale == 0:
            scale = _EPS32
        scales[r] = scale
        for j in range(k):
            y = np.rint(min(max(np.float32(vals[j] / scale), _I8_MIN), _I8_MAX))
            codes[j] = np.uint8(np.int32(y) & 0xFF)
        n = _store_diff(codes, out[r], ref[r], r * k, pos, old, new, n)
    return n, top


_TILE = 128  # fp8-block: DeepGEMM's 128x128 tiles
_TILE_AMAX_FLOOR = np.float32(1e-4)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _fp8_tile_rows(
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
            amax[t] = max(amax[t], _abs_max_bits(bits[r, t * _TILE : (t + 1) * _TILE]))
    inv = np.empty(tiles, np.float32)
    for t in range(tiles):
        s = np.float32(max(viewer(amax[t], np.float32), _TILE_AMAX_FLOOR) / _E4M3_MAX)
        sf[t] = s
        inv[t] = np.float32(np.float32(1.0) / s)
    n = 0
    for r in range(rows):
        for j in range(k):
            y = np.float32(vals[r, j] * inv[j // _TILE])
            vals[r, j] = min(max(y, -_E4M3_MAX), _E4M3_MAX)
        for j in range(k):
            codes[j] = _e4m3(bits[r, j])
        n = _store_diff(codes, out[r], ref[r], r * k, pos, old, new, n)
    return n, top


_MX = 32  # MX block: 32 consecutive elements along K
_F32_MIN_NORMAL = np.float32(2.0**-126)


@numba.njit(nogil=True, cache=True, inline="always")
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


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _mx_rows(
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
        for b0 in range(0, k, _MX):
            b1 = min(k, b0 + _MX)
            amax = _abs_max_bits(bits[b0:b1])
            field = np.int64(amax >> _U(23)) & 0xFF
            e = min(max(field - 127 - emax, -127), 127)
            byte = e + 127
            scale[r, b0 // _MX] = byte
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


_NV = 16  # NVFP4 block: 16 consecutive elements along K
_E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _nv_rows(
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
        for b0 in range(0, k, _NV):
            b1 = min(k, b0 + _NV)
            amax = viewer(_abs_max_bits(bits[b0:b1]), np.float32)
            bs = np.float32(amax / six_s2)
            if bs == 0:
                bs = np.float32(1.0)
            bs8 = _e4m3(viewer(min(max(bs, np.float32(2.0**-9)), _E4M3_MAX), np.uint32))
            scale[r, b0 // _NV] = bs8
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


@dataclass
class _Scratch:
    pos: np.ndarray  # int64, chunk-relative
    old: np.ndarray
    new: np.ndarray


@dataclass
class _Spill:
    """A worker's change buffers for one call: its chunks append their changes (``fill`` is the next free
    slot) and leave them there until the caller copies every chunk's out, in order, into the result: one
    copy into fresh memory, instead of a copy per chunk and a concatenation of those."""

    pos: np.ndarray  # int64, chunk-relative
    old: np.ndarray
    new: np.ndarray
    fill: int = 0

    @property
    def room(self) -> int:
        return int(self.pos.shape[0]) - self.fill


class _OutOfRange(Exception):
    """A chunk held a master the kernel does not cast (non-finite, or out of the format's range)."""


class CastDiffer:
    """`cast_diff` with a thread pool for the CPU kernel's chunks (one per served view's computation)."""

    def __init__(self, threads: int | None = None, *, chunk_elements: int = CHUNK_ELEMENTS) -> None:
        self.threads = max(1, threads or os.cpu_count() or 1)
        self.chunk_elements = max(_GROUP, chunk_elements)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="flipsync-fused")
        # spills between calls, per element type: at most `threads` each (calls on several threads take
        # their own), so they hold at most threads x 2 x the largest chunk's slots
        self._spares: dict[type, list[_Spill]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> CastDiffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def kernel_covers(master: torch.Tensor, dtype: torch.dtype, ref: torch.Tensor) -> bool:
        """True when the CPU kernel runs (else `cast_diff` takes the torch path, with the same result)."""
        return (
            dtype in FUSED_DTYPES
            and master.dtype == torch.float32
            and master.device.type == "cpu"
            and ref.device.type == "cpu"
            and master.is_contiguous()
            and ref.is_contiguous()
        )

    def cast_diff(
        self,
        name: str,
        master: torch.Tensor,
        dtype: torch.dtype,
        ref: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        torch_path: bool = False,
    ) -> tuple[torch.Tensor, Changes]:
        """``cast_master(name, master, dtype)`` and its changes against ``ref`` (the previous view of it).

        ``out``: where the view is written (a contiguous tensor of the result's shape and dtype on the
        master's device, not ``ref``'s memory), else a new tensor. ``torch_path`` forces the path that CUDA
        tensors take. Raises what `cast_master` raises; `FormatError` when ``ref`` is not of the same
        shape and dtype.
        """
        if tuple(ref.shape) != tuple(master.shape) or ref.dtype != dtype:
            raise FormatError(
                f"the previous view of {name!r} is {tuple(ref.shape)} {ref.dtype}, not the "
                f"{tuple(master.shape)} {dtype} its master casts to"
            )
        if torch_path or not self.kernel_covers(master, dtype, ref):
            return _torch_cast_diff(name, master, dtype, ref, out)
        if out is None or not _fits(out, master, dtype) or _overlap(out, ref):
            out = torch.empty(master.shape, dtype=dtype)
        try:
            changes = self._kernel(master, dtype, ref, out)
        except _OutOfRange:
            cast_master(name, master, dtype)  # raises the formats module's error for this master
            raise AssertionError(f"the fused cast refused {name!r}, but cast_master accepted it") from None
        return out, changes

    def quantize_diff(
        self,
        fmt: str,
        name: str,
        x: torch.Tensor,
        ref: torch.Tensor,
        group_amax: torch.Tensor | None,
        *,
        from_fp32: bool,
    ) -> tuple[dict[str, torch.Tensor], Changes] | None:
        """fp8-tensor / fp8-channel / fp8-block / mxfp8 / mxfp4 / nvfp4 / int8-channel: ``x``'s components
        (payload, scales) and the payload's changes against ``ref`` (its previous payload), or None when this
        pass does not cover the tensor (another format, not a contiguous 2-D fp32 CPU master, ``ref`` of another
        layout): quantize it as usual.

        ``x`` is the master, or the recipe's prepared input (bf16(master) as fp32: rounding it again is
        exact). Masters the recipe refuses (non-finite, bf16 overflow) return None too, so that the
        format's own path raises its error. The scale component is left to the ordinary diff.
        """
        if (
            fmt not in _QUANTIZED
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or ref.device.type != "cpu"
            or x.dim() != 2
            or x.numel() == 0
            or not x.is_contiguous()
            or tuple(ref.shape) != (x.shape[0], x.shape[1] // 2 if fmt in _FP4 else x.shape[1])
            or ref.dtype
            != (torch.uint8 if fmt in _FP4 else torch.int8 if fmt == "int8-channel" else torch.float8_e4m3fn)
            or not ref.is_contiguous()
            or (fmt in _FP4 and x.shape[1] % 2 != 0)  # the recipe refuses it
        ):
            return None
        if fmt == "fp8-block":
            return self._fp8_block(name, x, ref, from_fp32=from_fp32)
        if fmt in ("mxfp8", "mxfp4"):
            return self._mx(fmt, name, x, ref, from_fp32=from_fp32)
        if fmt == "int8-channel":
            return self._int8(name, x, ref, from_fp32=from_fp32)
        channel = fmt == "fp8-channel"
        rows, k = x.shape
        inv = np.float32(0.0)
        if not channel:
            amax = _tensor_amax(x, group_amax, from_fp32=from_fp32)
            if amax is None:
                return None
            if fmt == "nvfp4":
                return self._nvfp4(name, x, ref, amax, from_fp32=from_fp32)
            scale = amax / 448.0
            inv = np.float32((1.0 / scale).item())
        limit = 0x7F800000 if from_fp32 else _BF16_LIMIT
        src = x.detach().view(torch.int32).numpy().view(np.uint32)
        was = ref.detach().view(torch.uint8).numpy()
        q = torch.empty((rows, k), dtype=torch.float8_e4m3fn)
        dst = q.view(torch.uint8).numpy()
        scales = np.empty(rows, np.float32)

        def kernel(r0: int, r1: int, buf: _Scratch) -> tuple[int, int]:
            return _fp8_rows(  # type: ignore[no-any-return]
                src[r0:r1], was[r0:r1], dst[r0:r1], scales[r0:r1], channel, inv, not from_fp32,
                buf.pos, buf.old, buf.new,
            )  # fmt: skip

        changes = self._over_rows(rows, max(1, min(rows, -(-CHUNK_ELEMENTS // k))), k, limit, kernel)
        if changes is None:
            return None
        scale_out = torch.from_numpy(scales).reshape(rows, 1) if channel else scale.reshape(1)
        return {name: q, name + "_scale": scale_out}, changes

    def _int8(
        self, name: str, x: torch.Tensor, ref: torch.Tensor, *, from_fp32: bool
    ) -> tuple[dict[str, torch.Tensor], Changes] | None:
        """int8-channel (compressed-tensors): rows in chunks, each row's scale from its own amax."""
        rows, k = x.shape
        limit = 0x7F800000 if from_fp32 else _BF16_LIMIT
        src = x.detach().view(torch.int32).numpy().view(np.uint32)
        was = ref.detach().view(torch.uint8).numpy()
        q = torch.empty((rows, k), dtype=torch.int8)
        dst = q.view(torch.uint8).numpy()
        scales = np.empty(rows, np.float32)

        def kernel(r0: int, r1: int, buf: _Scratch) -> tuple[int, int]:
            return _i8_rows(  # type: ignore[no-any-return]
                src[r0:r1], was[r0:r1], dst[r0:r1], scales[r0:r1], not from_fp32, buf.pos, buf.old, buf.new
            )

        changes = self._over_rows(rows, max(1, min(rows, -(-CHUNK_ELEMENTS // k))), k, limit, kernel)
        if changes is None:
            return None
        return {name: q, name + "_scale": torch.from_numpy(scales).reshape(rows, 1)}, changes

    def _fp8_block(
        self, name: str, x: torch.Tensor, ref: torch.Tensor, *, from_fp32: bool
    ) -> tuple[dict[str, torch.Tensor], Changes] | None:
        """fp8-block: one row of 128x128 tiles per task (their amax needs all 128 rows first)."""
        rows, k = x.shape
        nb, kb = -(-rows // _TILE), -(-k // _TILE)
        limit = 0x7F800000 if from_fp32 else _BF16_LIMIT
        src = x.detach().view(torch.int32).numpy().view(np.uint32)
        was = ref.detach().view(torch.uint8).numpy()
        q = torch.empty((rows, k), dtype=torch.float8_e4m3fn)
        dst = q.view(torch.uint8).numpy()
        sf = np.empty((nb, kb), np.float32)

        def kernel(r0: int, r1: int, buf: _Scratch) -> tuple[int, int]:
            return _fp8_tile_rows(  # type: ignore[no-any-return]
                src[r0:r1], was[r0:r1], dst[r0:r1], sf[r0 // _TILE], not from_fp32, buf.pos, buf.old, buf.new
            )

        changes = self._over_rows(rows, _TILE, k, limit, kernel)
        if changes is None:
            return None
        return {name: q, name + "_scale_inv": torch.from_numpy(sf)}, changes

    def _mx(
        self, fmt: str, name: str, x: torch.Tensor, ref: torch.Tensor, *, from_fp32: bool
    ) -> tuple[dict[str, torch.Tensor], Changes] | None:
        """mxfp8 / mxfp4 (torchao FLOOR): rows in chunks; blocks of 32 never span rows."""
        rows, k = x.shape
        fp4 = fmt == "mxfp4"
        width = k // 2 if fp4 else k
        limit = 0x7F800000 if from_fp32 else _BF16_LIMIT
        src = x.detach().view(torch.int32).numpy().view(np.uint32)
        was = ref.detach().view(torch.uint8).numpy()
        payload = torch.empty((rows, width), dtype=torch.uint8 if fp4 else torch.float8_e4m3fn)
        dst = payload.view(torch.uint8).numpy()
        scale = torch.empty((rows, -(-k // _MX)), dtype=torch.uint8)
        sc = scale.numpy()

        def kernel(r0: int, r1: int, buf: _Scratch) -> tuple[int, int]:
            return _mx_rows(  # type: ignore[no-any-return]
                src[r0:r1], was[r0:r1], dst[r0:r1], sc[r0:r1], 2 if fp4 else 8, fp4, not from_fp32,
                buf.pos, buf.old, buf.new,
            )  # fmt: skip

        changes = self._over_rows(rows, max(1, min(rows, -(-CHUNK_ELEMENTS // k))), width, limit, kernel)
        if changes is None:
            return None
        return {name: payload, name + "_scale": scale}, changes

    def _nvfp4(
        self, name: str, x: torch.Tensor, ref: torch.Tensor, amax: torch.Tensor, *, from_fp32: bool
    ) -> tuple[dict[str, torch.Tensor], Changes] | None:
        """nvfp4 (ModelOpt): the global scale from the tensor's (or group's) amax, then rows in chunks."""
        rows, k = x.shape
        width = k // 2
        s2 = amax / (6.0 * 448.0)
        s2 = torch.where(amax == 0, torch.ones_like(s2), s2)
        if not bool(s2 > 0):  # a subnormal amax whose global scale underflows: the recipe's own path decides
            return None
        six_s2 = 6.0 * s2
        limit = 0x7F800000 if from_fp32 else _BF16_LIMIT
        src = x.detach().view(torch.int32).numpy().view(np.uint32)
        was = ref.detach().view(torch.uint8).numpy()
        payload = torch.empty((rows, width), dtype=torch.uint8)
        dst = payload.numpy()
        scale = torch.empty((rows, -(-k // _NV)), dtype=torch.uint8)
        sc = scale.numpy()
        s2_32, six_32 = np.float32(s2.item()), np.float32(six_s2.item())

        def kernel(r0: int, r1: int, buf: _Scratch) -> tuple[int, int]:
            return _nv_rows(  # type: ignore[no-any-return]
                src[r0:r1], was[r0:r1], dst[r0:r1], sc[r0:r1], s2_32, six_32, _E4M3_VALUES, not from_fp32,
                buf.pos, buf.old, buf.new,
            )  # fmt: skip

        changes = self._over_rows(rows, max(1, min(rows, -(-CHUNK_ELEMENTS // k))), width, limit, kernel)
        if changes is None:
            return None
        parts = {name: payload, name + "_scale": scale.view(torch.float8_e4m3fn), name + "_scale_2": s2.reshape(1)}
        return parts, changes

    def _over_rows(
        self, rows: int, step: int, width: int, limit: int, kernel: Callable[[int, int, _Scratch], tuple[int, int]]
    ) -> Changes | None:
        """Runs ``kernel(r0, r1, scratch) -> (changes, top master bits)`` on chunks of ``step`` rows of ``width``
        served elements on the pool; the changes of all rows, or None when a chunk held a master out of range."""
        tasks = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
        try:
            return self._gather(
                [(r0 * width, (r1 - r0) * width + 2) for r0, r1 in tasks],  # `_emit`'s two spare slots
                np.uint8,
                limit,
                lambda i, buf: kernel(*tasks[i], buf),
            )
        except _OutOfRange:
            return None

    def _gather(
        self,
        tasks: list[tuple[int, int]],
        bits: type,
        limit: int,
        kernel: Callable[[int, _Scratch], tuple[int, int]],
    ) -> Changes:
        """Runs ``kernel(i, scratch) -> (changes, top master bits)`` for each task ``(first position, slots it
        may write)`` on the pool (inline on one thread) and copies their changes, in task order, into the
        result (positions shifted by the task's first). Raises `_OutOfRange` when a task's top is ``limit`` or
        more, once every task has finished (none still writes into a spill)."""
        held: dict[int, _Spill] = {}  # this call's spill per worker thread
        taken: list[_Spill] = []

        def run(i: int) -> tuple[_Spill, int, int, int]:
            me = threading.get_ident()
            sp = held.get(me)
            if sp is None or sp.room < tasks[i][1]:
                sp = held[me] = self._take(tasks[i][1], bits)
                taken.append(sp)
            f = sp.fill
            n, top = kernel(i, _Scratch(sp.pos[f:], sp.old[f:], sp.new[f:]))
            sp.fill = f + n
            return sp, f, n, top

        try:
            if self.threads == 1 or len(tasks) == 1:  # no hand-over to the pool
                found = []
                for i in range(len(tasks)):
                    found.append(run(i))
                    if found[-1][3] >= limit:
                        raise _OutOfRange
            else:
                futures = [self._pool.submit(run, i) for i in range(len(tasks))]
                wait(futures)
                found = [f.result() for f in futures]
                if any(top >= limit for *_, top in found):
                    raise _OutOfRange
            total = sum(n for _, _, n, _ in found)
            pos, old, new = np.empty(total, np.int64), np.empty(total, bits), np.empty(total, bits)
            at = 0
            for (sp, f, n, _), (first, _) in zip(found, tasks, strict=True):
                np.add(sp.pos[f : f + n], first, out=pos[at : at + n])
                old[at : at + n] = sp.old[f : f + n]
                new[at : at + n] = sp.new[f : f + n]
                at += n
            return Changes(pos, old, new)
        finally:
            self._give(bits, taken)

    def _take(self, slots: int, bits: type) -> _Spill:
        """A spill with room for ``slots``: a spare one, else a new one of twice that (later chunks of the
        call append to it; few changes per chunk then leave room for many)."""
        with self._lock:
            spares = self._spares.get(bits, [])
            for k, sp in enumerate(spares):
                if sp.room >= slots:
                    return spares.pop(k)
        count = 2 * slots
        return _Spill(np.empty(count, np.int64), np.empty(count, bits), np.empty(count, bits))

    def _give(self, bits: type, spills: list[_Spill]) -> None:
        """Keeps the ``threads`` largest spills for the next calls (emptied); drops the others."""
        for sp in spills:
            sp.fill = 0
        with self._lock:
            spares = self._spares.setdefault(bits, [])
            spares.extend(spills)
            spares.sort(key=lambda sp: sp.room, reverse=True)
            del spares[self.threads :]

    def _kernel(self, master: torch.Tensor, dtype: torch.dtype, ref: torch.Tensor, out: torch.Tensor) -> Changes:
        numel = master.numel()
        kind, limit = (_BF16, _BF16_LIMIT) if dtype == torch.bfloat16 else (_FP16, _FP16_LIMIT)
        hw = kind == _FP16 and _hw_fp16()
        src = master.detach().reshape(-1).view(torch.int32).numpy().view(np.uint32)
        was = ref.detach().reshape(-1).view(torch.int16).numpy().view(np.uint16)
        dst = out.reshape(-1).view(torch.int16).numpy().view(np.uint16)
        chunk = min(self.chunk_elements, max(MIN_CHUNK_ELEMENTS, -(-numel // self.threads)))
        chunk += -chunk % _GROUP  # whole groups: every chunk but the last starts on one
        if numel == 0:
            empty = np.empty(0, np.uint16)
            return Changes(np.empty(0, np.int64), empty, empty)
        starts = range(0, numel, chunk)

        def run(i: int, buf: _Scratch) -> tuple[int, int]:
            s = starts[i]
            e = min(s + chunk, numel)
            if hw:
                return _cast_diff_f16(src[s:e], was[s:e], dst[s:e], buf.pos, buf.old, buf.new)  # type: ignore[no-any-return]
            return _cast_diff(src[s:e], was[s:e], dst[s:e], kind, buf.pos, buf.old, buf.new)  # type: ignore[no-any-return]

        # `_emit`'s two spare slots
        return self._gather([(s, min(chunk, numel - s) + 2) for s in starts], np.uint16, limit, run)


def _tensor_amax(x: torch.Tensor, group_amax: torch.Tensor | None, *, from_fp32: bool) -> torch.Tensor | None:
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


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _fits(out: torch.Tensor, master: torch.Tensor, dtype: torch.dtype) -> bool:
    return out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous() and out.numel() == master.numel()


def _torch_cast_diff(
    name: str, master: torch.Tensor, dtype: torch.dtype, ref: torch.Tensor, out: torch.Tensor | None
) -> tuple[torch.Tensor, Changes]:
    """The device path: `cast_master` and a compare of integer views where the tensors live."""
    if out is not None and (_overlap(out, ref) or out.device != master.device):
        out = None  # the compare below reads ref after the cast: never write the cast over it
    new = cast_master(name, master, dtype, out)
    if new is master:  # an FP32 master served as FP32: the view must not alias it
        new = new.clone()
    other = ref.detach().to(new.device).reshape(-1)
    width = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32)}
    signed, ubits = width[other.element_size()]
    a = other.view(signed)
    b = new.detach().reshape(-1).view(a.dtype)
    idx = torch.nonzero(a != b).reshape(-1)
    return new, Changes(
        idx.cpu().numpy().astype(np.int64),
        a[idx].cpu().numpy().view(ubits),
        b[idx].cpu().numpy().view(ubits),
    )
