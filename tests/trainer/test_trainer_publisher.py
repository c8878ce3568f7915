"""The single-process Publisher: real Adam steps, a real file board, replicas that end bitwise equal."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from trainer_helpers import Replica, SlowStore, adam, assert_bitwise, expected_view, follow_and_check, tiny_llama, train

from flipsync.board import KeyframePolicy, open_store
from flipsync.board.catalog import Catalog
from flipsync.board.reader import join_step
from flipsync.codec import Patch
from flipsync.domain.manifest import Kind
from flipsync.engines.memory import MemoryEngine
from flipsync.errors import ConfigError, ConflictError
from flipsync.trainer import Publisher, PublisherConfig, new_run_name

NO_KEYFRAMES = KeyframePolicy(chain_fraction=1e9, max_interval=10_000)


@pytest.mark.parametrize(
    ("fmt", "background", "keep_on"),
    [("bf16", True, "host"), ("bf16", False, "device"), ("nvfp4", True, "host"), ("fp8-block", False, "host")],
)
def test_replica_follows_every_version_bitwise(tmp_path: Path, fmt: str, background: bool, keep_on: str) -> None:
    store = open_store(tmp_path)
    model = tiny_llama()
    opt = adam(model)
    with Publisher(
        model,
        store,
        run="r",
        format=fmt,
        optimizer=opt,
        config=PublisherConfig(background=background, keep_on=keep_on, keyframe_policy=NO_KEYFRAMES),
    ) as pub:
        train(model, opt, 4)
        last = pub.flush()
    assert last is not None and last.step == 4
    replica = Replica(store, "r")
    assert replica.follow_each() == pub.stats.head
    assert_bitwise(expected_view(model, fmt), replica.tensors)
    assert isinstance(replica.steps[0].manifest.kind, Kind) and replica.steps[0].manifest.kind is Kind.KEYFRAME
    if not background:  # inline: one version per step, never squashed
        assert [s.manifest.meta["step"] for s in replica.patches] == [1, 2, 3, 4]


def test_names_are_checkpoint_names_and_tied_weights_are_served_once(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama(tie=True)
    with Publisher(model, store, run="tied", config=PublisherConfig(background=False)) as pub:
        pub.step()
    m0 = Catalog(store, "tied").version(0)
    assert m0.meta["tied"] == "lm_head.weight=model.embed_tokens.weight"
    replica = Replica(store, "tied")
    replica.sync()
    assert "lm_head.weight" not in replica.tensors
    assert set(replica.tensors) == set(model.state_dict()) - {"lm_head.weight"}


def test_untied_model_serves_every_state_dict_key(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama(tie=False)
    with Publisher(model, store, run="untied", config=PublisherConfig(background=False)):
        pass
    replica = Replica(store, "untied")
    replica.sync()
    assert set(replica.tensors) == set(model.state_dict())


def test_runs_are_named_and_never_mix(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama()
    with Publisher(model, store, config=PublisherConfig(background=False)) as a:
        pass
    assert a.run != new_run_name()  # a fresh unique name by default
    with pytest.raises(ConflictError, match="already exists"):
        Publisher(model, store, run=a.run, config=PublisherConfig(background=False))
    # refused in either mode, it leaves no thread behind (the background worker's pools were made at start)
    before = set(threading.enumerate())
    for background in (False, True):
        with pytest.raises(ConflictError, match="already exists"):
            Publisher(model, store, run=a.run, config=PublisherConfig(background=background))
    deadline = time.monotonic() + 5  # pool threads exit soon after their shutdown
    while (left := [t.name for t in threading.enumerate() if t not in before]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left
    # resume=True with the same weights continues the run without a new version
    opt = adam(model)
    with Publisher(model, store, run=a.run, resume=True, optimizer=opt, config=PublisherConfig(background=False)) as b:
        assert b.started == "adopt" and b.stats.head == 0
        train(model, opt, 1)
    assert b.stats.head == 1
    follow_and_check(store, a.run, model)


def test_a_second_trainer_fences_off_the_first(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama()
    opt = adam(model)
    first = Publisher(model, store, run="race", optimizer=opt, config=PublisherConfig(background=False))
    train(model, opt, 1)
    other = tiny_llama(seed=1)  # another trainer (other weights) takes the run over
    with Publisher(other, store, run="race", resume=True, config=PublisherConfig(background=False)) as second:
        assert second.started == "takeover"
    with pytest.raises(ConflictError, match="fenced off"):
        train(model, opt, 1)
    first.close()
    replica = Replica(store, "race")
    replica.follow_each()
    assert_bitwise(expected_view(other), replica.tensors)


def test_step_returns_while_uploads_are_slow_and_versions_are_squashed(tmp_path: Path) -> None:
    """Back-pressure: a slow store never blocks step(); pending steps fold into the next version."""
    store = open_store(tmp_path)
    model = tiny_llama()
    opt = adam(model)
    gate = threading.Event()
    gate.set()
    pub = Publisher(model, SlowStore(store, 0.05, gate), run="slow", optimizer=opt, config=PublisherConfig(spans=False))  # type: ignore[arg-type]
    gate.clear()  # from here no manifest can be created until the steps are done
    training = threading.Thread(target=train, args=(model, opt, 8))
    training.start()
    training.join(timeout=300)
    done = not training.is_alive()
    gate.set()
    training.join()
    pub.close()
    st = pub.stats
    assert done  # the steps did not wait for the uploads
    assert st.squashed_steps > 0 and st.versions < st.steps + 1
    assert st.peak_view_bytes <= 3 * st.view_bytes  # base + in flight + the step being computed
    replica = follow_and_check(store, "slow", model)
    steps = [s.manifest.meta["steps"] for s in replica.patches]
    assert replica.steps[0].manifest.meta["step"] == 0  # v0 is the initial weights, never folded with step 1
    assert sum(steps) == 8 and max(steps) > 1  # every step is in exactly one version


def test_manifest_meta_records_trainer_steps(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama()
    opt = adam(model)
    with Publisher(
        model, store, run="meta", optimizer=opt, config=PublisherConfig(background=False, meta={"source": "init"})
    ) as pub:
        train(model, opt, 2)
        pub.step(meta={"source": "extra"})
    cat = Catalog(store, "meta")
    assert cat.version(0).meta["source"] == "init"
    assert [cat.version(v).meta["step"] for v in (1, 2, 3)] == [1, 2, 3]
    assert cat.version(3).meta["source"] == "extra"
    assert json.loads(store.get("runs/meta/latest.json"))["version"] == 3


@pytest.mark.parametrize("background", [True, False])
def test_a_published_patch_says_where_its_time_went(tmp_path: Path, background: bool) -> None:
    model = tiny_llama()
    opt = adam(model)
    with Publisher(
        model, open_store(tmp_path), run="t", optimizer=opt, config=PublisherConfig(background=background)
    ) as pub:
        pub.flush()  # v0 holds the initial weights (else a busy machine may fold step 1 into it)
        train(model, opt, 1)
        published = pub.flush()
    assert published is not None and published.kind == "patch" and published.changed > 0
    assert set(published.timings) == {"view", "diff", "code", "publish"}
    assert all(0 < v < 60 for v in published.timings.values())


def test_spans_and_keyframes_let_a_new_replica_catch_up_cheaply(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama()
    opt = adam(model, lr=1e-4)
    with Publisher(
        model, store, run="spans", optimizer=opt, config=PublisherConfig(background=False, keyframe_policy=NO_KEYFRAMES)
    ):
        train(model, opt, 4)
    cat = Catalog(store, "spans")
    assert set(cat.list_spans()) == {(0, 2), (2, 4), (0, 4)}
    replica = Replica(store, "spans")
    replica.sync(goal=0)
    replica.sync()  # v0 -> v4 by the span
    assert [s.manifest.kind for s in replica.steps] == [Kind.KEYFRAME, Kind.SPAN]
    assert_bitwise(expected_view(model), replica.tensors)
    with Publisher(
        tiny_llama(seed=3),
        store,
        run="kf",
        config=PublisherConfig(background=False, keyframe_policy=KeyframePolicy(max_interval=2)),
    ) as pub:
        pub.step()
        pub.step()
    assert Catalog(store, "kf").list_keyframes() == [2]


def test_config_errors_are_clear(tmp_path: Path) -> None:
    model = tiny_llama()
    with pytest.raises(ConfigError, match="unknown served format"):
        Publisher(model, tmp_path, format="int3")
    with pytest.raises(ConfigError, match="keep_on"):
        Publisher(model, tmp_path, config=PublisherConfig(keep_on="disk"))  # type: ignore[arg-type]
    pub = Publisher(model, tmp_path, config=PublisherConfig(background=False))
    pub.close()
    with pytest.raises(ConfigError, match="closed"):
        pub.step()
    with pytest.raises(ConfigError, match="already attached"):
        p = Publisher(model, tmp_path, optimizer=adam(model), config=PublisherConfig(background=False))
        try:
            p.attach(adam(model))
        finally:
            p.close()


def test_bf16_masters_are_snapshotted_not_aliased(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    model = tiny_llama().to(torch.bfloat16)
    opt = adam(model)
    with Publisher(model, store, run="b", optimizer=opt, config=PublisherConfig(background=False)):
        train(model, opt, 2)
    follow_and_check(store, "b", model)


def test_resuming_with_another_model_is_refused_unless_new_weights(tmp_path: Path) -> None:
    """Other weights of the same model take the run over (a snapshot); another model's view would strand
    the run's replicas (built for HEAD's tensors), so it needs new_weights=True."""
    store = open_store(tmp_path)
    with Publisher(tiny_llama(), store, run="r", config=PublisherConfig(background=False)):
        pass
    bigger = tiny_llama(layers=2)
    with pytest.raises(ConfigError, match=r"tensors \(names, dtypes or shapes\) that differ from HEAD's") as info:
        Publisher(bigger, store, run="r", resume=True, config=PublisherConfig(background=False))
    assert "another --run name" in str(info.value) and "--resume --new-weights" in str(info.value)
    with pytest.raises(ConfigError, match="served format fp16, HEAD's is bf16"):
        Publisher(tiny_llama(), store, run="r", resume=True, format="fp16", config=PublisherConfig(background=False))
    assert Catalog(store, "r").discover_head(None) == 0  # nothing was published by the refused ones
    with Publisher(
        tiny_llama(seed=3), store, run="r", resume=True, config=PublisherConfig(background=False)
    ) as same_model:
        assert same_model.started == "takeover"  # same tensors, other values: a snapshot, as before
    with Publisher(
        bigger, store, run="r", resume=True, new_weights=True, config=PublisherConfig(background=False)
    ) as replaced:
        assert replaced.started == "takeover"
    head = Catalog(store, "r").version(2)
    assert head.kind is Kind.KEYFRAME and isinstance(head.meta["layout"], str)
    replica = Replica(store, "r")
    replica.sync()
    assert_bitwise(expected_view(bigger), replica.tensors)


def test_default_threads_share_the_node_among_local_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from flipsync.trainer.config import default_threads

    monkeypatch.setattr("os.cpu_count", lambda: 112)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_threads() == 56
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun: 8 ranks on this node
    assert default_threads() == 7
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "256")
    assert default_threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    assert default_threads() == 56


def _parts(replica: Replica) -> list[Patch]:
    return [Patch.from_bytes(part) for s in replica.patches for part in s.parts]


@pytest.mark.parametrize(("fmt", "background"), [("bf16", False), ("bf16", True), ("nvfp4", False)])
def test_context_coded_versions_replicas_and_spans_stay_bitwise(tmp_path: Path, fmt: str, background: bool) -> None:
    store = open_store(tmp_path)
    model = tiny_llama(hidden=128, vocab=256)
    opt = adam(model, lr=1e-5 if fmt == "bf16" else 1e-3)
    cfg = PublisherConfig(background=background, context=True, keyframe_policy=NO_KEYFRAMES)
    with Publisher(model, store, run="ctx", format=fmt, optimizer=opt, config=cfg) as pub:
        v0 = {k: v.clone() for k, v in expected_view(model, fmt).items()}
        train(model, opt, 4)
        last = pub.flush()
    assert last is not None and last.step == 4
    replica = Replica(store, "ctx")
    replica.follow_each()
    assert_bitwise(expected_view(model, fmt), replica.tensors)
    assert any(p.needs_base for p in _parts(replica))  # the option took effect
    # an engine that stages with the codec follows the same versions
    engine = MemoryEngine(v0)
    for s in replica.patches:
        staged = engine.stage(join_step(s, engine.table, engine.tensors))
        engine.commit(staged)
    assert_bitwise(expected_view(model, fmt), engine.tensors)
    if background:  # a busy machine may fold steps, so which spans exist varies
        return
    # spans are squashed without the views in between, so they hold no ctx sections, and still apply
    assert set(Catalog(store, "ctx").list_spans()) == {(0, 2), (2, 4), (0, 4)}
    late = Replica(store, "ctx")
    late.sync(goal=0)
    late.sync()
    assert [s.manifest.kind for s in late.steps] == [Kind.KEYFRAME, Kind.SPAN]
    assert not any(p.needs_base for p in _parts(late))
    assert_bitwise(expected_view(model, fmt), late.tensors)


def test_context_is_on_by_default_and_the_runs_manifests_say_so(tmp_path: Path) -> None:
    """Patches are coded against their base unless the run says otherwise; every manifest records it, so a
    replica that cannot hold the base learns it from the run, not from a global default."""
    assert PublisherConfig().context is True
    store = open_store(tmp_path)
    for run, cfg in (
        ("on", PublisherConfig(background=False)),
        ("off", PublisherConfig(background=False, context=False)),
    ):
        model = tiny_llama(hidden=128, vocab=256)
        opt = adam(model, lr=1e-5)
        with Publisher(model, store, run=run, format="bf16", optimizer=opt, config=cfg) as pub:
            train(model, opt, 2)
            pub.flush()
        catalog = Catalog(store, run)
        assert {catalog.version(v).meta["context"] for v in catalog.list_versions()} == {int(cfg.context)}
    # a device-kept view has no host base to code against: such runs say so
    assert PublisherConfig(keep_on="device").context


@pytest.mark.parametrize("fmt", ["bf16", "fp8-block"])
def test_tensors_kept_in_their_own_dtype_are_served_and_patched_in_it(tmp_path: Path, fmt: str) -> None:
    """Norms kept in FP32 beside BF16 (or FP8) weights, as released checkpoints and their engines hold them:
    served in FP32, patched bitwise in FP32."""
    from flipsync.formats import served_view

    store = open_store(tmp_path)
    model = tiny_llama(hidden=128, vocab=256)
    opt = adam(model, lr=1e-3)
    norms = {k: torch.float32 for k in model.state_dict() if k.endswith("norm.weight")}
    assert norms
    cfg = PublisherConfig(background=False, dtypes=norms)
    with Publisher(model, store, run="mixed", format=fmt, optimizer=opt, config=cfg) as pub:
        train(model, opt, 3)
        pub.flush()
    replica = Replica(store, "mixed")
    replica.follow_each()
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight" or k in replica.tensors}
    want = {k: v.contiguous() for k, v in served_view(state, fmt, dtypes=norms).items()}
    assert_bitwise(want, replica.tensors)
    assert all(replica.tensors[k].dtype == torch.float32 for k in norms)
    assert len(replica.patches) >= 1
