"""The trainer side: publish a model's served view to a board after every optimizer step (docs/trainer.md).

``Publisher`` (with ``PublisherConfig``), ``MultiFormatPublisher`` (a run per format), ``watch`` (checkpoints).
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
