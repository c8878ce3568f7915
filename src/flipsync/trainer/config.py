"""`PublisherConfig`: the trainer publisher's tuning knobs, checked where they are made.

``Publisher(model, board, format=..., run=..., optimizer=...)`` takes what names the run and the model;
everything about how the served view is computed, where it is kept, how the background threads run and
how the board is written goes here (as ``ReplicaConfig`` does for a replica).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from flipsync.board.cadence import KeyframePolicy, SpanPolicy
from flipsync.board.signing import Signer
from flipsync.errors import ConfigError
from flipsync.formats.view import FusedGroups
from flipsync.stores import StoreOptions
from flipsync.trainer.pieces import KeepFn
from flipsync.trainer.staging import KeepOn
from flipsync.trainer.upload import DEFAULT_CHUNK_BYTES, check_chunk_bytes


def default_threads() -> int:
    """Threads for the background diff and hash pools: half of this rank's share of the cores, leaving the
    rest to training. Ranks on one node (torchrun's ``LOCAL_WORLD_SIZE``) share its cores."""
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return max(1, (os.cpu_count() or 2) // local_ranks // 2)


@dataclass(frozen=True)
class PublisherConfig:
    """How a `Publisher` computes, keeps and publishes its views (docs/trainer.md has each knob). The defaults
    suit one process or torchrun ranks publishing to an object store; each comment says when to change one."""

    # The served view. fused_groups: tensors sharing one fp8 / nvfp4 scale ("auto": q/k/v and gate/up, as the
    # engines fuse them); from_fp32: quantize the FP32 master instead of bf16(master), when the engine's own
    # loader does; keep: which tensors the format quantizes (default: matrices), when the engine keeps others;
    # dtypes: tensors served in another plain dtype than the format gives them, where the checkpoint and its
    # engine keep them so (FP32 norms, biases and router weights beside BF16 weights;
    # `flipsync.formats.checkpoint_dtypes` derives them from a checkpoint's headers).
    fused_groups: FusedGroups = "auto"
    from_fp32: bool = False
    keep: KeepFn | None = None
    dtypes: Mapping[str, torch.dtype] | None = None
    # Off the training thread (background=False: publish inside step(), e.g. to debug); keep_on="device": keep
    # the previous view on the GPU when host memory is short (then no context coding); nice / threads: the
    # background threads' priority and count (default: half of this rank's cores), for a busy host.
    background: bool = True
    # squash=False: publish every step, the training step waiting when publishing falls a step behind, so that
    # runs published side by side (`MultiFormatPublisher`) keep one version number per trainer step.
    squash: bool = True
    keep_on: KeepOn = "host"
    nice: int = 19
    threads: int | None = None
    # The board. publisher_id: the name manifests carry (default: host and pid); signer: sign manifests for
    # replicas that verify them; keyframe_policy / span_policy: how often full keyframes and squashed spans are
    # published (catch-up cost against storage); spans=False: no spans at all; chunk_bytes: the object size a
    # part is uploaded in while it is coded (raise it for a store that charges per request).
    publisher_id: str | None = None
    signer: Signer | None = None
    keyframe_policy: KeyframePolicy | None = None
    span_policy: SpanPolicy | None = None
    spans: bool = True
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    # Code changed positions against the previous view (the codec's ``ctx`` coder, ~25% smaller patches at lr
    # 1e-6) where a rank holds the whole tensor on the host. Every engine decodes them (vLLM through its host
    # mirror); turn it off for a run whose replicas cannot hold the base on the host (a vLLM sidecar with
    # mirror=none): the run's manifests record the choice, so such a sidecar refuses the run at boot.
    context: bool = True
    store_options: StoreOptions | None = None  # when ``board`` is a URL: credentials, endpoint, timeouts
    max_store_failures: int = 3  # transient failed publications in a row before the publisher stops
    timeout_s: float = 300.0  # bound on every exchange between ranks: raise it for ranks that start far apart
    meta: Mapping[str, str | int] = field(default_factory=dict)  # extra manifest metadata of the first version

    def __post_init__(self) -> None:
        if self.max_store_failures < 1:
            raise ConfigError("max_store_failures must be at least 1")
        check_chunk_bytes(self.chunk_bytes)  # here, not at the first publication on the worker

    @property
    def pool_threads(self) -> int:
        """The background pools' thread count: ``threads``, or half of this rank's share of the cores."""
        return self.threads or default_threads()
