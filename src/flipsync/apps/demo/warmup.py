"""Compile the codec's numba kernels before the demo's clock starts.

The kernels are cached on disk (``flipsync.codec.jit.kernel``), so only the first run on a machine pays for
compilation (about 10 s on two cores); without this warm-up that first run paid it inside the first
publication, the publisher squashed the steps that piled up behind it, and the run looked nothing like the
next one. A small fused view + diff, encode, decode, apply and squash in the served format exercises every
kernel the publisher and the islands use (sparse and dense change paths alike); later runs load them from
the cache in well under a second.
"""

from __future__ import annotations

import itertools
import time

import torch

from flipsync.codec import Patch, apply_patch, diff_views, squash
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.formats import served_view
from flipsync.formats.cast_diff import CastDiffer
from flipsync.trainer.pieces import Fuse, Piece


def compile_codec_kernels(served_format: str) -> float:
    """Run every codec kernel once on a small view in ``served_format``; returns the seconds it took."""
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    masters = {
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 256, generator=g) * 0.02,
        "model.norm.weight": torch.ones(256),
    }
    views = [served_view(masters, served_format)]
    # a sparse step (positions coded as gaps) and a dense one (most values change), as RL steps can be
    for scale in (1e-4, 1e-2):
        masters = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in masters.items()}
        views.append(served_view(masters, served_format))
    # the publisher's fused pass (view and diff in one: `flipsync.formats.cast_diff`), as its feed runs it
    with CastDiffer(1) as caster:
        fuse = Fuse(caster, {k: Piece(t, 0, tuple(t.shape)) for k, t in views[-1].items()})
        served_view(masters, served_format, cast=fuse.hook(0), quantize=fuse.quantize)
    # version 1 coders (what the trainer's publisher writes) and the ctx coder (what `flipsync diff` may pick)
    for context in (False, True):
        patches: list[Patch] = []
        table = FingerprintTable.of(views[0])
        for old, new in itertools.pairwise(views):
            patch, table = diff_views(old, new, old_table=table, served_format=served_format, context=context)
            patches.append(Patch.from_bytes(patch.to_bytes()))
        replica = {k: v.clone() for k, v in views[0].items()}
        held = FingerprintTable.of(replica)
        for patch in patches:
            apply_patch(replica, patch, held)
        merged = squash(patches, base=views[0])
        apply_patch({k: v.clone() for k, v in views[0].items()}, merged, FingerprintTable.of(views[0]))
    return time.perf_counter() - t0
