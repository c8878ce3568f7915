"""Bitwise diff, near-entropy patches, squash, and all-or-nothing in-place apply with verification."""

from flipsync.codec.apply import ApplyResult, UndoRecord, apply_patch, check_base, commit, stage
from flipsync.codec.build import diff_views
from flipsync.codec.diff import DiffEngine
from flipsync.codec.digest import FingerprintTable, Hasher, TensorId
from flipsync.codec.patch import Patch, PatchBuilder, TensorChange
from flipsync.codec.squash import squash

__all__ = [
    "ApplyResult",
    "DiffEngine",
    "FingerprintTable",
    "Hasher",
    "Patch",
    "PatchBuilder",
    "TensorChange",
    "TensorId",
    "UndoRecord",
    "apply_patch",
    "check_base",
    "commit",
    "diff_views",
    "squash",
    "stage",
]
