"""The in-memory engine: a dict of tensors kept at a board version by codec stage/commit."""

from __future__ import annotations

import pytest
import torch

from flipsync.codec import diff_views
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.memory import MemoryEngine
from flipsync.errors import BaseMismatchError, EngineError, VerificationError
from tests.strategies import same_bits


def views() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    v0 = {
        "a.weight": (torch.randn(64, 32, generator=g) * 0.02).bfloat16(),
        "b.weight": (1 + 0.05 * torch.randn(32, generator=g)).bfloat16(),
    }
    v1 = {k: v.clone() for k, v in v0.items()}
    v1["a.weight"].view(torch.int16)[::7] += 1  # one step of the order-preserving bit pattern, in some rows
    return v0, v1


def test_stage_commit_rollback_is_bitwise() -> None:
    v0, v1 = views()
    patch, t1 = diff_views(v0, v1, base_version=0, target_version=1, served_format="bf16")
    engine = MemoryEngine(v0, served_format="bf16")
    assert engine.host_view is engine.tensors  # the sidecar joins ctx-coded parts against it
    staged = engine.stage(patch)
    assert all(same_bits(engine.tensors[k], v0[k]) for k in v0)  # staging changes nothing
    undo = engine.commit(staged)
    assert engine.table.view_fp() == t1.view_fp()
    assert all(same_bits(engine.tensors[k], v1[k]) for k in v1)
    engine.rollback(undo)
    assert all(same_bits(engine.tensors[k], v0[k]) for k in v0)
    assert engine.table.view_fp() == FingerprintTable.of(v0).view_fp() == engine.recompute_table().view_fp()


def test_the_engine_holds_its_own_copy() -> None:
    v0, _ = views()
    engine = MemoryEngine(v0)
    v0["b.weight"].view(torch.int16)[0] += 1
    assert not same_bits(engine.tensors["b.weight"], v0["b.weight"])


def test_refuses_another_format_a_wrong_base_and_foreign_tokens() -> None:
    v0, v1 = views()
    patch, _ = diff_views(v0, v1, base_version=0, target_version=1, served_format="bf16")
    with pytest.raises(BaseMismatchError, match="fp16"):
        MemoryEngine(v0, served_format="fp16").stage(patch)
    with pytest.raises(BaseMismatchError):
        MemoryEngine(v1).stage(patch)  # v1 is not the patch's base
    engine = MemoryEngine(v0)
    with pytest.raises(EngineError):
        engine.commit(object())
    with pytest.raises(EngineError):
        engine.rollback(object())


def test_a_commit_that_misses_its_target_is_rolled_back() -> None:
    v0, v1 = views()
    patch, _ = diff_views(v0, v1, base_version=0, target_version=1, served_format="bf16")
    engine = MemoryEngine(v0)
    staged = engine.stage(patch)
    staged.target_view = "0" * len(staged.target_view)  # a target the writes cannot reach
    with pytest.raises(VerificationError):
        engine.commit(staged)
    assert all(same_bits(engine.tensors[k], v0[k]) for k in v0)
    assert engine.table.view_fp() == FingerprintTable.of(v0).view_fp()


def test_load_view_replaces_every_weight() -> None:
    v0, v1 = views()
    engine = MemoryEngine(v0)
    engine.load_view(v1)
    assert all(same_bits(engine.tensors[k], v1[k]) for k in v1)
    assert engine.table.view_fp() == FingerprintTable.of(v1).view_fp()
    with pytest.raises(EngineError):
        engine.load_view({"a.weight": v1["a.weight"]})
