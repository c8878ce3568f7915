"""The Engine port: what the sidecar needs from an inference engine to keep it at a board version.

The sidecar owns the protocol (which version, when to pause, whether to roll back); an engine owns the
weights. Patches are defined on checkpoint-format served tensors, so every engine speaks in checkpoint
names and checkpoint coordinates; an engine whose runtime layout differs (fused, sharded or repacked
parameters) maps them itself.

Lifecycle of one update, all driven by the sidecar:
    staged = engine.stage(patch)        # while serving: decode, validate, prepare buffers; no weight changes
    (sidecar gates new requests and pauses or drains in-flight ones)
    undo = engine.commit(staged)        # in place; raises => the engine holds exactly what it held before
    (sidecar checks engine.table.view_fp() == patch target, resumes; on any later failure:)
    engine.rollback(undo)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from flipsync.codec import FingerprintTable, Patch


class Engine(ABC):
    """An inference engine whose served weights a sidecar keeps bitwise at a board version."""

    name: ClassVar[str]

    @property
    @abstractmethod
    def table(self) -> FingerprintTable:
        """Fingerprints of the served view the engine holds now, kept current in O(changed) by commits."""

    @abstractmethod
    def load_view(self, view: Mapping[str, torch.Tensor]) -> None:
        """Replace every weight with a full served view (boot, or resync from a keyframe).

        On return ``table`` describes ``view``; on failure the engine must not serve (the sidecar marks it
        unhealthy and retries)."""

    @abstractmethod
    def stage(self, patch: Patch) -> Any:
        """Decode and prepare ``patch`` against the current weights without changing them.

        Raises a ``flipsync`` error (``BaseMismatchError``, ``CorruptPatchError``, ``VerificationError``)
        when the patch does not apply to what the engine holds."""

    @abstractmethod
    def commit(self, staged: Any) -> Any:
        """Write the staged changes in place and return an undo token; all or nothing."""

    @abstractmethod
    def rollback(self, undo: Any) -> None:
        """Restore the weights (and ``table``) to what they were before the commit that made ``undo``."""

    @abstractmethod
    def recompute_table(self) -> FingerprintTable:
        """Fingerprints recomputed from the weights actually held (O(size)); for audits after faults."""

    def health(self) -> bool:
        """False when the engine cannot serve (crashed, unreachable)."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook, most engines hold nothing to release
        """Release the engine's resources."""
