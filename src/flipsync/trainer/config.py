"""`PublisherConfig`: the trainer publisher's tuning knobs, checked where they are made (as ``ReplicaConfig`` is
for a replica); what names the run and the model is passed to ``Publisher`` itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from flipsync.board.cadence import KeyframePolicy, SpanPolicy
from flipsync.board.part_stream import DEFAULT_CHUNK_BYTES, check_chunk_bytes
from flipsync.board.signing import Signer
from flipsync.errors import ConfigError
from flipsync.formats.view import FusedGroups
from flipsync.stores import StoreOptions
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
    """How a `Publisher` computes, keeps and publishes its views; docs/trainer.md tables each knob and when to
    change it. The defaults suit one process or torchrun ranks publishing to an object store."""

    # The served view: `flipsync.formats.served_view`'s options.
    fused_groups: FusedGroups = "auto"  # tensors that share one fp8 / nvfp4 scale ("auto": q/k/v and gate/up)
    from_fp32: bool = False  # quantize from the FP32 master (True) or from bf16(master), as engines load it
    keep: KeepFn | None = None  # which tensors the format quantizes (None: the matrices); the others stay plain
    dtypes: Mapping[str, torch.dtype] | None = None  # per-tensor served dtype where it differs from the format's
    # The background threads, and where the previous view is kept.
    background: bool = True  # publish on a thread of its own (False: inside the optimizer step)
    squash: bool = True  # False: every step is published, the training step waiting (`MultiFormatPublisher`)
    keep_on: KeepOn = "host"  # where the previous view lives between steps: "host" memory or the "device"
    nice: int = 19  # the publishing threads' niceness: training keeps the cores it needs
    threads: int | None = None  # diff, hash and code pool threads (None: half of this rank's share of the cores)
    # The board: the manifests' name and signer, the cadence, the upload.
    publisher_id: str | None = None  # the manifests' publisher (None: host and process id)
    signer: Signer | None = None  # Ed25519 key that signs every manifest (None: unsigned)
    keyframe_policy: KeyframePolicy | None = None  # when a full keyframe is also published (None: the default)
    span_policy: SpanPolicy | None = None  # which squashed spans are published for catch-up (None: the default)
    spans: bool = True  # publish squashed spans at all
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # a part is uploaded in chunks of this size while it is coded
    # Code changed positions against the previous view (the codec's ``ctx`` coder) where a rank holds the whole
    # tensor on the host; the manifests record it, so a replica that cannot hold the base refuses the run at boot.
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
