"""`PublisherConfig`: the trainer publisher's tuning knobs, checked where they are made.

``Publisher(model, board, format=..., run=..., optimizer=...)`` takes what names the run and the model;
everything about how the served view is computed, where it is kept, how the background threads run and
how the board is written goes here (as ``ReplicaConfig`` does for a replica).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from flipsync.board.cadence import KeyframePolicy, SpanPolicy
from flipsync.board.signing import Signer
from flipsync.board.store import StoreOptions
from flipsync.errors import ConfigError
from flipsync.formats.view import FusedGroups
from flipsync.trainer.commit import DEFAULT_CHUNK_BYTES, check_chunk_bytes
from flipsync.trainer.pieces import KeepFn
from flipsync.trainer.staging import KeepOn


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
    """How a `Publisher` computes, keeps and publishes its views (see docs/trainer.md for each knob)."""

    # The served view (passed to the format's recipe): fused groups share one fp8 / nvfp4 scale.
    fused_groups: FusedGroups = "auto"
    from_fp32: bool = False
    # Plain casts (bf16 / fp16, and what quantized formats leave unquantized) of FP32 CPU masters, and of
    # device masters kept on the device, find their changes while they are cast (`flipsync.formats.fused`)
    # instead of in a second pass over both views; False: the separate cast and diff (same patches).
    fused_diff: bool = True
    keep: KeepFn | None = None  # which tensors are served in the format (the rest as they are)
    # Threads: background=False publishes inside step(); defer_view computes an attached step's view off-thread.
    background: bool = True
    defer_view: bool = True
    keep_on: KeepOn = "host"  # where the previous view is kept: pinned host memory or the device
    nice: int = 19
    threads: int | None = None  # None: default_threads()
    # The board.
    publisher_id: str | None = None
    signer: Signer | None = None
    keyframe_policy: KeyframePolicy | None = None
    span_policy: SpanPolicy | None = None
    spans: bool = True  # publish squashed spans
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # a part goes up in objects of about this size while it is coded
    # Code changed positions against the previous view (codec ``ctx``, version 2 patches, ~25% smaller at lr 1e-6)
    # where a rank holds the whole tensor on the host. Off by default: the vLLM engine cannot stage such patches.
    context: bool = False
    store_options: StoreOptions | None = None  # when ``board`` is a URL
    max_store_failures: int = 3  # transient failed publications in a row before the publisher stops
    timeout_s: float = 300.0  # bound on every exchange between ranks
    meta: Mapping[str, str | int] = field(default_factory=dict)  # extra manifest metadata of the first version

    def __post_init__(self) -> None:
        if self.max_store_failures < 1:
            raise ConfigError("max_store_failures must be at least 1")
        check_chunk_bytes(self.chunk_bytes)  # here, not at the first publication on the worker
        if self.context and self.keep_on != "host":
            raise ConfigError(
                "context=True codes positions against the previous view, which must then be kept on the host: "
                "use keep_on='host' (the default), or context=False"
            )

    @property
    def pool_threads(self) -> int:
        """The background pools' thread count: ``threads``, or half of this rank's share of the cores."""
        return self.threads or default_threads()
