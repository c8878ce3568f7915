"""The trainer side: publish a model's served view to a board after every optimizer step.

``Publisher`` wraps a torch model (single process, or one shard per rank under torch.distributed);
``watch`` / ``CheckpointPublisher`` publish Hugging Face safetensors checkpoints written by a trainer we do
not control. A replica reads a version made of several parts (one per trainer rank) with
``flipsync.board.parts.patch_from_parts``.
"""

from flipsync.trainer.group import Group, SoloGroup, TorchGroup
from flipsync.trainer.publisher import Publisher, PublisherStats, new_run_name

__all__ = [
    "Group",
    "Publisher",
    "PublisherStats",
    "SoloGroup",
    "TorchGroup",
    "new_run_name",
]
