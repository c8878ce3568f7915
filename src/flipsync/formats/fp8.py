"""FP8 E4M3 served views: per-tensor (vLLM dynamic), per-channel (compressed-tensors), 128x128 blocks (DeepGEMM).
Scales are float32 multipliers (w ~= q * scale). Every recipe clamps to +/-448 before the cast, so the bytes do
not depend on whether the torch version saturates e4m3 casts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from flipsync.formats.base import E4M3_MAX, ServedFormat, require_2d, tensor_amax

E4M3 = torch.float8_e4m3fn

#: compressed-tensors replaces a zero scale by the eps of the scale dtype (float32 here): 2**-23.
CHANNEL_ZERO_SCALE = torch.finfo(torch.float32).eps

#: DeepGEMM `per_block_cast_to_fp8` floors each 128x128 tile amax at 1e-4 (as float32).
BLOCK = 128
BLOCK_AMAX_FLOOR = 1e-4


class Fp8TensorFormat(ServedFormat):
    """vLLM `scaled_fp8_quant(weight, scale=None)` (dynamic per-tensor), emulated in torch ops.

    The recipe, and why an all-zero tensor gives every byte 0x7E: docs/formats.md ("fp8-tensor").
    """

    name: ClassVar[str] = "fp8-tensor"
    payload_dtype: ClassVar[torch.dtype] = E4M3
    scale_suffixes: ClassVar[tuple[str, ...]] = ("_scale",)
    uses_group_amax: ClassVar[bool] = True

    def encode(self, name: str, x: torch.Tensor, group_amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
        require_2d(self.name, name, x)
        amax = tensor_amax(x) if group_amax is None else group_amax
        scale = amax / E4M3_MAX
        inv = 1.0 / scale  # torch: scale.reciprocal(), IEEE 1/x; inf when scale == 0
        limit = torch.tensor(E4M3_MAX, dtype=torch.float32, device=x.device)
        q = torch.fmax(-limit, torch.fmin(x * inv, limit)).to(E4M3)
        return {name: q, name + "_scale": scale.reshape(1)}


class Fp8ChannelFormat(ServedFormat):
    """compressed-tensors FP8 CHANNEL strategy (symmetric, static weights), float32 scales.

    A true division, not a reciprocal multiply: docs/formats.md ("fp8-channel").
    """

    name: ClassVar[str] = "fp8-channel"
    payload_dtype: ClassVar[torch.dtype] = E4M3
    scale_suffixes: ClassVar[tuple[str, ...]] = ("_scale",)

    def encode(self, name: str, x: torch.Tensor, group_amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
        require_2d(self.name, name, x)
        scale = x.abs().amax(dim=1, keepdim=True) / E4M3_MAX
        scale = torch.where(scale == 0, torch.full_like(scale, CHANNEL_ZERO_SCALE), scale)
        q = torch.clamp(x / scale, -E4M3_MAX, E4M3_MAX).to(E4M3)
        return {name: q, name + "_scale": scale}


class Fp8BlockFormat(ServedFormat):
    """DeepGEMM / vLLM `per_block_cast_to_fp8(x, use_ue8m0=False)`: 128x128 tiles, DeepSeek-V3 layout.

    `weight_scale_inv` holds sf (a multiplier, despite its name); the recipe: docs/formats.md ("fp8-block").
    """

    name: ClassVar[str] = "fp8-block"
    payload_dtype: ClassVar[torch.dtype] = E4M3
    scale_suffixes: ClassVar[tuple[str, ...]] = ("_scale_inv",)

    def encode(self, name: str, x: torch.Tensor, group_amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
        require_2d(self.name, name, x)
        n, k = x.shape
        nb, kb = -(-n // BLOCK), -(-k // BLOCK)
        padded = torch.zeros((nb * BLOCK, kb * BLOCK), dtype=torch.float32, device=x.device)
        padded[:n, :k] = x
        tiles = padded.view(nb, BLOCK, kb, BLOCK)
        amax = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=BLOCK_AMAX_FLOOR)
        sf = amax / E4M3_MAX
        # x * (1/sf) <= 448 * (1 + 2**-22), which rounds to 448: the clamp never changes a byte, it only
        # makes the result independent of the torch version's e4m3 overflow behaviour.
        scaled = torch.clamp(tiles * (1.0 / sf), -E4M3_MAX, E4M3_MAX)
        q = scaled.to(E4M3).view(nb * BLOCK, kb * BLOCK)[:n, :k].contiguous()
        return {name: q, name + "_scale_inv": sf.view(nb, kb)}

    def dequantize(self, name: str, components: Mapping[str, torch.Tensor]) -> torch.Tensor:
        q = components[name]
        n, k = q.shape
        sf = components[name + "_scale_inv"].float()
        full = sf.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:n, :k]
        return q.float() * full
