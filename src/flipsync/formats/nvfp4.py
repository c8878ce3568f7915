"""NVFP4 served view in NVIDIA ModelOpt checkpoint form (`modelopt_fp4`). For a master [N, K] (K even): `weight`
uint8 [N, K/2] (two e2m1 codes per byte, even element low), `weight_scale` float8_e4m3fn [N, ceil(K/16)] (block
scales), `weight_scale_2` float32 [1] (global); w = e2m1(code) * float(weight_scale) * weight_scale_2."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from flipsync.formats.base import E4M3_MAX, ServedFormat, pad_last_dim, require_2d, tensor_amax
from flipsync.formats.mx import (
    E2M1_MAX,
    e2m1_decode,
    e2m1_encode,
    pack_nibbles,
    require_even_last_dim,
    unpack_nibbles,
)

NV_BLOCK = 16
#: ModelOpt floors the block scale at the smallest e4m3 subnormal so that it never rounds to 0.
BLOCK_SCALE_FLOOR = 2.0**-9
#: Global scale of an all-zero tensor (or fused group): amax / (6 * 448) would be 0 and 0/0 = NaN.
ZERO_TENSOR_SCALE_2 = 1.0


class NvFp4Format(ServedFormat):
    """ModelOpt `NVFP4QTensor.quantize` (dynamic weight path), block 16; the recipe: docs/formats.md ("nvfp4")."""

    name: ClassVar[str] = "nvfp4"
    payload_dtype: ClassVar[torch.dtype] = torch.uint8
    scale_suffixes: ClassVar[tuple[str, ...]] = ("_scale", "_scale_2")
    uses_group_amax: ClassVar[bool] = True

    def encode(self, name: str, x: torch.Tensor, group_amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
        require_2d(self.name, name, x)
        require_even_last_dim(self.name, name, x)
        n, k = x.shape
        amax = tensor_amax(x) if group_amax is None else group_amax
        s2 = amax / (E2M1_MAX * E4M3_MAX)
        s2 = torch.where(amax == 0, torch.full_like(s2, ZERO_TENSOR_SCALE_2), s2)

        blocks = pad_last_dim(x, NV_BLOCK).view(n, -1, NV_BLOCK)
        bs = blocks.abs().amax(dim=-1) / (E2M1_MAX * s2)
        bs = torch.where(bs == 0, torch.ones_like(bs), bs)
        # bs <= 448 * (1 + 2**-22), which rounds to 448: the upper clamp never changes a byte.
        bs8 = torch.clamp(bs, min=BLOCK_SCALE_FLOOR, max=E4M3_MAX).to(torch.float8_e4m3fn)

        y = blocks / (bs8.float() * s2).unsqueeze(-1)
        codes = e2m1_encode(y.view(n, -1)[:, :k], negative_zero=False)
        return {
            name: pack_nibbles(codes).contiguous(),
            name + "_scale": bs8,
            name + "_scale_2": s2.reshape(1),
        }

    def dequantize(self, name: str, components: Mapping[str, torch.Tensor]) -> torch.Tensor:
        values = e2m1_decode(unpack_nibbles(components[name]))
        k = values.shape[1]
        block_scale = components[name + "_scale"].float() * components[name + "_scale_2"].float()
        return values * block_scale.repeat_interleave(NV_BLOCK, dim=-1)[:, :k]
