"""OCP Microscaling (MX v1.0) served views, torchao FLOOR scale mode: mxfp8 (e4m3) and mxfp4 (e2m1), and the
FP4 E2M1 encoder and nibble packing nvfp4 shares. For a master [N, K]: blocks of 32 along K (the last may be
partial); `weight_scale` uint8 [N, ceil(K/32)] holds E8M0 bytes (value 2**(b - 127))."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from flipsync.errors import FormatError
from flipsync.formats.base import E4M3_MAX, ServedFormat, pad_last_dim, require_2d

MX_BLOCK = 32
E8M0_BIAS = 127
F32_MANTISSA_BITS = 23
#: torchao divides by max(2**(b-127), 2**-126): it clamps the fp32 scale to the smallest normal.
F32_MIN_NORMAL = 2.0**-126

#: |values| of the 8 e2m1 magnitude codes 0..7; code = sign * 8 + index.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


def e2m1_encode(y: torch.Tensor, *, negative_zero: bool) -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8 in 0..15): round to nearest, ties to even, saturating at +/-6. The magnitude
    counts the thresholds |y| passes: strict `>` where the lower neighbour's code is even (0.25, 1.25, 2.5, 5),
    `>=` where the upper one's is (0.75, 1.75, 3.5), which is exactly RNE; a NaN passes none. The sign bit is
    `signbit(y)` with `negative_zero` (torchao / OCP: -0.0 -> 0x8), else `y < 0` (ModelOpt: -0.0 -> 0x0)."""
    a = y.abs()
    idx = (a > 0.25).to(torch.uint8)
    idx += a >= 0.75
    idx += a > 1.25
    idx += a >= 1.75
    idx += a > 2.5
    idx += a >= 3.5
    idx += a > 5.0
    sign = torch.signbit(y) if negative_zero else y < 0
    return idx | (sign.to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) -> float32 values (code 0x8 -> -0.0)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    return table.to(codes.device)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] 4-bit codes (K even) -> [..., K/2] uint8; element 2i in the low nibble, 2i+1 in the high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_nibbles`: [..., K/2] uint8 -> [..., K] codes."""
    pairs = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def require_even_last_dim(fmt: str, name: str, x: torch.Tensor) -> None:
    if x.shape[-1] % 2:
        raise FormatError(
            f"format {fmt!r} packs two fp4 values per byte along the last dim, but {name!r} has shape "
            f"{list(x.shape)} (odd last dim); pad it to an even size or keep it unquantized (keep=...)"
        )


def e8m0_floor(amax: torch.Tensor, emax_elem: int) -> torch.Tensor:
    """Biased E8M0 scale byte by the OCP FLOOR rule, as torchao computes it (uint8): e = (exponent field of amax)
    - 127 - emax_elem, clamped to [-127, 127]; byte = e + 127. From the fp32 bits, so an fp32-subnormal or zero
    amax counts as 2**-127 and gives byte 0 (torchao's all-zero-block byte). amax must be finite and >= 0."""
    field = torch.bitwise_right_shift(amax.contiguous().view(torch.int32), F32_MANTISSA_BITS) & 0xFF
    unbiased = torch.clamp(field - E8M0_BIAS - emax_elem, min=-E8M0_BIAS, max=E8M0_BIAS)
    return (unbiased + E8M0_BIAS).to(torch.uint8)


def e8m0_value(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> float32 2**(b - 127) exactly (byte 0 -> 2**-127, an fp32 subnormal; 255 -> NaN)."""
    bits = torch.bitwise_left_shift(scale.to(torch.int32), F32_MANTISSA_BITS).view(torch.float32)
    value = torch.where(scale == 0, torch.full_like(bits, 2.0**-127), bits)
    return torch.where(scale == 255, torch.full_like(bits, float("nan")), value)


def _mx_blocks(x: torch.Tensor, emax_elem: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled elements y = x / 2**e per 32-block (zero-padded to whole blocks) and the E8M0 bytes."""
    n = x.shape[0]
    blocks = pad_last_dim(x, MX_BLOCK).view(n, -1, MX_BLOCK)
    scale = e8m0_floor(blocks.abs().amax(dim=-1), emax_elem)
    # torchao: divide by the fp32 value of the scale clamped to the smallest normal (exact: a power of 2).
    divisor = torch.clamp(e8m0_value(scale), min=F32_MIN_NORMAL)
    return (blocks / divisor.unsqueeze(-1)).view(n, -1), scale


def _expand_blocks(values: torch.Tensor, k: int, block: int) -> torch.Tensor:
    return values.repeat_interleave(block, dim=-1)[..., :k]


class MxFp8Format(ServedFormat):
    """MXFP8: e4m3 elements, FLOOR scale with emax_elem = 8; y clamped to +/-448 (FLOOR lets |y| near 512)."""

    name: ClassVar[str] = "mxfp8"
    payload_dtype: ClassVar[torch.dtype] = torch.float8_e4m3fn
    scale_suffixes: ClassVar[tuple[str, ...]] = ("_scale",)

    def encode(self, name: str, x: torch.Tensor, group_amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
        require_2d(self.name, name, x)
        k = x.shape[1]
        y, scale = _mx_blocks(x, emax_elem=8)
        q = torch.clamp(y[:, :k], -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous()
        return {name: q, name + "_scale": scale}

    def dequantize(self, name: str, components: Mapping[str, torch.Tensor]) -> torch.Tensor:
        q = components[name]
        scale = e8m0_value(components[name + "_scale"])
        return q.float() * _expand_blocks(scale, q.shape[1], MX_BLOCK)


class MxFp4Format(ServedFormat):
    """MXFP4: e2m1 elements, FLOOR scale with emax_elem = 2, RNE saturating at 6; -0.0 -> code 0x8."""

    name: ClassVar[str] = "mxfp4"
    payload_dtype: ClassVar[torch.dtype] = torch.uint8
    scale_suffixes: ClassVar[tuple[str, ...]] = ("_scale",)

    def encode(self, name: str, x: torch.Tensor, group_amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
        require_2d(self.name, name, x)
        require_even_last_dim(self.name, name, x)
        k = x.shape[1]
        y, scale = _mx_blocks(x, emax_elem=2)
        codes = e2m1_encode(y[:, :k], negative_zero=True)
        return {name: pack_nibbles(codes).contiguous(), name + "_scale": scale}

    def dequantize(self, name: str, components: Mapping[str, torch.Tensor]) -> torch.Tensor:
        values = e2m1_decode(unpack_nibbles(components[name]))
        scale = e8m0_value(components[name + "_scale"])
        return values * _expand_blocks(scale, values.shape[1], MX_BLOCK)
