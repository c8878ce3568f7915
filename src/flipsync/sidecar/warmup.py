"""Compile (or load from numba's on-disk cache) the codec kernels a replica uses, before it reports ready.

The kernels are cached on disk (``flipsync.codec.jit.kernel``), so only the first process on a machine pays
for compilation (about 10 s on two cores); later ones load them in well under a second. Without this, a
sidecar with a cold cache paid it inside its first catch-up: it joined the fleet, then stalled ~14 s staging
its first patch while the trainer moved on, so a fleet whose replicas all started cold could have no ready
replica for 20 s or more. A small view in the served format through diff, encode, decode, apply and squash,
sparse and dense alike, runs every kernel a replica's catch-up and commits run.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from flipsync.codec import Patch, apply_patch, diff_views, squash
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.formats import served_view

log = logging.getLogger(__name__)


def small_masters(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two FP32 tensors shaped as a layer and a norm: large enough for every kernel's code path."""
    g = torch.Generator().manual_seed(seed)
    return {
        "model.layers.0.mlp.up_proj.weight": torch.randn(256, 256, generator=g) * 0.02,
        "model.norm.weight": torch.ones(256),
    }


def warm_codec_kernels(served_format: str, masters: dict[str, torch.Tensor] | None = None) -> float:
    """Run every codec kernel a replica uses once on a small view in ``served_format``; the seconds it took.

    ``masters``: the FP32 tensors to start from (default ``small_masters()``); the trainer-side warm-up of the
    demo continues from them with the publisher's fused pass.
    """
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(1)
    masters = dict(masters) if masters is not None else small_masters()
    views = [served_view(masters, served_format)]
    # a sparse step (positions coded as gaps) and a dense one (most values change), as RL steps can be
    for scale in (1e-4, 1e-2):
        masters = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in masters.items()}
        views.append(served_view(masters, served_format))
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
    took = time.perf_counter() - t0
    log.info("codec kernels for %s ready in %.2f s (compiled or loaded from the numba cache)", served_format, took)
    return took
