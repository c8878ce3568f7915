"""`MemoryEngine`: an engine that is only its served view, a dict of tensors kept current by the codec (no model
runs), for benchmarks with many replicas in one process and tests of the sidecar's protocol.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from flipsync.codec import ClassIndex, Patch, StagedWrite, UndoRecord
from flipsync.codec import commit as codec_commit
from flipsync.codec import stage as codec_stage
from flipsync.codec.bits import int_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.base import Engine, Staged, Undo
from flipsync.errors import BaseMismatchError, EngineError, VerificationError


@dataclass
class MemoryStaged(Staged):
    """What `MemoryEngine.stage` prepared: the decoded writes and the view they lead to."""

    writes: list[StagedWrite]
    target_view: str


@dataclass
class MemoryUndo(Undo):
    """What `MemoryEngine.commit` wrote over: the codec's undo record."""

    record: UndoRecord


class MemoryEngine(Engine[MemoryStaged, MemoryUndo]):
    """An engine that is only its served view. ``table``: the view's fingerprints when the caller has them (16
    replicas need not hash v0 16 times). ``served_format``: refuse patches of another format (None: take any)."""

    name: ClassVar[str] = "memory"

    def __init__(
        self,
        view: Mapping[str, torch.Tensor],
        table: FingerprintTable | None = None,
        *,
        served_format: str | None = None,
    ) -> None:
        self._served = {k: v.clone() for k, v in view.items()}
        self._table = table.copy() if table is not None else FingerprintTable.of(self._served)
        self._index = ClassIndex()  # kept current with the tensors: sparse ctx sections read only their blocks
        self.served_format = served_format
        self._lock = threading.Lock()

    @property
    def table(self) -> FingerprintTable:
        return self._table

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._served

    @property
    def host_view(self) -> Mapping[str, torch.Tensor]:
        return self._served

    def load_view(self, view: Mapping[str, torch.Tensor]) -> None:
        if set(view) != set(self._served):
            raise EngineError("the view does not have this engine's tensors")
        with self._lock:
            for k, src in view.items():
                int_view(self._served[k]).copy_(int_view(src.contiguous()))
            self._table = FingerprintTable.of(self._served)
            self._index = ClassIndex()

    def stage(self, patch: Patch) -> MemoryStaged:
        fmt = patch.header.served_format
        if self.served_format is not None and fmt is not None and fmt != self.served_format:
            raise BaseMismatchError(f"the patch is for {fmt!r}, this engine serves {self.served_format!r}")
        return MemoryStaged(codec_stage(self._served, patch, self._table, index=self._index), patch.header.target.view)

    def commit(self, staged: MemoryStaged) -> MemoryUndo:
        if not isinstance(staged, MemoryStaged):
            raise EngineError(f"commit expects what MemoryEngine.stage returned, not {type(staged).__name__}")
        with self._lock:
            record = codec_commit(self._served, staged.writes, self._table, index=self._index)
            if self._table.view_fp() != staged.target_view:
                record.rollback(self._served, self._table)
                raise VerificationError("after the commit the engine does not hold the patch's target; rolled back")
        return MemoryUndo(record)

    def rollback(self, undo: MemoryUndo) -> None:
        if not isinstance(undo, MemoryUndo):
            raise EngineError(f"rollback expects what MemoryEngine.commit returned, not {type(undo).__name__}")
        with self._lock:
            undo.record.rollback(self._served, self._table)

    def recompute_table(self) -> FingerprintTable:
        with self._lock:
            return FingerprintTable.of(self._served)
