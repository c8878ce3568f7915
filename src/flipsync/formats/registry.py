"""The served formats by name."""

from __future__ import annotations

from flipsync.errors import ConfigError
from flipsync.formats.base import ServedFormat
from flipsync.formats.floats import Bf16Format, Fp16Format
from flipsync.formats.fp8 import Fp8BlockFormat, Fp8ChannelFormat, Fp8TensorFormat
from flipsync.formats.int8 import Int8ChannelFormat
from flipsync.formats.mx import MxFp4Format, MxFp8Format
from flipsync.formats.nvfp4 import NvFp4Format

_FORMATS: dict[str, ServedFormat] = {
    fmt.name: fmt
    for fmt in (
        Bf16Format(),
        Fp16Format(),
        Fp8TensorFormat(),
        Fp8ChannelFormat(),
        Fp8BlockFormat(),
        MxFp8Format(),
        MxFp4Format(),
        NvFp4Format(),
        Int8ChannelFormat(),
    )
}

FORMAT_NAMES: tuple[str, ...] = tuple(_FORMATS)


def get_format(name: str | ServedFormat) -> ServedFormat:
    """The served format called `name` (a ServedFormat is returned as is); ConfigError for an unknown name."""
    if isinstance(name, ServedFormat):
        return name
    try:
        # names are matched case-insensitively ('BF16' as `inspect` prints it, 'fp8_block' as Python spells it)
        return _FORMATS[name.strip().lower().replace("_", "-")]
    except (KeyError, TypeError, AttributeError):
        raise ConfigError(f"unknown served format {name!r}; valid formats: {', '.join(FORMAT_NAMES)}") from None
