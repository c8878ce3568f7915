"""Independent numpy + ml_dtypes reference implementations of flipsync's served formats.

Written from the recipes in docs/formats.md, not from the torch code: numpy float32 arithmetic,
ml_dtypes casts (float8_e4m3fn, float4_e2m1fn, bfloat16) with an explicit clamp before each narrow
cast (ml_dtypes gives NaN on e4m3 overflow), `np.frexp` for exponents and per-tile python loops.
Every function takes float32 numpy arrays and returns {component name: numpy array}, where float
components are returned as their raw bit patterns (uint8 / uint16 / uint32) for bitwise comparison.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
E4M3_MAX = F32(448.0)


class RefOverflow(Exception):
    """The reference says the served value overflows its dtype (flipsync must raise FormatError)."""


def bits(a: np.ndarray) -> np.ndarray:
    """Raw bits of a float array as an unsigned integer array of the same width."""
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    return np.ascontiguousarray(a).view(width)


def engine_input(x: np.ndarray, from_fp32: bool) -> np.ndarray:
    if from_fp32:
        return x.astype(F32)
    b = x.astype(ml_dtypes.bfloat16)
    if np.isinf(b.astype(F32)).any():
        raise RefOverflow("bf16")
    return b.astype(F32)


def e4m3_bits(v: np.ndarray) -> np.ndarray:
    return bits(np.clip(v, -E4M3_MAX, E4M3_MAX).astype(F32).astype(ml_dtypes.float8_e4m3fn))


def e2m1_magnitude(v: np.ndarray) -> np.ndarray:
    """|v| -> e2m1 magnitude code 0..7 via ml_dtypes (RNE), saturating at 6."""
    a = np.clip(np.abs(v), 0, 6).astype(F32)
    return bits(a.astype(ml_dtypes.float4_e2m1fn)) & 0x7


def pack(codes: np.ndarray) -> np.ndarray:
    codes = codes.astype(np.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def blocks_of(x: np.ndarray, size: int) -> np.ndarray:
    """[N, K] -> [N, ceil(K/size), size], zero padded."""
    n, k = x.shape
    nb = -(-k // size)
    out = np.zeros((n, nb * size), dtype=F32)
    out[:, :k] = x
    return out.reshape(n, nb, size)


# --- formats ---------------------------------------------------------------------------------------


def ref_bf16(name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    b = x.astype(ml_dtypes.bfloat16)
    if np.isinf(b.astype(F32)).any():
        raise RefOverflow("bf16")
    return {name: bits(b)}


def ref_fp16(name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    with np.errstate(over="ignore"):
        h = x.astype(np.float16)
    if np.isinf(h).any():
        raise RefOverflow("fp16")
    return {name: bits(h)}


def ref_fp8_tensor(name: str, x: np.ndarray, amax: np.float32 | None = None) -> dict[str, np.ndarray]:
    amax = F32(np.max(np.abs(x))) if amax is None else F32(amax)
    scale = F32(amax / E4M3_MAX)
    with np.errstate(all="ignore"):
        inv = F32(1.0) / scale
        p = (x * inv).astype(F32)
    p = np.fmax(-E4M3_MAX, np.fmin(p, E4M3_MAX))  # NaN-ignoring, like CUDA fminf/fmaxf
    return {name: e4m3_bits(p), name + "_scale": bits(np.array([scale], dtype=F32))}


def ref_fp8_channel(name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    scale = (np.max(np.abs(x), axis=1, keepdims=True) / E4M3_MAX).astype(F32)
    scale[scale == 0] = np.finfo(F32).eps
    return {name: e4m3_bits((x / scale).astype(F32)), name + "_scale": bits(scale)}


def ref_int8_channel(name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    """compressed-tensors symmetric int8: scale = amax / 127.5 (bit range 255 halved), clamp, then round half
    to even (np.rint), in float32."""
    scale = (np.max(np.abs(x), axis=1, keepdims=True) / F32(127.5)).astype(F32)
    scale[scale == 0] = np.finfo(F32).eps
    q = np.rint(np.clip((x / scale).astype(F32), F32(-128.0), F32(127.0))).astype(np.int8)
    return {name: q.view(np.uint8), name + "_scale": bits(scale)}


def ref_fp8_block(name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    n, k = x.shape
    nb, kb = -(-n // 128), -(-k // 128)
    q = np.zeros((n, k), dtype=np.uint8)
    sf = np.zeros((nb, kb), dtype=F32)
    for i in range(nb):
        for j in range(kb):
            tile = x[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            amax = max(F32(np.max(np.abs(tile))), F32(1e-4))
            s = F32(amax / E4M3_MAX)
            sf[i, j] = s
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = e4m3_bits((tile * (F32(1.0) / s)).astype(F32))
    return {name: q, name + "_scale_inv": bits(sf)}


def _mx_scale(x: np.ndarray, emax_elem: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FLOOR E8M0 bytes per 32-block and the blocks divided by the scale (torchao's 2**-126 minimum)."""
    blk = blocks_of(x, 32)
    amax = np.max(np.abs(blk), axis=-1)
    _, e = np.frexp(amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2(amax)) = e - 1
    biased = np.clip(e.astype(np.int64) - 1 - emax_elem, -127, 127) + 127
    biased[amax == 0] = 0
    divisor = np.maximum(np.ldexp(F32(1.0), biased - 127).astype(F32), F32(2.0**-126))
    y = (blk / divisor[..., None]).astype(F32)
    return biased.astype(np.uint8), y, blk


def ref_mxfp8(name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    scale, y, _ = _mx_scale(x, 8)
    n, k = x.shape
    return {name: e4m3_bits(y.reshape(n, -1)[:, :k]), name + "_scale": scale}


def ref_mxfp4(name: str, x: np.ndarray) -> dict[str, np.ndarray]:
    scale, y, _ = _mx_scale(x, 2)
    n, k = x.shape
    y = y.reshape(n, -1)[:, :k]
    codes = bits(np.clip(y, -6, 6).astype(ml_dtypes.float4_e2m1fn)) & 0xF  # sign kept: -0.0 -> 0x8
    return {name: pack(codes), name + "_scale": scale}


def ref_nvfp4(name: str, x: np.ndarray, amax: np.float32 | None = None) -> dict[str, np.ndarray]:
    n, k = x.shape
    amax = F32(np.max(np.abs(x))) if amax is None else F32(amax)
    s2 = F32(1.0) if amax == 0 else F32(amax / F32(6.0 * 448.0))
    blk = blocks_of(x, 16)
    with np.errstate(all="ignore"):
        bs = (np.max(np.abs(blk), axis=-1) / (F32(6.0) * s2)).astype(F32)
        bs[bs == 0] = 1.0
        bs = np.maximum(bs, F32(2.0**-9))
        bs8 = np.clip(bs, 0, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
        d = (bs8.astype(F32) * s2).astype(F32)
        y = (blk / d[..., None]).astype(F32).reshape(n, -1)[:, :k]
        codes = e2m1_magnitude(y) | ((y < 0).astype(np.uint8) << 3)  # -0.0 -> 0x0 (ModelOpt)
    return {
        name: pack(codes),
        name + "_scale": bits(bs8),
        name + "_scale_2": bits(np.array([s2], dtype=F32)),
    }


REFERENCES = {
    "bf16": ref_bf16,
    "fp16": ref_fp16,
    "fp8-tensor": ref_fp8_tensor,
    "fp8-channel": ref_fp8_channel,
    "fp8-block": ref_fp8_block,
    "mxfp8": ref_mxfp8,
    "mxfp4": ref_mxfp4,
    "nvfp4": ref_nvfp4,
    "int8-channel": ref_int8_channel,
}


def reference(fmt: str, name: str, master: np.ndarray, *, from_fp32: bool = False) -> dict[str, np.ndarray]:
    """Reference components (as raw bits) of one quantized master; bf16/fp16 cast the master itself."""
    if fmt in ("bf16", "fp16"):
        return REFERENCES[fmt](name, master.astype(F32))
    return REFERENCES[fmt](name, engine_input(master, from_fp32))
