"""The multi-rank protocol in one process: ranks are threads with barrier-based collectives.

Each rank's Publisher sees its own partition of one model (pipeline-style) or the whole model (DDP-style);
each uploads its own part of every version and rank 0 commits the manifest. The two-process gloo tests
(test_trainer_distributed.py) run the same protocol over torch.distributed with FSDP2.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_helpers import (
    RefusingStore,
    Replica,
    ThreadRanks,
    adam,
    assert_bitwise,
    expected_view,
    follow_and_check,
    run_threads,
    tiny_llama,
    train,
    versions_are_whole,
)

from flipsync.board import KeyframePolicy, KeyframeStep, open_store
from flipsync.board.catalog import Catalog
from flipsync.board.reader import join_step
from flipsync.codec import Patch
from flipsync.domain.manifest import Kind
from flipsync.engines.torch.engine import TorchEngine
from flipsync.errors import BoardError, NonFiniteError, PatchError
from flipsync.trainer import Publisher, PublisherConfig

NO_KEYFRAMES = KeyframePolicy(chain_fraction=1e9, max_interval=10_000)


def partitions(model: torch.nn.Module, world: int) -> list[Callable[[], Mapping[str, torch.Tensor]]]:
    names = list(model.state_dict())
    cut = [names[i * len(names) // world : (i + 1) * len(names) // world] for i in range(world)]
    return [lambda mine=set(c): {k: v for k, v in model.state_dict().items() if k in mine} for c in cut]


def start(sources: list[Any], store: Any, run: str, format: str = "bf16", **kw: Any) -> list[Publisher]:
    ranks = ThreadRanks(len(sources))
    stores = store if isinstance(store, list) else [store] * len(sources)
    made = run_threads(
        [
            lambda r=r: Publisher(
                sources[r],
                stores[r],
                format=format,
                run=run,
                group=ranks.group(r),
                config=PublisherConfig(keyframe_policy=NO_KEYFRAMES, **kw),
            )
            for r in range(len(sources))
        ]
    )
    for m in made:
        if isinstance(m, BaseException):
            raise m
    return made


def step_all(pubs: list[Publisher], fn: str = "step") -> list[Any]:
    return run_threads([getattr(p, fn) for p in pubs])


@pytest.mark.parametrize(("fmt", "background"), [("bf16", True), ("fp8-tensor", False)])
def test_partitioned_ranks_publish_one_version_of_several_parts(tmp_path: Path, fmt: str, background: bool) -> None:
    store = open_store(tmp_path)
    model = tiny_llama(tie=False, layers=2)
    opt = adam(model)
    pubs = start(partitions(model, 2), store, "parts", format=fmt, background=background)
    step_all(pubs, "flush")  # v0 holds the initial weights (else a busy machine may fold step 1 into it)
    for _ in range(3):
        train(model, opt, 1)
        assert step_all(pubs) == [None, None]
    assert step_all(pubs, "close") == [None, None]
    replica = follow_and_check(store, "parts", model, fmt)
    assert replica.patches and all(len(s.manifest.parts) == 2 for s in replica.patches)  # one part per rank
    assert {s.manifest.meta["ranks"] for s in replica.patches} == {2}


def test_partitioned_ranks_with_context_coding_join_their_parts_against_the_base(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama(tie=False, layers=2, hidden=64, vocab=128)
    opt = adam(model, lr=1e-5)
    pubs = start(partitions(model, 2), store, "ctxparts", background=False, context=True)
    for _ in range(3):
        train(model, opt, 1)
        step_all(pubs)
    step_all(pubs, "close")
    replica = follow_and_check(store, "ctxparts", model)  # joins each version's two parts with its tensors as the base
    parts = [Patch.from_bytes(p) for s in replica.patches for p in s.parts]
    assert len(parts) == 2 * len(replica.patches) and any(p.needs_base for p in parts)
    # rank 0 squashed spans from every rank's part, re-coded without ctx: a new replica catches up by them
    assert (0, 2) in Catalog(store, "ctxparts").list_spans()
    late = Replica(store, "ctxparts")
    late.sync(goal=0)
    late.sync(goal=2)
    assert late.steps[-1].manifest.kind is Kind.SPAN
    step = replica.patches[-1]
    with pytest.raises(PatchError, match="pass the receiver's view as base"):
        join_step(step)
    # the torch engine on CPU offers its served tensors as the base, so it joins the parts too
    engine = TorchEngine(tiny_llama(tie=False, layers=2, hidden=64, vocab=128))
    assert engine.host_view is engine.served
    first = replica.steps[0]
    assert isinstance(first, KeyframeStep)
    engine.load_view(first.tensors)
    for step in replica.patches:
        engine.commit(engine.stage(join_step(step, engine.table, engine.host_view)))
    assert_bitwise(expected_view(model, "bf16"), engine.served)


def test_replicated_ranks_split_the_tensors_and_keep_fused_groups_together(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama(tie=True, layers=2)
    opt = adam(model)
    pubs = start([model, model], store, "ddp", format="nvfp4")
    owners = pubs[0].plan.owners
    assert set(owners.values()) == {0, 1}  # both ranks serve a share
    for layer in range(2):
        p = f"model.layers.{layer}"
        assert len({owners[f"{p}.self_attn.{x}_proj.weight"] for x in "qkv"}) == 1  # one nvfp4 global scale
        assert owners[f"{p}.mlp.gate_proj.weight"] == owners[f"{p}.mlp.up_proj.weight"]
    for _ in range(2):
        train(model, opt, 1)
        step_all(pubs)
    step_all(pubs, "close")
    follow_and_check(store, "ddp", model, "nvfp4")


def test_a_rank_that_cannot_serve_a_step_makes_every_rank_skip_it(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama(tie=False)
    opt = adam(model)
    pubs = start(partitions(model, 2), store, "nan", background=True)
    step_all(pubs, "flush")  # v0 holds the initial weights (else a busy machine may fold step 1 into it)
    train(model, opt, 1)
    step_all(pubs)
    step_all(pubs, "flush")
    w = model.lm_head.weight  # in rank 1's partition
    saved = w.detach().clone()
    with torch.no_grad():
        w[0, 0] = float("nan")
    results = step_all(pubs)
    assert results[0] is None and isinstance(results[1], NonFiniteError)
    flushed = step_all(pubs, "flush")
    assert isinstance(flushed[0], BoardError) and "rank 1: NonFiniteError" in str(flushed[0])
    with torch.no_grad():
        w.copy_(saved)
    train(model, opt, 1)
    step_all(pubs)
    assert step_all(pubs, "close") == [None, None]
    replica = follow_and_check(store, "nan", model)
    assert [s.manifest.meta["step"] for s in replica.patches] == [1, 3]  # step 2 was skipped everywhere


def test_a_rank_whose_upload_fails_holds_the_version_back_on_every_rank(tmp_path: Path) -> None:
    inner = open_store(tmp_path)
    left = [1]

    def refuse(path: str, create_only: bool, data: bytes) -> bool:
        if "patch-00001" in path and left[0]:
            left[0] -= 1
            return True
        return False

    model = tiny_llama(tie=False)
    opt = adam(model)
    pubs = start(partitions(model, 2), [inner, RefusingStore(inner, refuse)], "flaky", background=False)
    for _ in range(3):
        train(model, opt, 1)
        assert step_all(pubs) == [None, None]
    step_all(pubs, "close")
    replica = follow_and_check(inner, "flaky", model)
    assert [s.manifest.meta["steps"] for s in replica.patches] == [2, 1]
    assert versions_are_whole(inner, "flaky") == [0, 1, 2]
    assert not inner.list("runs/flaky/versions/000000000003")  # rank 0's part of the failed try was removed


def test_a_rank_that_leaves_mid_version_leaves_no_half_version(tmp_path: Path) -> None:
    inner = open_store(tmp_path)
    ranks_box: list[ThreadRanks] = []

    class Dying(RefusingStore):
        def put(self, path: str, data: bytes, *, create_only: bool = False) -> None:
            if "versions/000000000002/" in path:
                ranks_box[0].barrier.abort()  # this rank is gone
                raise SystemExit
            super().put(path, data, create_only=create_only)

    model = tiny_llama(tie=False)
    opt = adam(model)
    sources = partitions(model, 2)
    ranks = ThreadRanks(2, timeout_s=5.0)
    ranks_box.append(ranks)
    stores = [inner, Dying(inner, lambda *a: False)]
    pubs = run_threads(
        [
            lambda r=r: Publisher(
                sources[r], stores[r], run="dies", group=ranks.group(r), config=PublisherConfig(background=False)
            )
            for r in (0, 1)
        ]
    )
    train(model, opt, 1)
    assert step_all(pubs) == [None, None]
    train(model, opt, 1)
    results = step_all(pubs)  # rank 1 dies while uploading its part of v2
    assert isinstance(results[0], BoardError) and "failed" in str(results[0])
    assert isinstance(results[1], SystemExit)
    for p in pubs:
        p.close()  # each rank's error was reported by its step()
    assert versions_are_whole(inner, "dies") == [0, 1]  # rank 0's part of v2 is unreferenced, v2 absent
