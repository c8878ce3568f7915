"""bf16 and fp16 served views: a round-to-nearest-even cast of every floating master tensor."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from flipsync.formats.base import ServedFormat, cast_checked, check_master


class _CastFormat(ServedFormat):
    quantized: ClassVar[bool] = False

    def prepare(self, name: str, master: torch.Tensor, *, from_fp32: bool = False) -> torch.Tensor:
        # A plain cast always starts from the fp32 master; bf16(bf16(x)) == bf16(x) anyway.
        return check_master(name, master)

    def encode(self, name: str, x: torch.Tensor, group_amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
        return {name: cast_checked(name, x, self.payload_dtype)}

    def dequantize(self, name: str, components: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return components[name].float()


class Bf16Format(_CastFormat):
    """`master.to(torch.bfloat16)`: RNE, subnormals kept; values rounding to inf are refused."""

    name: ClassVar[str] = "bf16"
    payload_dtype: ClassVar[torch.dtype] = torch.bfloat16
    unquantized_dtype: ClassVar[torch.dtype] = torch.bfloat16


class Fp16Format(_CastFormat):
    """`master.to(torch.float16)`: RNE with gradual underflow; |x| rounding beyond 65504 is refused."""

    name: ClassVar[str] = "fp16"
    payload_dtype: ClassVar[torch.dtype] = torch.float16
    unquantized_dtype: ClassVar[torch.dtype] = torch.float16
