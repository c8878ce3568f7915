"""Served views: FP32 master tensors -> the exact checkpoint-format bytes an inference engine holds.

One module per format family (`floats`, `fp8`, `mx`, `nvfp4`), each a pinned recipe in torch ops
that gives the same bytes on CPU and CUDA; `view` applies a format to a whole state dict with
fused-group scale sharing. docs/formats.md documents every recipe.
"""

from flipsync.formats.base import ServedFormat, is_quantizable
from flipsync.formats.registry import FORMAT_NAMES, get_format
from flipsync.formats.view import checkpoint_dtypes, dequantize_view, fused_groups_auto, served_view

__all__ = [
    "FORMAT_NAMES",
    "ServedFormat",
    "checkpoint_dtypes",
    "dequantize_view",
    "fused_groups_auto",
    "get_format",
    "is_quantizable",
    "served_view",
]
