"""The layouts (shape, dtype) of the checkpoint tensors a vLLM engine serves, from a view or from safetensors
headers: what the sidecar attaches an engine with and checks patches and full loads against.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from flipsync.codec.bits import dtype_of


@dataclass(frozen=True)
class TensorSpec:
    """Layout of one checkpoint tensor of the served view."""

    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name, as in patch headers

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def specs_of(view: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {name: TensorSpec(tuple(t.shape), dtype_of(t).name) for name, t in view.items()}


def specs_from_checkpoint(path: str | os.PathLike[str]) -> dict[str, TensorSpec]:
    """Tensor layouts from safetensors headers only (no tensor is read)."""
    from safetensors import safe_open

    from flipsync.checkpoint import safetensors_files

    out: dict[str, TensorSpec] = {}
    for file in safetensors_files(Path(path)):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                sl = f.get_slice(name)
                out[name] = TensorSpec(tuple(sl.get_shape()), sl.get_dtype())
    return out
