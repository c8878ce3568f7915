"""The reconcile loop against a real local board: following, catching up, and every fault in the issue."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from flipsync.board import BoardReader, BoardWriter, Signer, Verifier, generate_keypair, open_store
from flipsync.board.layout import RunLayout
from flipsync.engines.base import Engine
from flipsync.sidecar.gate import CommitMode
from flipsync.sidecar.metrics import SidecarMetrics
from flipsync.sidecar.replica import Replica, State
from flipsync.stores import ObstoreStore
from tests.sidecar.sidecar_helpers import (
    FAST,
    FaultyEngine,
    FlakyStore,
    Trainer,
    fast_replica,
    same_bits,
    tiny_engine,
    wait_until,
)


def make_replica(store: object, engine: Engine | None = None, **kw: object) -> Replica:
    return Replica(
        BoardReader(store, "run", verifier=kw.pop("verifier", None)),  # type: ignore[arg-type]
        engine or tiny_engine(),
        config=fast_replica(kw.pop("mode", CommitMode.IN_PLACE)),  # type: ignore[arg-type]
        metrics=SidecarMetrics(),
    )


def metric(rep: Replica, name: str, **labels: str) -> float | None:
    return rep.metrics.registry.get_sample_value(name, labels or None)


def assert_failed(rep: Replica, kind: str, *, serving: bool = True) -> None:
    """The pass failed for ``kind``: said in status and metrics; the last verified version still serves."""
    st = rep.status()
    assert st["state"] == "error" and st["error"]["kind"] == kind, st["error"]
    assert st["serving"] is serving
    assert (metric(rep, "flipsync_failures_total", kind=kind) or 0) >= 1
    assert metric(rep, "flipsync_state", flipsync_state="error") == 1
    assert metric(rep, "flipsync_version") == (-1 if rep.version is None else rep.version)


def served(rep: Replica) -> dict:  # type: ignore[type-arg]
    eng = rep.engine
    return dict(getattr(eng, "inner", eng).served)


def test_follows_the_board_bitwise(store: ObstoreStore, trainer: Trainer, board_dir: str) -> None:
    rep = make_replica(open_store(board_dir, FAST))
    assert rep.version is None and not rep.serving
    assert rep.sync_once()
    assert rep.version == 0 and rep.serving and same_bits(served(rep), trainer.views[0])
    for _ in range(3):
        trainer.step()
    assert rep.sync_once()
    assert rep.version == 3 and same_bits(served(rep), trainer.views[3])
    st = rep.status()
    assert st["state"] == "idle" and st["head"] == 3 and st["lag"] == 0 and st["error"] is None
    last = st["last_update"]
    assert last["kind"] == "patch" and (last["base"], last["target"]) == (2, 3) and last["n_changed"] > 0
    assert last["pause_s"] >= last["commit_s"] > 0 and last["stage_s"] > 0 and last["drained"]
    assert metric(rep, "flipsync_version") == 3 and metric(rep, "flipsync_lag_versions") == 0
    assert metric(rep, "flipsync_updates_total", kind="patch") == 3
    assert metric(rep, "flipsync_updates_total", kind="keyframe") == 1
    assert metric(rep, "flipsync_fetched_bytes_total") == st["fetched_bytes"] > 0
    assert metric(rep, "flipsync_pause_seconds_count") == 4
    assert metric(rep, "flipsync_state", flipsync_state="idle") == 1


def test_a_gap_the_chain_cannot_bridge_resyncs_from_a_keyframe(store: ObstoreStore, trainer: Trainer) -> None:
    rep = make_replica(store)
    trainer.step()
    assert rep.sync_once() and rep.version == 1
    for _ in range(4):
        trainer.step()
    trainer.keyframe()
    layout = RunLayout("run")
    store.delete([layout.version_manifest(v) for v in (2, 3)])  # retention took them
    assert rep.sync_once()
    assert rep.version == 5 and same_bits(served(rep), trainer.views[5])
    assert rep.status()["last_update"]["kind"] == "keyframe"


def test_weights_changed_under_the_sidecar_resync_from_a_keyframe(store: ObstoreStore, trainer: Trainer) -> None:
    rep = make_replica(store)
    assert rep.sync_once() and rep.version == 0
    other = tiny_engine(seed=77)
    rep.engine.load_view(dict(other.served))  # someone else wrote the engine's weights
    trainer.step()
    trainer.step()
    assert rep.sync_once()  # base mismatch -> drop v0 -> keyframe v0 + chain
    assert rep.version == 2 and same_bits(served(rep), trainer.views[2])


def test_a_corrupt_patch_with_valid_hashes_is_excluded_until_a_keyframe_passes_it(
    store: ObstoreStore, trainer: Trainer
) -> None:
    rep = make_replica(store)
    trainer.step()
    assert rep.sync_once() and rep.version == 1
    trainer.step(parts=[os.urandom(3000)])  # the publisher published garbage (hashes match it)
    assert not rep.sync_once()
    st = rep.status()
    assert rep.version == 1 and same_bits(served(rep), trainer.views[1])
    assert_failed(rep, "corrupt_patch")
    assert st["excluded"] and st["excluded"][0]["target"] == 2
    fetched = st["fetched_bytes"]
    assert not rep.sync_once()  # still no way past it: not downloaded again, still says why
    assert_failed(rep, "corrupt_patch")
    assert rep.status()["fetched_bytes"] == fetched
    trainer.step()
    trainer.keyframe()  # v3: a way past the bad patch
    assert rep.sync_once()
    assert rep.version == 3 and same_bits(served(rep), trainer.views[3])
    st = rep.status()
    assert st["error"] is None and st["last_error"]["kind"] == "corrupt_patch" and st["excluded"] == []


def test_a_patch_that_does_not_match_its_manifest_is_refused(store: ObstoreStore, trainer: Trainer) -> None:
    rep = make_replica(store)
    trainer.step()
    trainer.step(parts=[trainer.patches[1]])  # a real patch, of another transition
    assert rep.sync_once() is False
    assert rep.version == 1
    assert_failed(rep, "corrupt_patch")


def test_a_damaged_part_keeps_the_last_version_until_repaired(
    store: ObstoreStore, trainer: Trainer, board_dir: str
) -> None:
    rep = make_replica(store)
    assert rep.sync_once() and rep.version == 0
    m = trainer.step()
    part = Path(board_dir) / RunLayout("run").version_dir(1) / m.parts[0].path
    good = part.read_bytes()
    part.write_bytes(good[:-1] + bytes([good[-1] ^ 0xFF]))
    assert not rep.sync_once()
    assert rep.version == 0 and same_bits(served(rep), trainer.views[0])
    assert_failed(rep, "integrity")
    part.write_bytes(good)
    assert rep.sync_once() and rep.version == 1 and same_bits(served(rep), trainer.views[1])


def test_unsigned_manifests_are_refused_with_a_verifier(store: ObstoreStore) -> None:
    private_pem, public_pem = generate_keypair()
    trainer = Trainer(store, signer=Signer.from_pem(private_pem))
    rep = make_replica(store, verifier=Verifier.from_pem(public_pem))
    trainer.step()
    assert rep.sync_once() and rep.version == 1
    signed_pub = trainer.pub
    trainer.pub = BoardWriter(store, "run", publisher_id="intruder")  # no key
    trainer.step()
    assert not rep.sync_once()
    assert rep.version == 1
    assert_failed(rep, "integrity")
    assert "signature" in rep.status()["error"]["message"] or "signed" in rep.status()["error"]["message"]
    trainer.pub = signed_pub
    signed_pub.resume()
    trainer.step()
    trainer.keyframe()  # signed: a way past the unsigned v2
    assert rep.sync_once() and rep.version == 3 and same_bits(served(rep), trainer.views[3])


def fail_one_commit(store: ObstoreStore, trainer: Trainer, fault: str, kind: str) -> tuple[Replica, FaultyEngine]:
    """Sync v0, then let the engine's ``fault`` spoil v1's commit: the replica stays at v0, failed with ``kind``."""
    eng = FaultyEngine(tiny_engine())
    rep = make_replica(store, eng)
    assert rep.sync_once()
    trainer.step()
    setattr(eng, fault, 1)
    assert not rep.sync_once()
    assert rep.version == 0
    assert_failed(rep, kind)
    assert same_bits(served(rep), trainer.views[0])
    return rep, eng


def test_an_engine_that_rejects_a_commit_keeps_its_version(store: ObstoreStore, trainer: Trainer) -> None:
    rep, _ = fail_one_commit(store, trainer, "fail_commits", "engine_rejected")
    assert "refused the commit" in rep.status()["error"]["message"]
    assert rep.sync_once() and rep.version == 1 and same_bits(served(rep), trainer.views[1])


def test_a_commit_that_fails_verification_is_rolled_back(store: ObstoreStore, trainer: Trainer) -> None:
    rep, eng = fail_one_commit(store, trainer, "corrupt_after_commit", "verification")
    assert eng.table.view_fp() == trainer.fps[0]
    assert rep.sync_once() and rep.version == 1


def test_an_engine_that_dies_and_restarts_is_audited_and_resynced(store: ObstoreStore, trainer: Trainer) -> None:
    eng = FaultyEngine(tiny_engine())
    rep = make_replica(store, eng)
    assert rep.sync_once()
    eng.dead = True
    trainer.step()
    assert not rep.sync_once()
    assert_failed(rep, "engine_down", serving=False)  # nothing to serve with: the proxy answers 503
    assert not rep.status()["engine"]["up"] and metric(rep, "flipsync_engine_up") == 0
    eng.dead = False
    eng.scramble()  # it came back with other weights
    assert rep.sync_once()
    assert rep.version == 1 and rep.serving and same_bits(served(rep), trainer.views[1])


def test_an_engine_that_comes_back_intact_keeps_its_version(store: ObstoreStore, trainer: Trainer) -> None:
    eng = FaultyEngine(tiny_engine())
    rep = make_replica(store, eng)
    assert rep.sync_once()
    eng.dead = True
    assert not rep.sync_once()
    eng.dead = False
    trainer.step()
    assert rep.sync_once()
    assert rep.version == 1 and rep.status()["last_update"]["kind"] == "patch"  # no keyframe needed


def test_a_failed_keyframe_load_is_retried(store: ObstoreStore, trainer: Trainer) -> None:
    eng = FaultyEngine(tiny_engine())
    rep = make_replica(store, eng)
    eng.fail_loads = 1
    assert not rep.sync_once()
    assert rep.version is None
    assert_failed(rep, "engine_rejected", serving=False)
    assert rep.sync_once() and rep.version == 0


def test_a_board_that_goes_away_leaves_the_replica_serving(store: ObstoreStore, trainer: Trainer) -> None:
    flaky = FlakyStore(store)
    rep = make_replica(flaky)
    assert rep.sync_once()
    flaky.down = True
    trainer.step()
    assert not rep.sync_once()
    assert rep.version == 0
    assert_failed(rep, "board_unreachable")
    flaky.down = False
    assert rep.sync_once() and rep.version == 1


def test_a_board_that_refuses_reads_leaves_the_replica_serving_and_is_polled_slowly(
    store: ObstoreStore, trainer: Trainer
) -> None:
    flaky = FlakyStore(store)
    rep = Replica(BoardReader(flaky, "run"), tiny_engine(), config=fast_replica(poll=0.01, max_backoff=0.5))
    assert rep.sync_once()
    flaky.refused = True
    trainer.step()
    assert not rep.sync_once()
    assert_failed(rep, "board_refused")
    assert "AccessDenied" in rep.status()["error"]["message"] and rep.version == 0
    rep.start()
    try:
        n = metric(rep, "flipsync_failures_total", kind="board_refused") or 0
        time.sleep(1.2)
        # A refusal is polled at max_backoff_s at once (passes at about 0, 0.5, 1.0 s), not 0.02, 0.04, ...
        assert (metric(rep, "flipsync_failures_total", kind="board_refused") or 0) - n <= 4
        flaky.refused = False
        rep.wake()
        assert rep.wait_version(1, 10) and same_bits(served(rep), trainer.views[1])
    finally:
        rep.stop()


def test_the_loop_converges_and_backs_off(store: ObstoreStore, trainer: Trainer) -> None:
    flaky = FlakyStore(store)
    rep = make_replica(flaky, mode=CommitMode.QUIESCE)
    rep.start()
    try:
        assert rep.wait_version(0, 10)
        flaky.down = True
        trainer.step()
        assert wait_until(lambda: rep.state is State.ERROR, 10)
        n = metric(rep, "flipsync_failures_total", kind="board_unreachable") or 0
        assert wait_until(lambda: (metric(rep, "flipsync_failures_total", kind="board_unreachable") or 0) > n, 10)
        flaky.down = False
        rep.wake()
        assert rep.wait_version(1, 10) and same_bits(served(rep), trainer.views[1])
        assert wait_until(lambda: rep.state is State.IDLE, 5)
    finally:
        rep.stop()


def test_head_moving_backwards_is_refused(store: ObstoreStore, trainer: Trainer, tmp_path: Path) -> None:
    rep = make_replica(store)
    trainer.step()
    assert rep.sync_once() and rep.version == 1
    store.delete([RunLayout("run").version_manifest(1), RunLayout("run").latest])
    assert not rep.sync_once()
    assert rep.version == 1
    assert_failed(rep, "board")


@pytest.mark.parametrize("fmt", ["fp8-block"])
def test_a_quantized_replica_follows_bitwise(board_dir: str, fmt: str) -> None:
    store = open_store(board_dir, FAST)
    trainer = Trainer(store, fmt=fmt)
    rep = make_replica(store, tiny_engine(fmt))
    trainer.step()
    trainer.step()
    assert rep.sync_once() and rep.version == 2 and same_bits(served(rep), trainer.views[2])
