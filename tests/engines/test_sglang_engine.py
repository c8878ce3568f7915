"""The ``sglang`` engine against a fake SGLang server that implements the HTTP weight-update contract.

SGLang has no CPU build that runs here, so these tests check the engine against the documented routes and
payloads (``fake_sglang.FakeSglang``), not against SGLang itself.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from fake_sglang import FakeSglang, serve
from one_class import one_class_step

from flipsync.codec import diff_views
from flipsync.codec.bits import int_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.host_copy import HostCopy
from flipsync.engines.sglang import SglangEngine
from flipsync.errors import BaseMismatchError, ConfigError, EngineError, EngineUnavailableError


def view0() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(32, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
        "model.norm.weight": torch.randn(8, generator=g).to(torch.float32),
        "scale": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
    }


def nudge(view: dict[str, torch.Tensor], names: list[str]) -> dict[str, torch.Tensor]:
    out = dict(view)
    for n in names:
        bits = int_view(view[n].clone()).clone()
        bits[:3] += 1
        out[n] = bits.view(view[n].dtype).reshape(view[n].shape)
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(int_view(a[n].contiguous()), int_view(b[n].contiguous())) for n in a
    )


@pytest.fixture
def setup(tmp_path):
    v0 = view0()
    fake = FakeSglang(v0)
    with serve(fake.app) as url:
        host_copy = HostCopy.create(tmp_path / "host_copy" / "model.safetensors", v0)
        engine = SglangEngine(url, host_copy, staging_dir=tmp_path / "staging", timeout_s=30)
        yield v0, fake, engine, url, tmp_path
        engine.close()


def test_disk_mirror_is_a_writable_map_of_the_file(tmp_path) -> None:
    v0 = view0()
    m = HostCopy.create(tmp_path / "m.safetensors", v0)
    assert same(dict(m), v0)
    int_view(m["model.norm.weight"])[0] += 1
    m.flush()
    again = HostCopy(tmp_path / "m.safetensors")
    assert int(int_view(again["model.norm.weight"])[0]) == int(int_view(v0["model.norm.weight"])[0]) + 1
    from safetensors.torch import load_file

    assert same(load_file(tmp_path / "m.safetensors"), dict(again))  # still a valid safetensors file


def test_patch_reaches_the_server_and_rolls_back(setup) -> None:
    v0, fake, engine, _url, _ = setup
    touched = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "scale"]
    v1 = nudge(v0, touched)
    patch, t1 = diff_views(v0, v1, base_version=0, target_version=1)
    assert engine.weight_version == "default"
    staged = engine.stage(patch)
    assert fake.calls == []  # staging talks to nobody
    assert staged.target_view == t1.view_fp() and staged.n_changed == 9
    undo = engine.commit(staged)
    # the server loaded exactly the touched tensors, whole, and stamped the version
    assert fake.loaded == [sorted(touched)]
    body = fake.calls[-1][1]
    assert body["weight_version"] == "1" and body["flush_cache"] is True and body["abort_all_requests"] is False
    assert body["model_path"] == str(staged.update_dir)
    assert same(fake.weights, v1)
    assert engine.weight_version == "1"
    assert engine.table.view_fp() == t1.view_fp() == engine.recompute_table().view_fp()
    assert engine.sample_check(["model.embed_tokens.weight", "model.norm.weight"]) == {
        "model.embed_tokens.weight": True,
        "model.norm.weight": True,
    }
    engine.rollback(undo)
    assert same(fake.weights, v0) and fake.weight_version == "default" and engine.weight_version == "default"
    assert engine.table.view_fp() == FingerprintTable.of(v0).view_fp() == engine.recompute_table().view_fp()


def test_a_refused_update_changes_nothing(setup) -> None:
    v0, fake, engine, _url, _ = setup
    v1 = nudge(v0, ["model.norm.weight"])
    patch, _ = diff_views(v0, v1, target_version=1)
    staged = engine.stage(patch)
    fake.fail_next = True
    with pytest.raises(EngineError, match="injected failure"):
        engine.commit(staged)
    # the engine pushed the old values again (recovery) and kept its host copy, table and version
    assert [c[1]["model_path"] for c in fake.calls] == [str(staged.update_dir), str(staged.undo_dir)]
    assert same(fake.weights, v0)
    assert engine.table.view_fp() == FingerprintTable.of(v0).view_fp() == engine.recompute_table().view_fp()
    assert engine.weight_version == "default"


def test_wrong_base_is_refused_before_any_request(setup) -> None:
    v0, fake, engine, _url, _ = setup
    v1 = nudge(v0, ["model.norm.weight"])
    v2 = nudge(v1, ["model.norm.weight"])
    patch, _ = diff_views(v1, v2)
    with pytest.raises(BaseMismatchError):
        engine.stage(patch)
    assert fake.calls == []


def test_unreachable_server_is_reported(setup) -> None:
    v0, _fake, engine, _url, _ = setup
    patch, _ = diff_views(v0, nudge(v0, ["model.norm.weight"]))
    staged = engine.stage(patch)
    engine.base_url = "http://127.0.0.1:9"  # discard port: connection refused
    with pytest.raises(EngineUnavailableError):
        engine.commit(staged)
    assert engine.table.view_fp() == FingerprintTable.of(v0).view_fp()
    assert engine.health() is False


def test_load_view_replaces_everything(setup) -> None:
    v0, fake, engine, _url, _ = setup
    other = {n: torch.zeros_like(t) for n, t in v0.items()}
    engine.load_view(other)
    assert same(fake.weights, other)
    assert engine.table.view_fp() == FingerprintTable.of(other).view_fp()
    with pytest.raises(ConfigError):
        engine.load_view({"x": torch.zeros(1)})


def test_missing_route_says_what_to_do(tmp_path) -> None:
    from fastapi import FastAPI

    with serve(FastAPI()) as url, pytest.raises(ConfigError, match="no route /get_weight_version"):
        SglangEngine(url, dict(view0()), staging_dir=tmp_path, client=httpx.Client(timeout=5.0))


def test_a_patch_coded_against_its_base_decodes_from_the_host_copy(setup) -> None:
    """The host_copy is the sidecar's view of the server, so ``ctx`` patches (and multi-part versions coded
    against their base) decode from it: ``host_view`` is the host copy."""
    v0, fake, engine, _url, _ = setup
    v1 = one_class_step(v0, "model.embed_tokens.weight")
    patch, t1 = diff_views(v0, v1)
    assert patch.needs_base and engine.host_view is not None
    engine.commit(engine.stage(patch))
    assert same(fake.weights, v1) and same(dict(engine.host_view), v1)
    assert engine.table.view_fp() == t1.view_fp()


# ------------------------------------------------------------------------------------- the read-back audit
def test_an_update_sglang_acknowledges_but_does_not_hold_is_undone_and_raised(tmp_path) -> None:
    """A stale reload path (success answered, old values kept): the audit reads the touched tensors back
    through /get_weights_by_name, pushes the undo checkpoint and raises; the table and the host copy stay."""
    v0 = view0()
    fake = FakeSglang(v0)
    with serve(fake.app) as url:
        engine = SglangEngine(url, HostCopy.create(tmp_path / "m.safetensors", v0), staging_dir=tmp_path / "s")
        assert engine.auditable == set(v0)
        v1 = nudge(v0, ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"])
        patch, t1 = diff_views(v0, v1)
        fake.stale = {"model.norm.weight"}
        before = engine.table.view_fp()
        with pytest.raises(EngineError, match=r"reads back other values for model\.norm\.weight.*undone"):
            engine.commit(engine.stage(patch))
        assert engine.table.view_fp() == before and same(dict(engine.host_view), v0)
        assert same(fake.weights, v0)  # the undo checkpoint was pushed
        fake.stale = set()
        engine.commit(engine.stage(patch))
        assert engine.table.view_fp() == t1.view_fp() and same(fake.weights, v1)
        assert set(engine.last_audit) == {"model.layers.0.self_attn.q_proj.weight", "model.norm.weight"}
        engine.close()


def test_tensors_held_in_another_layout_are_not_audited(tmp_path) -> None:
    v0 = view0()
    fake = FakeSglang(v0)
    fake.transposed = {"model.layers.0.self_attn.q_proj.weight"}  # e.g. an FP8 weight kept as its .t()
    with serve(fake.app) as url:
        with pytest.raises(ConfigError, match=r"does not read back 1 of 5 tensors.*q_proj.*unreadable='skip'"):
            SglangEngine(url, HostCopy.create(tmp_path / "r.safetensors", v0), staging_dir=tmp_path / "r")
        engine = SglangEngine(url, HostCopy.create(tmp_path / "m.safetensors", v0), staging_dir=tmp_path / "s",
                              audit="sample", unreadable="skip")  # fmt: skip
        assert "model.layers.0.self_attn.q_proj.weight" not in engine.auditable
        assert engine.unaudited == ["model.layers.0.self_attn.q_proj.weight"]
        v1 = nudge(v0, ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"])
        patch, _ = diff_views(v0, v1)
        engine.commit(engine.stage(patch))
        assert engine.last_audit == ["model.norm.weight"]  # sample: one auditable touched tensor
        engine.close()
    with pytest.raises(ConfigError, match="audit"):
        SglangEngine("http://127.0.0.1:9", {}, audit="sometimes")


def test_with_the_audit_off_a_stale_update_goes_unseen(tmp_path) -> None:
    v0 = view0()
    fake = FakeSglang(v0)
    fake.stale = {"model.norm.weight"}
    with serve(fake.app) as url:
        engine = SglangEngine(url, HostCopy.create(tmp_path / "m.safetensors", v0), staging_dir=tmp_path / "s",
                              audit="off")  # fmt: skip
        patch, t1 = diff_views(v0, nudge(v0, ["model.norm.weight"]))
        engine.commit(engine.stage(patch))
        assert engine.table.view_fp() == t1.view_fp() and not same(fake.weights, dict(engine.host_view))
        engine.close()


def test_a_tensor_that_differs_after_row_2_is_caught(tmp_path) -> None:
    """Blind spot 7: the read-back compared the first 2 rows of a touched tensor; a reload that gets row 20 of
    the embedding wrong must be refused (whole tensors are read back)."""
    v0 = view0()
    fake = FakeSglang(v0)
    with serve(fake.app) as url:
        engine = SglangEngine(url, HostCopy.create(tmp_path / "m.safetensors", v0), staging_dir=tmp_path / "s")
        v1 = nudge(v0, ["model.embed_tokens.weight"])
        patch, t1 = diff_views(v0, v1)
        fake.wrong_row = {"model.embed_tokens.weight": 20}
        with pytest.raises(EngineError, match=r"reads back other values for model\.embed_tokens\.weight.*whole"):
            engine.commit(engine.stage(patch))
        assert same(dict(engine.host_view), v0)
        fake.wrong_row = {}
        engine.commit(engine.stage(patch))
        assert engine.table.view_fp() == t1.view_fp() and same(fake.weights, v1)
        engine.close()
