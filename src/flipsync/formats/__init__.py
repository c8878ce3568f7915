"""Served views: FP32 master tensors -> the exact checkpoint-format bytes an inference engine holds. One module
per format family, each a pinned recipe in torch ops (docs/formats.md); `view` applies one to a state dict."""

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
