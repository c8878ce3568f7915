"""The vLLM engine without vLLM: map learning, apply/undo/fingerprints, and the sidecar side, on a fake model.

The fake (``fake_vllm.FakeLlama``) loads a Llama checkpoint the way vLLM does (fused qkv / gate_up through
``stacked_params_mapping``, tensor-parallel row and column shards, padded vocabulary), so the probe-learned
maps are checked against what its loaders really do.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_vllm import DIMS, FakeLlama, bits_equal, boot, checkpoint, fake_policy, held_view, make_reloader, step
from hypothesis import given
from hypothesis import strategies as st
from one_class import one_class_step

from flipsync.board import BoardReader, BoardWriter, open_store
from flipsync.codec import ClassIndex, diff_views
from flipsync.codec.bits import dtype_of, int_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.domain.headers import ViewRef
from flipsync.engines.host_copy import HostCopy
from flipsync.engines.vllm.blockmap import (
    compress_map,
    copy_blocks,
    exact_int_base,
    expand_blocks,
    iter_chunks,
    lookup_blocks,
    probe_passes,
    read_as,
    write_bits,
)
from flipsync.engines.vllm.engine import VllmEngine
from flipsync.engines.vllm.rpc_transports import LocalTransport
from flipsync.engines.vllm.tensor_specs import specs_of
from flipsync.engines.vllm.wire import WorkerOpError, b64, unb64
from flipsync.engines.vllm.worker import WorkerCore
from flipsync.errors import (
    BaseMismatchError,
    ConfigError,
    CorruptPatchError,
    EngineError,
    PatchError,
    VerificationError,
)
from flipsync.sidecar.metrics import SidecarMetrics
from flipsync.sidecar.replica import Replica
from tests.codec.class_index_helpers import assert_index_current
from tests.sidecar.sidecar_helpers import FAST, fast_replica


# --------------------------------------------------------------------------------------- blocks
@given(st.integers(1, 40), st.integers(1, 40), st.integers(0, 3), st.data())
def test_blocks_roundtrip_for_row_and_column_shards(rows: int, cols: int, kind: int, data) -> None:
    """Contiguous, row-sharded, column-sharded and permuted maps compress, expand and look up exactly."""
    ckpt = np.arange(rows * cols, dtype=np.int64).reshape(rows, cols)
    if kind == 0:
        sel = ckpt.reshape(-1)
    elif kind == 1:
        sel = ckpt[: max(1, rows // 2)].reshape(-1)
    elif kind == 2:
        sel = ckpt[:, : max(1, cols // 2)].reshape(-1)
    else:
        sel = data.draw(st.permutations(list(range(rows * cols))))
        sel = np.array(sel[: max(1, len(sel) // 3)], dtype=np.int64)
    offset = data.draw(st.integers(0, 50))
    param = offset + np.arange(sel.size, dtype=np.int64)
    blocks = compress_map(sel, param)
    if kind < 3:
        assert len(blocks) == 1  # one affine block per shard
    c, p = expand_blocks(blocks)
    order = np.argsort(c)
    assert np.array_equal(c[order], np.sort(sel))
    truth = dict(zip(sel.tolist(), param.tolist(), strict=True))
    assert all(truth[int(ci)] == int(pi) for ci, pi in zip(c, p, strict=True))
    queries = np.unique(np.array(data.draw(st.lists(st.integers(0, rows * cols - 1), max_size=30)), dtype=np.int64))
    hit, pp = lookup_blocks(blocks, queries)
    assert {int(queries[h]): int(x) for h, x in zip(hit, pp, strict=True)} == {
        int(q): truth[int(q)] for q in queries if int(q) in truth
    }


@given(st.integers(1, 24), st.integers(1, 24), st.integers(0, 3), st.booleans(), st.data())
def test_block_copies_rebuild_the_checkpoint_as_the_index_path_does(
    rows: int, cols: int, kind: int, widened: bool, data
) -> None:
    """`copy_blocks` (one strided copy per block) writes the same bits as reading and writing through the expanded
    indices, for contiguous, sharded and permuted maps, parameters held in BF16 or widened to FP32, and a
    parameter that is a view into the middle of a larger storage; edge values (+/-0, subnormals, max, NaN, inf)
    included: bits are copied, never compared as floats."""
    ckpt = np.arange(rows * cols, dtype=np.int64).reshape(rows, cols)
    sel = [ckpt.reshape(-1), ckpt[: max(1, rows // 2)].reshape(-1), ckpt[:, ::2].reshape(-1)][kind % 3]
    if kind == 3:
        perm = data.draw(st.permutations(list(range(rows * cols))))
        sel = np.array(perm[: max(1, len(perm) // 2)], dtype=np.int64)
    lead, gap = data.draw(st.integers(0, 9)), data.draw(st.integers(0, 5))
    param_idx = lead + np.arange(sel.size, dtype=np.int64) * (1 + (gap if kind == 2 else 0))
    blocks = compress_map(sel, param_idx)
    edge = [0x0000, 0x8000, 0x0001, 0x807F, 0x7F7F, 0xFF7F, 0x7FC0, 0x7F80, 0xFF80]
    size = int(param_idx.max()) + 1
    values = st.lists(st.sampled_from(edge) | st.integers(0, 0xFFFF), min_size=size, max_size=size)
    bits = np.array(data.draw(values), dtype=np.uint16)
    if widened:  # an FP32 parameter holds BF16 values exactly; NaN payloads would not widen back exactly
        bits[(bits & 0x7F80) == 0x7F80] = 0x7F80
    held = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
    storage = torch.zeros(held.numel() + 7, dtype=torch.float32 if widened else torch.bfloat16)
    param = storage[3 : 3 + held.numel()]  # a view whose storage offset is not zero
    param.copy_(held.to(param.dtype))
    ck = dtype_of(held)
    want = torch.zeros(rows, cols, dtype=torch.bfloat16)
    for c, p in iter_chunks(blocks):
        write_bits(want, c, read_as(param, p, ck))
    got = torch.zeros(rows, cols, dtype=torch.bfloat16)
    copy_blocks(got, param, blocks, ck)
    assert torch.equal(int_view(got), int_view(want))


def test_block_copies_take_rows_that_run_backwards_on_the_parameter_side() -> None:
    """Blocks whose parameter rows run backwards (a permuted map) or repeat copy as the index path does; a block
    that breaks the format (checkpoint rows backwards or overlapping: `compress_map` never writes one) is refused."""
    ck = dtype_of(torch.zeros(1, dtype=torch.bfloat16))
    param = torch.arange(40, dtype=torch.int16).view(torch.bfloat16)
    for block in ([0, 30, 3, 4, 4, -7], [1, 2, 3, 4, 4, -0], [0, 5, 4, 3, 5, 0]):
        blocks = np.array([block], dtype=np.int64)
        want, got = torch.zeros(16, dtype=torch.bfloat16), torch.zeros(16, dtype=torch.bfloat16)
        for c, p in iter_chunks(blocks):
            write_bits(want, c, read_as(param, p, ck))
        copy_blocks(got, param, blocks, ck)
        assert torch.equal(int_view(got), int_view(want)), block
    for block in ([12, 30, 3, 4, -4, -7], [0, 0, 3, 4, 2, 3]):
        with pytest.raises(WorkerOpError, match="breaks the block format"):
            copy_blocks(torch.zeros(16, dtype=torch.bfloat16), param, np.array([block], dtype=np.int64), ck)


def test_a_request_array_that_is_not_base64_is_refused() -> None:
    # what base64.b64decode(validate=True) refused too: a character outside the alphabet, whitespace, a short
    # last group, padding in the middle or first
    for text in ("AAAA$AAA", "AAAA AAAA", "AAA", "AA=A", "=AAA"):
        with pytest.raises(WorkerOpError, match="not valid base64"):
            unb64(text, np.int32)
    assert unb64(b64(np.arange(3, dtype=np.int32)), np.int32).tolist() == [0, 1, 2]


def test_block_copies_refuse_what_does_not_fit() -> None:
    ck = dtype_of(torch.zeros(1, dtype=torch.bfloat16))
    out = torch.zeros(4, 4, dtype=torch.bfloat16)
    with pytest.raises(WorkerOpError, match="lies outside"):
        copy_blocks(out, torch.zeros(15, dtype=torch.bfloat16), compress_map(np.arange(16), np.arange(16)), ck)
    inexact = torch.full((16,), 1.0 + 2.0**-20, dtype=torch.float32)  # no BF16 value: not what was loaded
    with pytest.raises(WorkerOpError, match="not BF16 values"):
        copy_blocks(out, inexact, compress_map(np.arange(16), np.arange(16)), ck)


def test_probe_bases_are_exact() -> None:
    for dtype, base in [(torch.bfloat16, 256), (torch.float16, 2048), (torch.float8_e4m3fn, 16)]:
        assert exact_int_base(dtype) == base
        vals = torch.arange(1, base + 1, dtype=torch.float64)
        assert torch.equal(vals.to(dtype).to(torch.float64), vals)
        assert (torch.tensor(base + 1.0).to(dtype).item()) != base + 1
    assert probe_passes(256, 256) == 1 and probe_passes(257, 256) == 2 and probe_passes(20000, 256) == 2


# ------------------------------------------------------------------------------------------ maps
@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("packed", [False, True])
def test_learned_map_matches_the_loaders(size: int, packed: bool) -> None:
    view = checkpoint()
    pairs = boot(view, size=size, packed=packed)
    before = {id(m): {n: p.detach().clone() for n, p in m.named_parameters()} for m, _ in pairs}
    engine = VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(view))
    # probing never wrote into the live parameters
    for m, _ in pairs:
        assert all(torch.equal(p, before[id(m)][n]) for n, p in m.named_parameters())
    assert bits_equal(held_view(pairs, engine), view)
    assert engine.unheld == {}
    assert engine.table.view_fp() == FingerprintTable.of(view).view_fp()
    modes = {p: m.split(":")[0] for p, m in engine.modes().items()}
    assert modes["model.norm.weight"] == "inplace"
    assert modes["model.layers.0.self_attn.qkv_proj.weight"] == ("reload" if packed else "inplace")
    qkv = engine._maps["0"]["model.layers.0.self_attn.q_proj.weight"]
    assert [p for p, _ in qkv] == ["model.layers.0.self_attn.qkv_proj.weight"]
    o_proj = engine._maps["0"]["model.layers.0.self_attn.o_proj.weight"][0][1]
    assert len(o_proj) == 1  # column shard of a row-parallel layer: one strided block


# ---------------------------------------------------------------------------------------- apply
@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("packed", [False, True])
def test_patches_apply_bitwise_and_roll_back(size: int, packed: bool) -> None:
    v0 = checkpoint()
    v1, v2 = step(v0, 1), None
    v2 = step(v1, 2)
    pairs = boot(v0, size=size, packed=packed)
    engine = VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(v0), table=FingerprintTable.of(v0))
    p1, t1 = diff_views(v0, v1)
    p2, t2 = diff_views(v1, v2, old_table=t1)
    staged = engine.stage(p1)
    assert staged.n_changed > 0 and staged.target_view == t1.view_fp()
    assert bits_equal(held_view(pairs, engine), v0)  # staging writes nothing
    u1 = engine.commit(staged)
    assert engine.table.view_fp() == t1.view_fp()
    assert bits_equal(held_view(pairs, engine), v1)
    u2 = engine.commit(engine.stage(p2))
    assert bits_equal(held_view(pairs, engine), v2)
    assert engine.recompute_table().view_fp() == t2.view_fp()
    engine.rollback(u2)
    assert bits_equal(held_view(pairs, engine), v1) and engine.table.view_fp() == t1.view_fp()
    engine.rollback(u1)
    assert bits_equal(held_view(pairs, engine), v0) and engine.table.view_fp() == FingerprintTable.of(v0).view_fp()
    assert engine.recompute_table().view_fp() == FingerprintTable.of(v0).view_fp()


def test_wrong_base_and_corrupt_patches_change_nothing() -> None:
    v0 = checkpoint()
    v1 = step(v0, 1)
    pairs = boot(v0, size=2)
    engine = VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(v0))
    patch, _ = diff_views(v0, v1)
    engine.commit(engine.stage(patch))
    with pytest.raises(BaseMismatchError):
        engine.stage(patch)  # base is v0, the engine holds v1
    back, _ = diff_views(v1, v0)
    engine2 = VllmEngine(LocalTransport([c for _, c in boot(v0)]), specs_of(v0))
    with pytest.raises(BaseMismatchError):
        engine2.stage(back)
    # a patch whose target view lies: refused at stage
    forged, _ = diff_views(v0, step(v0, 9))
    forged = forged.with_refs(target=ViewRef("0" * 32))
    fresh = boot(v0)
    engine3 = VllmEngine(LocalTransport([c for _, c in fresh]), specs_of(v0))
    with pytest.raises((VerificationError, CorruptPatchError)):
        engine3.stage(forged)
    assert bits_equal(held_view(fresh, engine3), v0)


def test_a_failing_worker_undoes_every_worker() -> None:
    v0 = checkpoint()
    v1 = step(v0, 1)
    pairs = boot(v0, size=2, packed=True)
    engine = VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(v0))
    patch, _ = diff_views(v0, v1)
    staged = engine.stage(patch)
    core1 = pairs[1][1]
    real = core1._reload_modules
    calls = {"n": 0}

    def flaky(modules: set[str]) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated kernel repack failure")
        real(modules)

    core1._reload_modules = flaky  # type: ignore[method-assign]
    with pytest.raises(EngineError, match="simulated"):
        engine.commit(staged)
    assert bits_equal(held_view(pairs, engine), v0)
    assert engine.table.view_fp() == FingerprintTable.of(v0).view_fp()
    assert engine.recompute_table().view_fp() == FingerprintTable.of(v0).view_fp()


def test_load_view_replaces_everything_and_recompute_detects_drift() -> None:
    v0, other = checkpoint(0), checkpoint(5)
    pairs = boot(v0, size=2, packed=True)
    engine = VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(v0))
    engine.load_view(other)
    assert bits_equal(held_view(pairs, engine), other)
    assert engine.table.view_fp() == FingerprintTable.of(other).view_fp()
    # a replica diverges behind the sidecar's back: the audit says so
    norm = pairs[1][0].model.norm.weight
    int_view(norm.data)[0] += 1
    with pytest.raises(VerificationError, match="replicas"):
        engine.recompute_table()


def test_unheld_tensor_is_refused_with_a_reason() -> None:
    v0 = checkpoint()
    v0["extra.unused.weight"] = torch.zeros(3, dtype=torch.bfloat16)

    class Skipping(FakeLlama):
        def load_weights(self, weights):
            return super().load_weights((n, w) for n, w in weights if not n.startswith("extra."))

    model = Skipping(**DIMS)
    model.load_weights(v0.items())
    core = WorkerCore(model, policy=fake_policy, reloader=make_reloader(model))
    engine = VllmEngine(LocalTransport([core]), specs_of(v0), table=FingerprintTable.of(v0))
    assert "extra.unused.weight" in engine.unheld
    v1 = dict(v0)
    v1["extra.unused.weight"] = torch.ones(3, dtype=torch.bfloat16)
    patch, _ = diff_views(v0, v1)
    with pytest.raises(EngineError, match="does not hold"):
        engine.stage(patch)
    assert engine.recompute_table().view_fp() == FingerprintTable.of(v0).view_fp()


def test_transforming_loader_is_detected() -> None:
    v0 = checkpoint()

    class Scaling(FakeLlama):
        def load_weights(self, weights):
            return super().load_weights((n, w * 2 if n == "model.norm.weight" else w) for n, w in weights)

    model = Scaling(**DIMS)
    core = WorkerCore(model, policy=fake_policy)
    with pytest.raises(EngineError, match=r"transforms values|does not copy bits|decoded an index"):
        VllmEngine(LocalTransport([core]), specs_of(v0), table=FingerprintTable.of(v0))


# -------------------------------------------------------------------------- vLLM glue, without vLLM
def test_vllm_policy_decides_by_kernel_format() -> None:
    from flipsync.engines.vllm.scratch import vllm_policy

    def module(cls_name: str, quant: str | None, cpu_linear: bool) -> torch.nn.Module:
        m = type(cls_name, (torch.nn.Module,), {})()
        if quant is not None:
            m.quant_method = type(quant, (), {})()
        if cpu_linear:
            m.cpu_linear = torch.nn.functional.linear
        return m

    w = torch.zeros(4, 4)
    assert vllm_policy("n", module("RMSNorm", None, False), "weight", w)[0]
    assert vllm_policy("e", module("VocabParallelEmbedding", "UnquantizedEmbeddingMethod", True), "weight", w)[0]
    assert vllm_policy("q", module("QKVParallelLinear", "UnquantizedLinearMethod", False), "weight", w)[0]
    assert not vllm_policy("h", module("ParallelLMHead", "UnquantizedEmbeddingMethod", True), "weight", w)[0]
    assert not vllm_policy("q", module("QKVParallelLinear", "UnquantizedLinearMethod", True), "weight", w)[0]
    assert not vllm_policy("q", module("QKVParallelLinear", "Fp8LinearMethod", False), "weight", w)[0]
    assert not vllm_policy("q", module("QKVParallelLinear", None, False), "weight", torch.empty(0))[0]


def test_worker_extension_speaks_json() -> None:
    import json
    from types import SimpleNamespace

    from flipsync.engines.vllm.scratch import vllm_scratch
    from flipsync.engines.vllm.wire import PROTOCOL
    from flipsync.engines.vllm.worker import FlipsyncWorkerExtension

    v0 = checkpoint()
    model = FakeLlama(**DIMS)
    model.load_weights(v0.items())
    calls: list[int] = []

    class Worker(FlipsyncWorkerExtension):
        rank = 0
        model_runner = SimpleNamespace(reload_weights=lambda weights_iterator, is_checkpoint_format: calls.append(1))
        vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="no/such/dir"))

        def get_model(self) -> torch.nn.Module:
            return model

    w = Worker()
    assert json.loads(w.flipsync_call("not json"))["ok"] is False
    req = {"protocol": PROTOCOL, "op": "attach", "specs": {n: [list(t.shape), "BF16"] for n, t in v0.items()}}
    answer = json.loads(w.flipsync_call(json.dumps(req)))
    assert answer["ok"] and answer["rank"] == 0 and set(answer["result"]["maps"]) == set(v0)
    old = json.loads(w.flipsync_call(json.dumps({**req, "protocol": PROTOCOL + 1})))
    assert old["ok"] is False and "protocol" in old["error"]
    # without vLLM installed the scratch falls back to a zeroed copy of the live parameter
    s = vllm_scratch(model.model.norm, "weight", model.model.norm.weight)
    assert s.shape == model.model.norm.weight.shape and not s.any()


def test_a_patch_coded_against_its_base_is_refused_with_the_way_out() -> None:
    """The sidecar side holds no base values (they live in the workers), so a ``ctx`` patch cannot decode there."""
    v0 = checkpoint(0)
    pairs = boot(v0)
    engine = VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(v0), table=FingerprintTable.of(v0))
    v1 = one_class_step(v0)
    patch, _ = diff_views(v0, v1)
    assert patch.needs_base
    with pytest.raises(PatchError, match="host_copy=none"):
        engine.stage(patch)
    plain, _ = diff_views(v0, v1, context=False)
    engine.commit(engine.stage(plain))
    assert bits_equal(held_view(pairs, engine), v1)


def host_copy_of(view: dict[str, torch.Tensor], kind: str, tmp_path) -> dict[str, torch.Tensor] | HostCopy:
    if kind == "disk":
        return HostCopy.create(tmp_path / "host_copy.safetensors", view)
    return {k: v.clone() for k, v in view.items()}


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_mirror_lets_patches_coded_against_their_base_apply_and_roll_back(kind: str, tmp_path) -> None:
    v0 = checkpoint(0)
    v1 = one_class_step(v0)
    v2 = one_class_step(v1)
    pairs = boot(v0, size=2)
    host_copy = host_copy_of(v0, kind, tmp_path)
    engine = VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(v0), host_copy=host_copy)
    assert engine.host_view is host_copy and engine.adoptable
    p1, t1 = diff_views(v0, v1)
    p2, t2 = diff_views(v1, v2, old_table=t1)
    assert p1.needs_base and p2.needs_base
    u1 = engine.commit(engine.stage(p1))
    assert bits_equal(held_view(pairs, engine), v1) and bits_equal(dict(host_copy), v1)
    u2 = engine.commit(engine.stage(p2))  # decoded against the host copy the first commit wrote
    assert bits_equal(held_view(pairs, engine), v2) and bits_equal(dict(host_copy), v2)
    assert engine.recompute_table().view_fp() == t2.view_fp() == FingerprintTable.of(host_copy).view_fp()
    engine.rollback(u2)
    engine.rollback(u1)
    assert bits_equal(held_view(pairs, engine), v0) and bits_equal(dict(host_copy), v0)
    if kind == "disk":  # what a restarted sidecar maps again
        assert bits_equal(dict(HostCopy(tmp_path / "host_copy.safetensors")), v0)


def test_the_mirror_s_class_index_moves_with_commits_and_rollbacks() -> None:
    """The engine keeps a class index of its host copy (sparse ctx sections read only their blocks): every commit
    and rollback must leave it describing the host copy. The fake model's tensors are too small for the default
    index, so this one indexes every tensor."""
    v0 = checkpoint(0)
    v1, v2 = step(v0, 1), step(step(v0, 1), 2)
    pairs = boot(v0, size=2)
    host_copy = {k: v.clone() for k, v in v0.items()}
    engine = VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(v0), host_copy=host_copy)
    index = engine._index = ClassIndex(min_blocks=0)
    for name, t in host_copy.items():
        index.tree(name, int_view(t).reshape(-1).numpy().view(np.uint16), dtype_of(t), engine.table[name].fp)
    assert all(name in index for name in host_copy)
    p1, t1 = diff_views(v0, v1)
    p2, _ = diff_views(v1, v2, old_table=t1)
    u1 = engine.commit(engine.stage(p1))
    u2 = engine.commit(engine.stage(p2))
    assert bits_equal(dict(host_copy), v2)
    assert_index_current(index, host_copy, engine.table)
    engine.rollback(u2)
    assert_index_current(index, host_copy, engine.table)
    engine.rollback(u1)
    assert bits_equal(dict(host_copy), v0) and bits_equal(held_view(pairs, engine), v0)
    assert_index_current(index, host_copy, engine.table)
    assert all(name in index for name in host_copy)


def test_a_stale_mirror_is_not_used_until_a_full_load() -> None:
    v0 = checkpoint(0)
    v1 = one_class_step(v0)
    pairs = boot(v0)
    stale = {k: v.clone() for k, v in v0.items()}
    name = next(iter(stale))
    int_view(stale[name]).view(-1)[0] += 1
    engine = VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(v0), host_copy=stale)
    assert engine.host_view is None and not engine.adoptable  # a restarted sidecar resyncs instead
    patch, _ = diff_views(v0, v1)
    with pytest.raises(PatchError, match="host_copy"):
        engine.stage(patch)
    engine.load_view(v0)  # a keyframe: workers and host_copy hold it
    assert engine.host_view is stale and bits_equal(stale, v0)
    engine.commit(engine.stage(patch))
    assert bits_equal(held_view(pairs, engine), v1) and bits_equal(stale, v1)


def test_a_mirror_that_drifts_from_the_workers_is_refused_at_stage() -> None:
    v0 = checkpoint(0)
    v1 = one_class_step(v0)
    pairs = boot(v0)
    host_copy = {k: v.clone() for k, v in v0.items()}
    engine = VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(v0), host_copy=host_copy)
    plain, _ = diff_views(v0, v1, context=False)
    ch = next(iter(plain.changes()))
    int_view(host_copy[ch.name]).view(-1)[int(ch.positions[0])] += 1  # the host copy no longer holds what is served
    with pytest.raises(EngineError, match="host copy"):
        engine.stage(plain)
    assert engine.host_view is None
    assert bits_equal(held_view(pairs, engine), v0)  # nothing was written
    engine.commit(engine.stage(plain))  # a patch that needs no base still applies
    assert bits_equal(held_view(pairs, engine), v1)


def test_a_worker_that_drifts_from_the_mirror_refuses_the_write_staged_from_it() -> None:
    """With a current host copy the old bits come from it (no gather round trip through the engine); each write
    carries their digest, and a worker holding other bits there refuses before writing anything."""
    v0 = checkpoint(0)
    v1 = one_class_step(v0)
    pairs = boot(v0, size=2)
    host_copy = {k: v.clone() for k, v in v0.items()}
    engine = VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(v0), host_copy=host_copy)
    plain, _ = diff_views(v0, v1, context=False)
    ch = next(c for c in plain.changes() if "norm" not in c.name)
    staged = engine.stage(plain)
    rank = sorted(engine._maps, key=int)[-1]  # the last rank: the first may already have written
    pname, blocks = engine._maps[rank][ch.name][0]
    _model, core = pairs[sorted(engine._maps, key=int).index(rank)]
    _hit, ppos = lookup_blocks(blocks, ch.positions.astype(np.int64))
    target = core._target(pname, core._live_params())
    flat = int_view(target.data).view(-1)
    flat[int(ppos[0])] ^= 1  # the worker no longer holds what the host copy says
    before = held_view(pairs, engine)
    with pytest.raises(EngineError, match="host copy is no longer used"):
        engine.commit(staged)
    assert bits_equal(held_view(pairs, engine), before)  # every rank's writes undone or never made
    assert engine.host_view is None and engine.table.view_fp() == FingerprintTable.of(v0).view_fp()


def test_a_mirror_of_other_tensors_is_a_config_error() -> None:
    v0 = checkpoint(0)
    pairs = boot(v0)
    wrong = {k: v.clone() for k, v in v0.items()}
    wrong.pop(next(iter(wrong)))
    with pytest.raises(ConfigError, match="host copy"):
        VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(v0), host_copy=wrong)


@pytest.mark.parametrize("with_host_copy", [False, True])
def test_a_replica_follows_patches_coded_against_their_base_only_with_a_host_copy(
    with_host_copy: bool, tmp_path
) -> None:
    """Without a host copy such a patch is excluded as undecodable here (the replica keeps serving and waits for a
    keyframe past it); with one it applies like any other."""
    store = open_store(str(tmp_path / "board"), FAST)
    writer = BoardWriter(store, "run", publisher_id="t")
    v0 = checkpoint(0)
    t0 = FingerprintTable.of(v0)
    writer.publish_snapshot(v0, version=0, view_fp=t0.view_fp(), served_format="bf16")
    v1 = one_class_step(v0)
    patch, t1 = diff_views(v0, v1, old_table=t0, base_version=0, target_version=1, served_format="bf16")
    assert patch.needs_base
    writer.publish_patch(
        [patch.to_bytes()],
        base_version=0,
        target_version=1,
        base_view_fp=t0.view_fp(),
        target_view_fp=t1.view_fp(),
        served_format="bf16",
    )
    pairs = boot(v0)
    host_copy = {k: v.clone() for k, v in v0.items()} if with_host_copy else None
    engine = VllmEngine(LocalTransport([c for _, c in pairs]), specs_of(v0), host_copy=host_copy)
    rep = Replica(BoardReader(store, "run"), engine, config=fast_replica(), metrics=SidecarMetrics())
    if with_host_copy:
        assert rep.sync_once() and rep.version == 1
    else:
        assert not rep.sync_once()
        st = rep.status()
        assert rep.version == 0 and st["serving"] and st["error"]["kind"] == "undecodable"
        assert "host_copy" in st["error"]["message"]
        writer.publish_keyframe(v1, version=1, view_fp=t1.view_fp(), served_format="bf16")
        assert rep.sync_once() and rep.version == 1
        assert rep.status()["last_update"]["kind"] == "keyframe"
    assert bits_equal(held_view(pairs, engine), v1)


def test_the_sidecar_opens_or_creates_the_host_copy_file(tmp_path) -> None:
    """``--engine-option host_copy=FILE``: created from ``model_dir`` the first time, mapped as it is after."""
    from flipsync.checkpoint import save_checkpoint
    from flipsync.engines.host_copy import open_host_copy

    v0 = checkpoint(0)
    save_checkpoint(v0, tmp_path / "model")
    path = tmp_path / "host_copy" / "view.safetensors"
    with pytest.raises(ConfigError, match="model_dir"):
        open_host_copy(path, None)
    created = open_host_copy(path, str(tmp_path / "model"))
    assert bits_equal(dict(created), v0)
    int_view(created[next(iter(v0))]).view(-1)[0] += 1  # a commit written through the map
    created.flush()
    again = open_host_copy(path, str(tmp_path / "elsewhere"))  # exists: not recreated
    assert bits_equal(dict(again), dict(created)) and not bits_equal(dict(again), v0)
