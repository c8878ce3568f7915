"""The plain casts' numba kernels (bf16 / fp16 views of FP32 masters): round to nearest even, store, and emit
the lanes that differ from the previous view, 64 at a time; the quantized formats' kernels reuse both parts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core.extending import intrinsic
from numba.cpython.unsafe.numbers import trailing_zeros

from flipsync.codec.jit import kernel

BF16, FP16 = 0, 1
GROUP = 64  # lanes whose differences make one 64-bit mask

_U = np.uint32
_Q = np.uint64


# Every step is wrapped in a uint32 cast: numba widens integer arithmetic to 64 bits, which would halve the
# lanes per vector of the block loop; truncated back at each step, LLVM keeps it in 32-bit lanes.
@numba.njit(nogil=True, cache=True, inline="always")
def round16(u: np.uint32, kind: int) -> np.uint32:
    """fp32 bits ``u`` -> bf16 / fp16 bits, round to nearest even (finite, in-range inputs); branch-free (every
    case computed, then selected) so that the block loop vectorizes."""
    if kind == BF16:  # c10's round_to_nearest_even
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
def emit_lanes(
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


@kernel
def cast_diff_bits(
    src: np.ndarray, ref: np.ndarray, out: np.ndarray, kind: int, pos: np.ndarray, old: np.ndarray, new: np.ndarray
) -> tuple[int, np.uint32]:
    """Cast fp32 bits ``src`` into 16-bit ``out`` and emit every lane that differs from ``ref``: per group of 64
    lanes one loop (vectorized) casts, stores, tracks max |master| and sets a bit per differing lane, then only
    the set bits are visited. ``pos`` (chunk-relative) needs ``len(src) + 2`` slots (see `emit_lanes`).
    Returns (changes written to pos/old/new, max |master| bits: the caller checks the range)."""
    n = 0
    top = _U(0)
    size = src.shape[0]
    full = size - size % GROUP
    for g in range(0, full, GROUP):
        m = _Q(0)
        for j in range(GROUP):
            u = src[g + j]
            r = np.uint16(round16(u, kind))
            top = max(top, _U(u & _U(0x7FFFFFFF)))
            m |= _Q(_Q(r != ref[g + j]) << _Q(j))
            out[g + j] = r
        n = emit_lanes(m, g, 0, ref, out, pos, old, new, n)
    for i in range(full, size):
        u = src[i]
        r = np.uint16(round16(u, kind))
        top = max(top, _U(u & _U(0x7FFFFFFF)))
        out[i] = r
        if r != ref[i]:
            pos[n], old[n], new[n] = i, ref[i], r
            n += 1
    return n, top


@intrinsic
def _f16_bits(typingctx: Any, u: Any) -> tuple[Any, Callable[..., Any]]:
    """fp32 bits -> fp16 bits by LLVM's ``fptrunc`` (x86 F16C ``vcvtps2ph``, Arm ``fcvt``: IEEE round to
    nearest even, subnormals kept), which vectorizes; `CastDiffer` checks it against `round16` first."""

    def codegen(context: Any, builder: ir.IRBuilder, signature: Any, args: list[ir.Value]) -> ir.Value:
        half = builder.fptrunc(builder.bitcast(args[0], ir.FloatType()), ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))

    return types.uint16(types.uint32), codegen


@kernel
def cast_diff_f16(
    src: np.ndarray, ref: np.ndarray, out: np.ndarray, pos: np.ndarray, old: np.ndarray, new: np.ndarray
) -> tuple[int, np.uint32]:
    """`cast_diff_bits` for fp16 with the hardware conversion (three times faster than `round16`'s)."""
    n = 0
    top = _U(0)
    size = src.shape[0]
    full = size - size % GROUP
    for g in range(0, full, GROUP):
        m = _Q(0)
        for j in range(GROUP):
            u = src[g + j]
            r = _f16_bits(u)
            top = max(top, _U(u & _U(0x7FFFFFFF)))
            m |= _Q(_Q(r != ref[g + j]) << _Q(j))
            out[g + j] = r
        n = emit_lanes(m, g, 0, ref, out, pos, old, new, n)
    for i in range(full, size):
        u = src[i]
        r = _f16_bits(u)
        top = max(top, _U(u & _U(0x7FFFFFFF)))
        out[i] = r
        if r != ref[i]:
            pos[n], old[n], new[n] = i, ref[i], r
            n += 1
    return n, top
