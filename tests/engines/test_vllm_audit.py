"""The kernel-state audit and the cases the engine's own update path gets wrong, on the fake vLLM model.

The fake (``fake_vllm``) reproduces the engine behaviours the audit exists for: fused experts whose method
object prepacks them on the first load only (vLLM CPU's MoE: a reload leaves them unpacked), packed layers
that drop their weight to None (oneDNN INT8), an engine whose opaque copy is not rebuilt on reload (stale),
a broken update path (a fault run after reprocessing), and FP32 norms fed from BF16 tensors.
"""

from __future__ import annotations

import logging

import pytest
import torch
from fake_vllm import DIMS, FakeLlama, bits_equal, boot, checkpoint, fake_policy, held_view, make_reloader, step

from flipsync.board import BoardReader, BoardWriter, open_store
from flipsync.codec import diff_views
from flipsync.codec.bits import int_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.vllm.engine import VllmEngine
from flipsync.engines.vllm.rpc_transports import LocalTransport
from flipsync.engines.vllm.tensor_specs import specs_of
from flipsync.engines.vllm.worker import WorkerCore
from flipsync.errors import BaseMismatchError, ConfigError, EngineError
from flipsync.sidecar.metrics import SidecarMetrics
from flipsync.sidecar.replica import Replica
from tests.sidecar.sidecar_helpers import FAST, fast_replica

MOE = 3  # experts per layer


def engine_of(pairs, view, **kw) -> VllmEngine:
    return VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(view), **kw)


def chain(v0: dict[str, torch.Tensor], n: int = 3) -> tuple[list[dict[str, torch.Tensor]], list, list]:
    views, patches, tables = [v0], [], [FingerprintTable.of(v0)]
    for i in range(n):
        views.append(step(views[-1], 10 + i))
        p, t = diff_views(views[-2], views[-1], old_table=tables[-1])
        patches.append(p)
        tables.append(t)
    return views, patches, tables


def corrupt_packed(model: FakeLlama, touched: set[str]) -> None:
    """A broken post-load step: the reprocessed packed copies come out one ulp off at one element."""
    for mname in touched:
        mod = model.get_submodule(mname)
        if getattr(mod, "packed_copy", None) is not None:
            int_view(mod.packed_copy).view(-1)[0] += 1


# ------------------------------------------------------------------------------------------------ MoE
@pytest.mark.parametrize("size", [1, 2])
def test_moe_reload_that_skips_the_prepack_is_completed_and_bitwise(size: int, caplog) -> None:
    """The engine's reload leaves fused experts unpacked (vLLM CPU's UnquantizedFusedMoEMethod): the first
    reload of the kind is found to differ from a fresh load, the layer takes the fresh load's state, and every
    later reload of experts does too; what the kernels read equals the target after every step."""
    views, patches, tables = chain(checkpoint(0, moe=MOE))
    pairs = boot(views[0], size=size, moe=MOE)
    engine = engine_of(pairs, views[0])
    assert all(not a["mismatches"] for a in engine.attach_audit.values())
    undos = []
    with caplog.at_level(logging.WARNING, logger="flipsync.engines.vllm.worker"):
        for i, p in enumerate(patches, 1):
            undos.append(engine.commit(engine.stage(p)))
            assert bits_equal(held_view(pairs, engine), views[i]), f"after patch {i}"
            assert engine.recompute_table().view_fp() == tables[i].view_fp()
    assert "leaves it differing from a fresh load" in caplog.text and "Experts" in caplog.text
    for _, core in pairs:
        assert core.kinds == {"Experts": "repaired"}  # the linears are written in place here
    for i in range(len(undos) - 1, 0, -1):  # roll back the last two (the workers keep two undo records)
        engine.rollback(undos[i])
        assert bits_equal(held_view(pairs, engine), views[i])
    engine.commit(engine.stage(patches[1]))  # re-apply
    engine.commit(engine.stage(patches[2]))
    assert bits_equal(held_view(pairs, engine), views[3])
    # the kernels hold what a fresh engine started from the target holds, module by module
    fresh = boot(views[3], size=size, moe=MOE)
    assert engine.kernel_state() == engine_of(fresh, views[3]).kernel_state()


def test_without_repair_a_reload_that_differs_from_a_fresh_load_is_refused() -> None:
    """``repair=False``: the update is refused; the undo goes through the same faulty reload path, so the
    worker says its weights are unknown and the engine refuses patches until a full load."""
    views, patches, _ = chain(checkpoint(0, moe=MOE), 1)
    pairs = boot(views[0], moe=MOE)
    engine = engine_of(pairs, views[0], repair=False)
    before = engine.table.view_fp()
    with pytest.raises(EngineError, match=r"differ from a fresh load.*Experts.*weights are unknown"):
        engine.commit(engine.stage(patches[0]))
    assert engine.table.view_fp() == before
    with pytest.raises(BaseMismatchError, match="no consistent view"):
        engine.stage(patches[0])


def test_a_faithful_moe_reload_is_audited_and_left_alone() -> None:
    views, patches, _ = chain(checkpoint(0, moe=MOE), 2)
    pairs = boot(views[0], moe=MOE, faithful_moe=True)
    engine = engine_of(pairs, views[0])
    for p in patches:
        engine.commit(engine.stage(p))
    assert pairs[0][1].kinds["Experts"] == "faithful"
    assert bits_equal(held_view(pairs, engine), views[2])


# ------------------------------------------------------------------------------- dropped and stale copies
@pytest.mark.parametrize("size", [1, 2])
def test_parameters_dropped_to_none_go_through_the_reload_path(size: int) -> None:
    """vLLM's oneDNN INT8 path sets the weight to None after loading: such parameters are mapped from their
    recorded model format, held in host copies and reloaded (attach used to fail: no parameter of that name)."""
    views, patches, tables = chain(checkpoint(0))
    pairs = boot(views[0], size=size, packed="none")
    assert pairs[0][0].model.layers[0].mlp.down_proj.weight is None
    engine = engine_of(pairs, views[0])
    modes = engine.modes()
    assert modes["model.layers.0.mlp.down_proj.weight"].startswith("reload: dropped after loading")
    u1 = engine.commit(engine.stage(patches[0]))
    u2 = engine.commit(engine.stage(patches[1]))
    assert bits_equal(held_view(pairs, engine), views[2])
    assert pairs[0][0].model.layers[0].mlp.down_proj.weight is None  # the engine's layout is kept
    engine.rollback(u2)
    engine.rollback(u1)
    assert bits_equal(held_view(pairs, engine), views[0])
    assert engine.recompute_table().view_fp() == tables[0].view_fp()


def test_a_stale_opaque_copy_is_found_by_the_probe_and_rebuilt() -> None:
    """An engine whose reload does not rebuild the packed copy the kernel reads (its handle keeps old bits):
    the tensors agree, the kernel's outputs do not; the layer takes the fresh load's opaque state."""
    views, patches, _ = chain(checkpoint(0), 2)
    pairs = boot(views[0], packed=True, stale=True)
    engine = engine_of(pairs, views[0])
    for i, p in enumerate(patches, 1):
        engine.commit(engine.stage(p))
        assert bits_equal(held_view(pairs, engine), views[i])
    assert pairs[0][1].kinds["ColumnLinear"] == "repaired"


# ------------------------------------------------------------------------------------- the audit refuses
@pytest.mark.parametrize("audit", ["every", "sample"])
def test_a_broken_post_load_step_is_caught_and_the_version_refused(audit: str) -> None:
    """After the first update (every kind's reload found faithful) the engine's update path starts producing
    one wrong element per layer: the audit sees it, the commit is undone and raises, the table stays."""
    views, patches, tables = chain(checkpoint(0), 2)
    faults: list = []
    pairs = boot(views[0], size=2, packed=True, fault=faults)
    engine = engine_of(pairs, views[0], audit=audit)
    engine.commit(engine.stage(patches[0]))
    assert bits_equal(held_view(pairs, engine), views[1])
    faults.append(corrupt_packed)
    with pytest.raises(EngineError, match="differ from a fresh load of the same checkpoint tensors"):
        engine.commit(engine.stage(patches[1]))
    assert engine.table.view_fp() == tables[1].view_fp()
    faults.clear()  # the undo went through the broken path too; a later audit sees the damage
    bad = engine.audit_now()
    assert any(bad[r] for r in bad)
    engine.load_view(views[1])  # a full load through a working path repairs it
    assert engine.audit_now() == {"0": {}, "1": {}}
    assert bits_equal(held_view(pairs, engine), views[1])


def test_with_the_audit_off_a_broken_step_is_not_seen() -> None:
    """``off`` skips the audits (only the first reload of each kind is still compared): documented as the
    setting that inherits engine bugs."""
    views, patches, _ = chain(checkpoint(0), 2)
    faults: list = []
    pairs = boot(views[0], packed=True, fault=faults)
    engine = engine_of(pairs, views[0], audit="off")
    engine.commit(engine.stage(patches[0]))
    faults.append(corrupt_packed)
    engine.commit(engine.stage(patches[1]))  # accepted
    assert not bits_equal(held_view(pairs, engine), views[2])


def test_a_refused_update_counts_as_a_failure_and_the_version_is_not_reported(tmp_path) -> None:
    store = open_store(str(tmp_path / "board"), FAST)
    writer = BoardWriter(store, "run", publisher_id="t")
    views, _, tables = chain(checkpoint(0), 2)
    writer.publish_snapshot(views[0], version=0, view_fp=tables[0].view_fp(), served_format="bf16")

    def publish(v: int) -> None:
        p, _ = diff_views(views[v - 1], views[v], old_table=tables[v - 1], base_version=v - 1, target_version=v,
                          served_format="bf16", context=False)  # fmt: skip
        writer.publish_patch([p.to_bytes()], base_version=v - 1, target_version=v, base_view_fp=tables[v - 1].view_fp(),
                             target_view_fp=tables[v].view_fp(), served_format="bf16")  # fmt: skip

    faults: list = []
    pairs = boot(views[0], packed=True, fault=faults)
    engine = engine_of(pairs, views[0])
    metrics = SidecarMetrics()
    rep = Replica(BoardReader(store, "run"), engine, config=fast_replica(), metrics=metrics)
    publish(1)
    assert rep.sync_once() and rep.version == 1  # every kind's reload is now known faithful
    faults.append(corrupt_packed)
    publish(2)
    assert not rep.sync_once()
    assert rep.version == 1 and engine.table.view_fp() == tables[1].view_fp()
    assert rep.status()["error"] is not None
    failures = sum(s.value for m in metrics.failures.collect() for s in m.samples if s.name.endswith("_total"))
    assert failures >= 1


# ------------------------------------------------------------------------------------------ dtypes
def test_bf16_tensors_loaded_into_fp32_parameters_patch_through_the_conversion() -> None:
    views, patches, tables = chain(checkpoint(0))
    pairs = boot(views[0], size=2, norm_dtype=torch.float32)
    assert pairs[0][0].model.norm.weight.dtype == torch.float32
    engine = engine_of(pairs, views[0])
    assert engine.table.view_fp() == tables[0].view_fp()
    undo = engine.commit(engine.stage(patches[0]))
    norm = pairs[1][0].model.layers[1].post_attention_layernorm.weight
    assert torch.equal(norm, views[1]["model.layers.1.post_attention_layernorm.weight"].float())
    assert engine.recompute_table().view_fp() == tables[1].view_fp()
    engine.rollback(undo)
    assert bits_equal(held_view(pairs, engine), views[0])
    # what a fresh load of v1 gives, bit for bit
    engine.commit(engine.stage(patches[0]))
    assert engine.kernel_state() == engine_of(boot(views[1], size=2, norm_dtype=torch.float32), views[1]).kernel_state()


def test_a_narrowing_load_is_refused_with_the_way_out() -> None:
    v0 = checkpoint(0)
    v0["model.norm.weight"] = v0["model.norm.weight"].float() + 2**-12  # not a bf16 value: FP32 in the checkpoint
    model = FakeLlama(**DIMS)
    model.load_weights(v0.items())
    core = WorkerCore(model, policy=fake_policy, reloader=make_reloader(model))
    with pytest.raises(EngineError, match=r"cannot hold its bits exactly.*save the checkpoint"):
        VllmEngine(LocalTransport([core]), specs_of(v0))


# ------------------------------------------------------------------------------------------ attach
def test_an_engine_that_does_not_serve_its_source_attaches_but_refuses_patches() -> None:
    """The attach audit compares the reload-mode layers with a fresh load of ``source``: an engine that serves
    something else (a sidecar restarted after patches) is refused patches until a full load."""
    views, patches, _ = chain(checkpoint(0), 1)
    pairs = boot(views[1], packed=True)
    for _, core in pairs:
        core.default_source = lambda v=views[0]: v  # the sidecar believes the engine serves v0
    engine = engine_of(pairs, views[0])
    assert any(a["mismatches"] for a in engine.attach_audit.values())
    with pytest.raises(BaseMismatchError, match="fresh load of the source"):
        engine.stage(patches[0])
    engine.load_view(views[0])
    engine.commit(engine.stage(patches[0]))
    assert bits_equal(held_view(pairs, engine), views[1])


def test_audit_settings_are_checked() -> None:
    v0 = checkpoint(0)
    with pytest.raises(ConfigError, match="audit"):
        engine_of(boot(v0), v0, audit="sometimes")


def test_the_audit_costs_one_twin_per_touched_layer() -> None:
    """``every`` builds one twin per reloaded layer, ``sample`` one per kind of layer touched."""
    views, patches, _ = chain(checkpoint(0), 2)
    for audit, expect in (("every", 10), ("sample", 2)):  # 2 layers x 4 linears + lm_head (+ first-time kinds)
        pairs = boot(views[0], packed=True)
        engine = engine_of(pairs, views[0], audit=audit)
        engine.commit(engine.stage(patches[0]))  # first reload: every kind compared once
        engine.commit(engine.stage(patches[1]))
        reloaded = engine.last_audit["reloaded"]["0"]
        assert len(reloaded) == 9
        assert len(engine.last_audit["layers"]["0"]) == (9 if audit == "every" else expect)
