"""Compile the codec's numba kernels before the demo's clock starts.

The kernels are cached on disk (``flipsync.codec.jit.kernel``), so only the first run on a machine pays for
compilation (about 10 s on two cores); without this warm-up that first run paid it inside the first
publication, the publisher squashed the steps that piled up behind it, and the run looked nothing like the
next one. Every sidecar warms the kernels a replica uses itself (``flipsync.sidecar.warmup``, before its first
pass); this adds the publisher's fused view + diff, so the trainer's kernels are compiled too. Later runs load
them from the cache in well under a second.
"""

from __future__ import annotations

import time

import torch

from flipsync.formats import served_view
from flipsync.formats.cast_diff import CastDiffer
from flipsync.sidecar.warmup import small_masters, warm_codec_kernels
from flipsync.trainer.pieces import Fuse, Piece


def compile_codec_kernels(served_format: str) -> float:
    """Run every codec kernel once on a small view in ``served_format``; returns the seconds it took."""
    t0 = time.perf_counter()
    masters = small_masters()
    warm_codec_kernels(served_format, masters)  # diff, encode, decode, apply, squash: what islands run
    view = served_view(masters, served_format)
    # the publisher's fused pass (view and diff in one: `flipsync.formats.cast_diff`), as its feed runs it
    with CastDiffer(1) as caster:
        fuse = Fuse(caster, {k: Piece(t, 0, tuple(t.shape)) for k, t in view.items()})
        g = torch.Generator().manual_seed(2)
        stepped = {k: v + 1e-2 * torch.randn(v.shape, generator=g) for k, v in masters.items()}
        served_view(stepped, served_format, cast=fuse.hook(0), quantize=fuse.quantize)
    return time.perf_counter() - t0
