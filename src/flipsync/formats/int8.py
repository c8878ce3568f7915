"""INT8 served views: symmetric per-channel INT8, the compressed-tensors W8A8 weight layout (a float32
multiplier per output row: w ~= q * scale)."""

from __future__ import annotations

from typing import ClassVar

import torch

from flipsync.formats.base import ServedFormat, require_2d

#: compressed-tensors' symmetric scale divisor for 8-bit ints: float(bit_range) / 2 with bit_range = 127 - (-128).
INT8_HALF_RANGE = 127.5
INT8_MIN, INT8_MAX = -128.0, 127.0

#: compressed-tensors replaces a zero scale by the eps of the scale dtype (float32 here): 2**-23.
INT8_ZERO_SCALE = torch.finfo(torch.float32).eps


class Int8ChannelFormat(ServedFormat):
    """compressed-tensors INT8 CHANNEL strategy (symmetric, static weights), float32 scales.

    A true division, clamped before rounding: docs/formats.md ("int8-channel").
    """

    name: ClassVar[str] = "int8-channel"
    payload_dtype: ClassVar[torch.dtype] = torch.int8
    scale_suffixes: ClassVar[tuple[str, ...]] = ("_scale",)

    def encode(self, name: str, x: torch.Tensor, group_amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
        require_2d(self.name, name, x)
        scale = x.abs().amax(dim=1, keepdim=True) / INT8_HALF_RANGE
        scale = torch.where(scale == 0, torch.full_like(scale, INT8_ZERO_SCALE), scale)
        q = torch.round(torch.clamp(x / scale, INT8_MIN, INT8_MAX)).to(torch.int8)
        return {name: q, name + "_scale": scale}
