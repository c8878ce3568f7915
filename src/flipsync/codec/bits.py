"""Integer views of tensors and the order-preserving key of a bit pattern: the codec never looks at float values
(+0/-0, NaN payloads are distinct patterns) and stores a change as a difference of keys (+/-1: one ulp)."""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from flipsync.codec.jit import kernel
from flipsync.errors import PatchError


@dataclass(frozen=True)
class DType:
    """How the codec sees one element type: its name in safetensors terms, width and key rule."""

    name: str  # safetensors dtype string, also used in patch headers
    torch_dtype: torch.dtype
    bits: int  # element width
    kind: str  # "float" (sign-magnitude), "int" (two's complement) or "uint"

    @property
    def uint_numpy(self) -> np.dtype:
        return np.dtype(f"<u{self.bits // 8}")

    @property
    def int_numpy(self) -> np.dtype:
        """The numpy dtype of `int_view`'s elements: signed integers of this width, bytes for 8 bits."""
        return np.dtype(np.uint8) if self.bits == 8 else np.dtype(f"<i{self.bits // 8}")


_DTYPES = [
    DType("F64", torch.float64, 64, "float"),
    DType("F32", torch.float32, 32, "float"),
    DType("F16", torch.float16, 16, "float"),
    DType("BF16", torch.bfloat16, 16, "float"),
    DType("F8_E4M3", torch.float8_e4m3fn, 8, "float"),
    DType("F8_E5M2", torch.float8_e5m2, 8, "float"),
    DType("F8_E8M0", torch.float8_e8m0fnu, 8, "uint"),  # unsigned exponent byte: order is the byte value
    DType("I64", torch.int64, 64, "int"),
    DType("I32", torch.int32, 32, "int"),
    DType("I16", torch.int16, 16, "int"),
    DType("I8", torch.int8, 8, "int"),
    DType("U8", torch.uint8, 8, "uint"),
    DType("BOOL", torch.bool, 8, "uint"),
]
_BY_NAME = {d.name: d for d in _DTYPES}
_BY_TORCH = {d.torch_dtype: d for d in _DTYPES}


def dtype_of(t: torch.Tensor) -> DType:
    try:
        return _BY_TORCH[t.dtype]
    except KeyError:
        raise PatchError(f"tensors of dtype {t.dtype} are not supported by the codec") from None


def dtype_named(name: str) -> DType:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise PatchError(f"unknown element dtype {name!r}; expected one of {sorted(_BY_NAME)}") from None


def int_view(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of the tensor's bytes (zero-copy; the tensor must be contiguous)."""
    if not t.is_contiguous():
        raise PatchError("the codec needs contiguous tensors; call .contiguous() first")
    # signed integers of the same width (torch has few unsigned ops); bytes for bool
    return t.reshape(-1).view({8: torch.uint8, 16: torch.int16, 32: torch.int32, 64: torch.int64}[dtype_of(t).bits])


def bits_numpy(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements as unsigned integers of the same width, as a numpy array (CPU tensors: zero-copy)."""
    d = dtype_of(t)
    return int_view(t).cpu().numpy().view(d.uint_numpy)


def to_key(bits: np.ndarray, d: DType) -> np.ndarray:
    """Map bit patterns (unsigned, width d.bits) to int64 keys whose order is the numeric order (floats:
    negative patterns reverse, so -0 and +0 are neighbours); 64-bit keys are kept modulo 2**64."""
    u = bits.astype(np.uint64)
    half = np.uint64(1) << np.uint64(d.bits - 1)
    if d.kind == "float":
        top = np.uint64((1 << d.bits) - 1) if d.bits < 64 else np.uint64(0xFFFFFFFFFFFFFFFF)
        key = np.where(u & half, top - u, u + half)
    elif d.kind == "int":
        key = u ^ half
    else:
        key = u
    return key.view(np.int64)


@kernel
def unzigzag_into(z: np.ndarray, out: np.ndarray) -> None:
    """out[i] = the int64 (as uint64) whose zigzag code is z[i]; one pass (unzigzag's kernel)."""
    one = np.uint64(1)
    for i in range(z.shape[0]):
        v = np.uint64(z[i])
        out[i] = (v >> one) ^ (np.uint64(0) - (v & one))


@numba.njit(inline="always")
def _order_key(u: np.uint64, half: np.uint64, top: np.uint64, kind: int) -> np.uint64:
    if kind == 0:  # sign-magnitude float: negative patterns reverse
        return top - u if u & half else u + half
    if kind == 1:  # two's complement
        return u ^ half
    return u


@kernel
def key_steps_into(old: np.ndarray, new: np.ndarray, bits: int, kind: int, out: np.ndarray) -> None:
    """out[i] = key(new[i]) - key(old[i]) mod 2**64 (kind 0 float, 1 int, 2 uint), without to_key's temporaries."""
    half = np.uint64(1) << np.uint64(bits - 1)
    top = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - bits)
    for i in range(old.shape[0]):
        out[i] = _order_key(np.uint64(new[i]), half, top, kind) - _order_key(np.uint64(old[i]), half, top, kind)


KIND_CODE = {"float": 0, "int": 1, "uint": 2}


def key_steps(old_bits: np.ndarray, new_bits: np.ndarray, d: DType) -> np.ndarray:
    """``to_key(new_bits, d) - to_key(old_bits, d)`` (int64, modulo 2**64) in one compiled pass."""
    out = np.empty(old_bits.size, dtype=np.uint64)
    old, new = np.ascontiguousarray(old_bits).reshape(-1), np.ascontiguousarray(new_bits).reshape(-1)
    key_steps_into(old, new, d.bits, KIND_CODE[d.kind], out)
    return out.view(np.int64)


def from_key(key: np.ndarray, d: DType) -> np.ndarray:
    """Inverse of :func:`to_key`; returns unsigned bit patterns of width d.bits."""
    k = key.view(np.uint64) if key.dtype == np.int64 else key.astype(np.uint64)
    half = np.uint64(1) << np.uint64(d.bits - 1)
    if d.kind == "float":
        top = np.uint64((1 << d.bits) - 1) if d.bits < 64 else np.uint64(0xFFFFFFFFFFFFFFFF)
        u = np.where(k & half, k - half, top - k)
    elif d.kind == "int":
        u = k ^ half
    else:
        u = k
    return u.astype(d.uint_numpy)


def zigzag(v: np.ndarray) -> np.ndarray:
    """Signed int64 -> unsigned: 0, -1, 1, -2, ... -> 0, 1, 2, 3, ..."""
    v = v.astype(np.int64, copy=False)
    return ((v << np.int64(1)) ^ (v >> np.int64(63))).view(np.uint64)


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of :func:`zigzag`, as int64; one compiled pass (numpy needed four, on the decode path)."""
    z = np.asarray(z)
    out = np.empty(z.size, dtype=np.uint64)
    unzigzag_into(np.ascontiguousarray(z).reshape(-1), out)
    return out.view(np.int64).reshape(z.shape)
