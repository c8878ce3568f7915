"""The kernel-state audit and the cases the engine's own update path gets wrong, on the fake vLLM model.

The fake (``fake_vllm``) reproduces the engine behaviours the audit exists for: fused experts whose method
object prepacks them on the first load only (vLLM CPU's MoE: a reload leaves them unpacked), packed layers
that drop their weight to None (oneDNN INT8), an engine whose opaque copy is not rebuilt on reload (stale),
a broken update path (a fault run after reprocessing), and FP32 norms fed from BF16 tensors.
"""

from __future__ import annotations

import logging
from typing import Any

import fake_vllm
import pytest
import torch
from fake_vllm import (
    DIMS,
    Experts,
    FakeLlama,
    Fault,
    bits_equal,
    boot,
    checkpoint,
    fake_policy,
    fake_probe,
    held_view,
    make_reloader,
    step,
)

from flipsync.board import BoardReader, BoardWriter, open_store
from flipsync.codec import diff_views
from flipsync.codec.bits import int_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.vllm.engine import VllmEngine
from flipsync.engines.vllm.kernels import KernelHooks, default_kind, default_transplant, default_twin
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


# --------------------------------------------------------------------------------------- the fault matrix
# One test per blind spot of the audit (docs/engines.md, "Blind spots, and how each is closed"): each breaks
# exactly that thing in the fake engine and must be refused (or, where the engine's own path falls short at the
# first reload, completed from a fresh load); each fails with its fix reverted.
def once(fault: Fault) -> Fault:
    """A fault that strikes on the first reload after it is installed only (the undo's reload then works)."""
    done: list[bool] = []

    def run(model: FakeLlama, touched: set[str]) -> None:
        if not done:
            done.append(True)
            fault(model, touched)

    return run


def experts_of(model: FakeLlama) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def test_fault_1_a_stale_packed_copy_in_an_moe_method_attribute_is_refused(monkeypatch) -> None:
    """Blind spot 1: the fused experts' kernel reads packed copies kept in plain attributes of its method
    object; the layer's own tensors are right. With the fake's expert probe off, only comparing the method's
    state finds it."""
    monkeypatch.setattr(fake_vllm, "MOE_PROBE", False)
    views, patches, tables = chain(checkpoint(0, moe=MOE), 2)
    faults: list = []
    pairs = boot(views[0], moe=MOE, faithful_moe=True, moe_method="plain", fault=faults)
    engine = engine_of(pairs, views[0])
    engine.commit(engine.stage(patches[0]))
    assert pairs[0][1].kinds["Experts"] == "faithful"

    def stale(model: FakeLlama, touched: set[str]) -> None:
        int_view(experts_of(model)[1].quant_method.packed_w13).view(-1)[5] += 1

    faults.append(once(stale))
    with pytest.raises(EngineError, match=r"quant_method\.packed_w13 differs from a fresh load"):
        engine.commit(engine.stage(patches[1]))
    assert engine.table.view_fp() == tables[1].view_fp()
    assert bits_equal(held_view(pairs, engine), views[1])


def test_fault_1_the_fused_experts_kernel_is_probed() -> None:
    """Blind spot 1, the probe: a stale packed copy the kernel reads is seen in the experts' outputs with every
    expert forced in turn (and the method's state)."""
    views, patches, _ = chain(checkpoint(0, moe=MOE), 2)
    faults: list = []
    pairs = boot(views[0], moe=MOE, faithful_moe=True, moe_method="plain", fault=faults)
    engine = engine_of(pairs, views[0])
    engine.commit(engine.stage(patches[0]))
    faults.append(once(lambda model, _t: int_view(experts_of(model)[0].quant_method.packed_w2).view(-1)[3].add_(1)))
    with pytest.raises(EngineError, match=r"probe experts differs from a fresh load"):
        engine.commit(engine.stage(patches[1]))


def test_fault_1_an_moe_method_that_is_a_child_module_is_transplanted() -> None:
    """Blind spot 1, the transplant: the engine's reload skips the prepack and the packed copies live in the
    method, a child module; the repair must give the live layer the fresh load's method (default_transplant
    skipped child modules, so the repair could not take and the update was refused)."""
    views, patches, _ = chain(checkpoint(0, moe=MOE), 2)
    pairs = boot(views[0], moe=MOE, moe_method="module")
    engine = engine_of(pairs, views[0])
    for i, p in enumerate(patches, 1):
        engine.commit(engine.stage(p))
        assert bits_equal(held_view(pairs, engine), views[i])
    assert pairs[0][1].kinds["Experts"] == "repaired"
    assert engine.kernel_state() == engine_of(boot(views[2], moe=MOE, moe_method="module"), views[2]).kernel_state()


def test_fault_2_every_holder_of_a_shared_parameter_is_reloaded_and_audited() -> None:
    """Blind spot 2: GLM's router bias is one tensor held by the gate and by the fused experts, whose method
    derives its own copy at processing. A patch of the bias alone must reprocess the experts too (equal to a
    fresh engine after it), and a broken reprocess of that holder must be refused."""
    v0 = checkpoint(0, moe=MOE, router=True)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    v1 = dict(v0)
    v1[bias] = step({bias: v0[bias]}, 3, frac=1.0)[bias]
    v2 = dict(v1)
    v2[bias] = step({bias: v1[bias]}, 4, frac=1.0)[bias]
    t0, t1 = FingerprintTable.of(v0), FingerprintTable.of(v1)
    p1, _ = diff_views(v0, v1, old_table=t0)
    p2, _ = diff_views(v1, v2, old_table=t1)
    faults: list = []
    pairs = boot(v0, moe=MOE, faithful_moe=True, moe_method="plain", router=True, fault=faults)
    engine = engine_of(pairs, v0)
    engine.commit(engine.stage(p1))
    assert "model.layers.1.mlp.experts" in engine.last_audit["reloaded"]["0"]
    fresh = boot(v1, moe=MOE, faithful_moe=True, moe_method="plain", router=True)
    assert engine.kernel_state() == engine_of(fresh, v1).kernel_state()

    def off(model: FakeLlama, touched: set[str]) -> None:
        int_view(experts_of(model)[1].quant_method.bias_packed).view(-1)[0] += 1

    faults.append(once(off))
    with pytest.raises(EngineError, match=r"mlp\.experts.*bias_packed differs from a fresh load"):
        engine.commit(engine.stage(p2))
    assert engine.table.view_fp() == t1.view_fp()
    assert pairs[0][1].holders[bias] == {"model.layers.1.mlp.experts"}


def test_fault_3_a_non_checkpoint_parameter_comes_from_the_fresh_load_not_the_live_layer() -> None:
    """Blind spot 3: ``input_scale`` is in no checkpoint and a fresh load sets it to one; a reload that zeroes
    it is refused (the twin used to take the live, zeroed value and agree with it)."""
    views, patches, tables = chain(checkpoint(0), 2)
    faults: list = []
    pairs = boot(views[0], packed=True, scale=True, fault=faults)
    engine = engine_of(pairs, views[0])
    engine.commit(engine.stage(patches[0]))

    def zero(model: FakeLlama, touched: set[str]) -> None:
        model.model.layers[0].self_attn.o_proj.input_scale.data.zero_()

    faults.append(once(zero))
    with pytest.raises(EngineError, match=r"o_proj.*input_scale differs from a fresh load"):
        engine.commit(engine.stage(patches[1]))
    assert engine.table.view_fp() == tables[1].view_fp()


def test_fault_3_a_repaired_kind_is_rechecked_against_an_independent_twin() -> None:
    """Blind spot 3, the repair: a repaired layer used to be compared with the twin it had just copied, so state
    that both share (the adopted packed copy, which the kernel reads) could go wrong unseen. A transplant that
    damages the adopted state must be refused on the next reload."""
    views, patches, _ = chain(checkpoint(0), 2)
    armed: list[bool] = []

    def transplant(live: torch.nn.Module, twin: torch.nn.Module) -> None:
        default_transplant(live, twin)
        if armed and getattr(twin, "packed_copy", None) is not None:
            int_view(twin.packed_copy).view(-1)[0] += 1  # the live layer reads this very tensor now

    hooks = KernelHooks(default_twin, fake_probe, transplant, default_kind)
    pairs = boot(views[0], packed=True, stale=True, hooks=hooks)
    engine = engine_of(pairs, views[0])
    engine.commit(engine.stage(patches[0]))
    assert pairs[0][1].kinds["ColumnLinear"] == "repaired"
    assert pairs[0][1].rechecked
    armed.append(True)
    with pytest.raises(EngineError, match="differ from a fresh load"):
        engine.commit(engine.stage(patches[1]))


def test_fault_4_sample_finds_a_fault_in_any_layer_of_a_kind_within_its_layer_count() -> None:
    """Blind spot 4: ``sample`` compares one layer per kind; a fault in one of the kind's 4 layers was found with
    chance 1/4 per update. The rotation finds it within 4 updates, from any start (over many seeds)."""
    views, patches, _ = chain(checkpoint(0), 5)
    for trial in range(12):

        def broken(model: FakeLlama, touched: set[str]) -> None:
            if "model.layers.1.mlp.down_proj" in touched:
                int_view(model.model.layers[1].mlp.down_proj.packed_copy).view(-1)[0] += 1

        faults: list = []
        pairs = boot(views[0], packed=True, fault=faults)
        for _, core in pairs:
            core._rng.seed(trial)
        engine = engine_of(pairs, views[0], audit="sample")
        engine.commit(engine.stage(patches[0]))  # every kind's first reload: compared whole, faithful
        faults.append(broken)
        refused = 0
        for p in patches[1:]:
            try:
                engine.commit(engine.stage(p))
            except EngineError as e:
                assert "model.layers.1.mlp.down_proj" in str(e)
                refused += 1
                break
        assert refused, f"trial {trial}: a faulty RowLinear layer went unseen for 4 updates under sample"


def test_fault_5_an_in_place_parameter_overwritten_by_a_reload_is_refused() -> None:
    """Blind spot 5: in-place parameters (every dense layer on a GPU) were never audited; a reload that writes
    over one (here the embedding) after the scatter must be refused: every write is read back after the
    reloads and its digest compared with the staged target bits."""
    views, patches, tables = chain(checkpoint(0), 2)
    faults: list = []
    pairs = boot(views[0], packed=True, fault=faults)
    engine = engine_of(pairs, views[0])
    assert engine.modes()["model.embed_tokens.weight"].startswith("inplace")
    engine.commit(engine.stage(patches[0]))
    faults.append(once(lambda model, _t: int_view(model.model.embed_tokens.weight.data).view(-1).bitwise_xor_(1)))
    with pytest.raises(EngineError, match=r"read-back of 'model\.embed_tokens\.weight' after the commit differs"):
        engine.commit(engine.stage(patches[1]))
    assert engine.table.view_fp() == tables[1].view_fp()  # (the fault also hit elements no patch wrote)


def test_fault_5_the_sidecar_compares_the_read_back_digest_with_the_target() -> None:
    """The worker's digest of what it read back must match the bits the sidecar staged; a worker that answers
    another digest (a write that landed elsewhere) gets its commit undone."""
    views, patches, tables = chain(checkpoint(0), 1)
    pairs = boot(views[0])
    core = pairs[0][1]
    real = core.apply

    def lying(token: str, writes: list[list[str]], positions: Any) -> dict:
        out = real(token, writes, positions)
        out["readback"] = "0" * 32
        return out

    core.apply = lying  # type: ignore[method-assign]
    engine = engine_of(pairs, views[0])
    with pytest.raises(EngineError, match="read back other bits than the patch's target"):
        engine.commit(engine.stage(patches[0]))
    assert engine.table.view_fp() == tables[0].view_fp()
    assert bits_equal(held_view(pairs, engine), views[0])


def test_fault_6_a_reload_that_moves_a_parameter_is_refused() -> None:
    """Blind spot 6: a reload that reallocates a parameter (same values, new storage) passes every value check,
    while captured CUDA graphs would read the freed memory: refused by the storage check."""
    views, patches, _ = chain(checkpoint(0, moe=MOE), 2)
    faults: list = []
    pairs = boot(views[0], moe=MOE, faithful_moe=True, fault=faults)
    engine = engine_of(pairs, views[0])
    engine.commit(engine.stage(patches[0]))

    def move(model: FakeLlama, touched: set[str]) -> None:
        experts = experts_of(model)[0]
        moved = torch.nn.Parameter(experts.w13.detach().clone(), requires_grad=False)
        moved.weight_loader = experts.weight_loader  # type: ignore[attr-defined]
        experts.w13 = moved

    faults.append(once(move))
    with pytest.raises(EngineError, match=r"moved 1 parameter.*experts\.w13.*CUDA graphs"):
        engine.commit(engine.stage(patches[1]))


class Handle:
    """An opaque kernel handle (a oneDNN primitive's raw pointer): ``data`` is memory the layer does not own."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data


def scribble(chunk: torch.Tensor) -> None:
    """What the allocator writes into a chunk it takes back (glibc's free-list pointers: the first 16 bytes)."""
    flat = int_view(chunk).view(-1)
    flat[:4] ^= 0x5A5A


def test_fault_8_a_kernel_reading_memory_the_reload_freed_is_caught_before_a_twin_takes_that_memory() -> None:
    """Blind spot 8 (vLLM CPU's oneDNN INT8 handle, seen once in CI): after the reload each packed layer's
    kernel reads a chunk the reload freed; the allocator gives that chunk to the layer's twin, which loads the
    same values into it, so a probe taken after the twin was built matches, the kind passes as faithful and
    the kernel computes from garbage once the twin is gone. Probes taken right after the reload see the
    garbage: the kind is repaired (the live layer takes the twin's handle and keeps the twin alive) and the
    live kernels equal a fresh load after every commit and once the twins are collected."""
    import gc
    import weakref

    views, patches, tables = chain(checkpoint(0), 3)
    freed: dict[str, torch.Tensor] = {}  # layer -> the chunk its live kernel reads after the last reload

    def dangling(model: FakeLlama, touched: set[str]) -> None:
        for mname, mod in model.named_modules():
            if mname in touched and getattr(mod, "packed", False):
                chunk = mod.packed_copy.clone()
                mod.handle = Handle(chunk)
                scribble(chunk)  # freed by the reload, still read by the kernel
                freed[mname] = chunk

    def twin(mname: str, module: torch.nn.Module, loaded: Any, state: Any) -> torch.nn.Module:
        tw = default_twin(mname, module, loaded, state)
        if getattr(tw, "packed_copy", None) is None:
            return tw
        data = tw.packed_copy
        chunk = freed.pop(mname, None)
        if chunk is not None:  # the allocator hands the twin the chunk the reload freed
            chunk.copy_(data)
            data = chunk
            weakref.finalize(tw, scribble, chunk)  # freed again with the twin
        tw.handle = Handle(data)
        return tw

    def probe(mname: str, module: torch.nn.Module, rows: int | None, seed: int) -> dict[str, torch.Tensor]:
        handle = vars(module).get("handle")
        if handle is None:
            return fake_probe(mname, module, rows, seed)
        return {"kernel": handle.data.t()[:, torch.from_numpy(fake_vllm.probe_rows(handle.data.shape[0], rows, seed))]}

    hooks = KernelHooks(twin, probe, default_transplant, default_kind)
    pairs = boot(views[0], packed=True, fault=[dangling], hooks=hooks)
    for mod in pairs[0][0].modules():  # the engine's own first load: handles to memory it holds
        if getattr(mod, "packed", False):
            mod.handle = Handle(mod.packed_copy)
    engine = engine_of(pairs, views[0])
    for k, p in enumerate(patches, 1):
        engine.commit(engine.stage(p))
        assert engine.table.view_fp() == tables[k].view_fp()
        gc.collect()  # the twins no layer adopted are gone, their chunks scribbled
        assert engine.audit_now() == {"0": {}}, k
    assert pairs[0][1].kinds["ColumnLinear"] == "repaired"
