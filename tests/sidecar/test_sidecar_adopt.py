"""Adopt on boot: a new sidecar reports the version its engine already holds only when the engine's recomputed
fingerprints are that published version's view; a half-written engine is resynced from a keyframe instead.

Both with the torch engine and with a tensor-parallel vLLM engine (fake workers, ``tests/engines/fake_vllm.py``)
whose commit reached one rank only, as a sidecar killed before its undo leaves it.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from flipsync.board import BoardReader, BoardWriter
from flipsync.codec import diff_views
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.base import Engine
from flipsync.engines.vllm.engine import VllmEngine
from flipsync.engines.vllm.rpc_transports import LocalTransport
from flipsync.engines.vllm.tensor_specs import specs_of
from flipsync.engines.vllm.wire import PROTOCOL
from flipsync.errors import BaseMismatchError
from flipsync.sidecar.metrics import SidecarMetrics
from flipsync.sidecar.replica import Replica, ReplicaConfig
from flipsync.stores import ObstoreStore
from tests.engines.fake_vllm import boot, checkpoint, held_view, step
from tests.sidecar.sidecar_helpers import FaultyEngine, Trainer, fast_replica, same_bits, tiny_engine


def make_replica(store: ObstoreStore, engine: Engine, config: ReplicaConfig | None = None) -> Replica:
    return Replica(BoardReader(store, "run"), engine, config=config or fast_replica(), metrics=SidecarMetrics())


def keyframes_loaded(rep: Replica) -> float:
    return rep.metrics.registry.get_sample_value("flipsync_updates_total", {"kind": "keyframe"}) or 0.0


def engine_holding(view: Mapping[str, torch.Tensor]) -> FaultyEngine:
    eng = FaultyEngine(tiny_engine())
    eng.inner.load_view({k: v.clone() for k, v in view.items()})
    return eng


def test_a_new_sidecar_adopts_the_version_its_engine_holds(store: ObstoreStore, trainer: Trainer) -> None:
    trainer.step()
    trainer.step()
    trainer.step()
    rep = make_replica(store, engine_holding(trainer.views[1]))
    assert rep.sync_once()
    st = rep.status()
    assert st["adopted"]["version"] == 1 and st["adopted"]["view_fp"] == trainer.fps[1]
    assert rep.version == 3 and keyframes_loaded(rep) == 0  # patches v1->v2->v3 only
    assert same_bits(rep.engine.inner.served, trainer.views[3])  # type: ignore[attr-defined]
    trainer.step()
    assert rep.sync_once() and rep.version == 4 and rep.status()["adopted"]["version"] == 1


def test_a_half_written_engine_is_not_adopted_but_resynced(store: ObstoreStore, trainer: Trainer) -> None:
    trainer.step()
    trainer.step()
    # v1 with one tensor already at v2: a commit cut short
    half = dict(trainer.views[1])
    name = next(n for n in half if not torch.equal(half[n], trainer.views[2][n]))
    half[name] = trainer.views[2][name]
    seen: list[int | None] = []
    rep = make_replica(store, engine_holding(half))
    original = rep._set_version

    def spy(version: int | None, view_fp: str | None) -> None:
        seen.append(version)
        original(version, view_fp)

    rep._set_version = spy  # type: ignore[method-assign]
    assert rep.sync_once()
    assert rep.status()["adopted"] is None and keyframes_loaded(rep) == 1
    assert seen == [0, 1, 2]  # reported only after the keyframe and each verified patch
    assert same_bits(rep.engine.inner.served, trainer.views[2])  # type: ignore[attr-defined]


def test_adoption_looks_back_a_bounded_number_of_versions(store: ObstoreStore, trainer: Trainer) -> None:
    for _ in range(3):
        trainer.step()
    rep = make_replica(store, engine_holding(trainer.views[1]), ReplicaConfig(adopt_search=2, poll_interval_s=0.05))
    assert rep.sync_once()
    assert rep.status()["adopted"] is None and keyframes_loaded(rep) == 1 and rep.version == 3


def test_an_engine_restarted_from_a_published_checkpoint_is_adopted(store: ObstoreStore, trainer: Trainer) -> None:
    eng = FaultyEngine(tiny_engine())
    rep = make_replica(store, eng)
    assert rep.sync_once() and keyframes_loaded(rep) == 1
    trainer.step()
    trainer.step()
    eng.dead = True
    assert not rep.sync_once()
    eng.inner.load_view({k: v.clone() for k, v in trainer.views[1].items()})  # it restarted from v1's checkpoint
    eng.dead = False
    assert rep.sync_once()
    assert rep.status()["adopted"]["version"] == 1 and keyframes_loaded(rep) == 1 and rep.version == 2


# -- vLLM: tensor-parallel workers that outlive the sidecar ------------------------------------------------------


class FakeBoard:
    """Publishes fake_vllm checkpoints: v0 = checkpoint(0), v(k+1) = step(vk, k + 1)."""

    def __init__(self, store: ObstoreStore, n: int) -> None:
        self.views = [checkpoint(0)]
        tables = [FingerprintTable.of(self.views[0])]
        pub = BoardWriter(store, "run", publisher_id="fake")
        pub.publish_snapshot(self.views[0], version=0, view_fp=tables[0].view_fp(), served_format="bf16")
        for k in range(n):
            new = step(self.views[k], k + 1)
            patch, table = diff_views(self.views[k], new, old_table=tables[k], base_version=k, target_version=k + 1)
            pub.publish_patch(
                [patch.to_bytes()],
                base_version=k,
                target_version=k + 1,
                base_view_fp=tables[k].view_fp(),
                target_view_fp=table.view_fp(),
                served_format="bf16",
            )
            self.views.append(new)
            tables.append(table)


def vllm_engine_at(view: Mapping[str, torch.Tensor], *, packed: bool = False) -> tuple[list, VllmEngine]:  # type: ignore[type-arg]
    pairs = boot(dict(view), size=2, packed=packed)
    return pairs, VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(view))


@pytest.mark.parametrize("tensors", [1, None], ids=["one-tensor", "all-of-rank-0"])
def test_a_vllm_commit_that_reached_one_rank_is_resynced_not_adopted(store: ObstoreStore, tensors: int | None) -> None:
    board = FakeBoard(store, 2)
    pairs, first = vllm_engine_at(board.views[1])
    patch, _ = diff_views(board.views[1], board.views[2], base_version=1, target_version=2)
    staged = first.stage(patch)
    writes = staged.per_rank["0"][:tensors]
    cut = {"protocol": PROTOCOL, "op": "apply", "token": "cut", "per_rank": {"0": writes}}
    cut["positions"] = staged.positions
    assert pairs[0][1].handle(cut)["ok"]
    # the sidecar died here; a new one attaches to the same workers
    engine = VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(board.views[0]))
    if tensors is None:  # the replicated tensors (norms) differ between the ranks
        assert not engine.adoptable
        with pytest.raises(BaseMismatchError):
            engine.stage(patch)
    rep = make_replica(store, engine)
    assert rep.sync_once()
    assert rep.status()["adopted"] is None and keyframes_loaded(rep) == 1 and rep.version == 2
    assert same_bits(held_view(pairs, engine), board.views[2]) and engine.adoptable


def test_a_vllm_engine_at_a_published_version_is_adopted(store: ObstoreStore) -> None:
    board = FakeBoard(store, 3)
    pairs, engine = vllm_engine_at(board.views[2])
    rep = make_replica(store, engine)
    assert rep.sync_once()
    assert rep.status()["adopted"]["version"] == 2 and keyframes_loaded(rep) == 0 and rep.version == 3
    assert same_bits(held_view(pairs, engine), board.views[3])


def test_a_vllm_engine_with_repacked_parameters_is_never_adopted(store: ObstoreStore) -> None:
    """Their host copies come from the source checkpoint at attach, not from what the kernels hold."""
    board = FakeBoard(store, 1)
    pairs, engine = vllm_engine_at(board.views[1], packed=True)
    assert not engine.adoptable
    rep = make_replica(store, engine)
    assert rep.sync_once()
    assert rep.status()["adopted"] is None and keyframes_loaded(rep) == 1 and rep.version == 1
    assert same_bits(held_view(pairs, engine), board.views[1])
