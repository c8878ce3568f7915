"""The trainer side: publish a model's served view to a board after every optimizer step.

``Publisher`` wraps a torch model (single process, or one shard per rank under torch.distributed), tuned by a
``PublisherConfig``; ``MultiFormatPublisher`` publishes several served formats, a run each;
``watch`` / ``CheckpointPublisher`` publish Hugging Face safetensors checkpoints written by a trainer we do
not control. A replica joins a version made of several parts (one per trainer rank) with
``flipsync.codec.join_parts``.
"""

from flipsync.trainer.config import PublisherConfig
from flipsync.trainer.multi_format import MultiFormatPublisher
from flipsync.trainer.publisher import Publisher, PublisherStats
from flipsync.trainer.rank_group import RankGroup, SoloGroup, TorchGroup
from flipsync.trainer.startup import new_run_name

__all__ = [
    "MultiFormatPublisher",
    "Publisher",
    "PublisherConfig",
    "PublisherStats",
    "RankGroup",
    "SoloGroup",
    "TorchGroup",
    "new_run_name",
]
