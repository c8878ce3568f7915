"""The Engine port's defaults: an engine that implements only the required methods can be kept at a version
by a replica, which calls the optional capabilities directly (no duck typing)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from flipsync.codec import Patch, StagedWrite, UndoRecord, commit, diff_views, stage
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.base import Engine, Staged, Undo
from flipsync.engines.sglang import SglangEngine
from flipsync.engines.torch.engine import TorchEngine
from flipsync.engines.vllm.engine import VllmEngine


@dataclass
class MinimalStaged(Staged):  # does not count its changes: n_changed stays the port's None
    writes: list[StagedWrite]


@dataclass
class MinimalUndo(Undo):
    record: UndoRecord


class MinimalEngine(Engine[MinimalStaged, MinimalUndo]):
    name = "minimal"

    def __init__(self, view: Mapping[str, torch.Tensor]) -> None:
        self.tensors = {k: v.clone() for k, v in view.items()}
        self._table = FingerprintTable.of(self.tensors)

    @property
    def table(self) -> FingerprintTable:
        return self._table

    def load_view(self, view: Mapping[str, torch.Tensor]) -> None:
        self.tensors = {k: v.clone() for k, v in view.items()}
        self._table = FingerprintTable.of(self.tensors)

    def stage(self, patch: Patch) -> MinimalStaged:
        return MinimalStaged(stage(self.tensors, patch, self._table))

    def commit(self, staged: MinimalStaged) -> MinimalUndo:
        return MinimalUndo(commit(self.tensors, staged.writes, self._table))

    def rollback(self, undo: MinimalUndo) -> None:
        undo.record.rollback(self.tensors, self._table)

    def recompute_table(self) -> FingerprintTable:
        return FingerprintTable.of(self.tensors)


def test_an_engine_inherits_the_optional_capabilities() -> None:
    g = torch.Generator().manual_seed(0)
    v0 = {"w": torch.randn(8, 8, generator=g).bfloat16()}
    v1 = {"w": v0["w"].clone()}
    v1["w"].view(torch.int16)[0, :3] += 1
    engine = MinimalEngine(v0)
    assert engine.adoptable is True
    assert engine.host_view is None  # the sidecar then cannot join parts coded against their base (ctx)
    engine.label_version(engine.table.view_fp(), 0)  # a no-op, callable on any engine
    patch, _ = diff_views(v0, v1)
    staged = engine.stage(patch)
    assert staged.n_changed is None
    undo = engine.commit(staged)
    assert torch.equal(engine.tensors["w"].view(torch.int16), v1["w"].view(torch.int16))
    engine.rollback(undo)
    assert torch.equal(engine.tensors["w"].view(torch.int16), v0["w"].view(torch.int16))
    assert engine.health() and engine.close() is None


def test_engines_that_cannot_be_adopted_say_so_through_the_port() -> None:
    # SGLang's fingerprints come from its host copy, never from the server: the port's default is overridden.
    assert SglangEngine.adoptable is not Engine.adoptable and VllmEngine.adoptable is not Engine.adoptable
    assert TorchEngine.adoptable is Engine.adoptable and TorchEngine.label_version is not Engine.label_version
