"""The codec, the only owner of a patch (docs/codec.md): bitwise diff, near-entropy coding, the patch file,
joining and squashing patches, all-or-nothing in-place apply. Other library packages import this module and its
vocabulary modules ``bits`` (integer views, order keys, dtypes) and ``fingerprint``, never its other submodules."""

from flipsync.codec.apply import StagedWrite, UndoRecord, apply_patch, commit, scatter, stage
from flipsync.codec.class_index import ClassIndex
from flipsync.codec.diff import Changes, DiffEngine
from flipsync.codec.encode import PatchEncoder, diff_views
from flipsync.codec.patch import Patch
from flipsync.codec.squash import join_parts, squash

__all__ = [
    "Changes",
    "ClassIndex",
    "DiffEngine",
    "Patch",
    "PatchEncoder",
    "StagedWrite",
    "UndoRecord",
    "apply_patch",
    "commit",
    "diff_views",
    "join_parts",
    "scatter",
    "squash",
    "stage",
]
