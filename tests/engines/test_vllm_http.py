"""The vLLM HTTP transport against a fake ``/collective_rpc`` route (vLLM's dev-mode contract) over loopback."""

from __future__ import annotations

import json

import pytest
import torch
from fake_sglang import serve
from fake_vllm import DIMS, FakeLlama, bits_equal, checkpoint, fake_policy, held_view, make_reloader, step
from fastapi import FastAPI, HTTPException, Request

from flipsync.codec import diff_views
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.vllm.engine import VllmEngine
from flipsync.engines.vllm.rpc_transports import HttpTransport
from flipsync.engines.vllm.tensor_specs import specs_of
from flipsync.engines.vllm.wire import RPC_METHOD
from flipsync.engines.vllm.worker import WorkerCore
from flipsync.errors import ConfigError, EngineUnavailableError


def fake_vllm_server(cores: list[WorkerCore], seen: list[dict]) -> FastAPI:
    """vLLM's POST /collective_rpc: {"method", "args": [str...], "kwargs", "timeout"} -> {"results": [...]}."""
    app = FastAPI()

    @app.post("/collective_rpc")
    async def collective_rpc(raw: Request) -> dict:
        body = await raw.json()
        seen.append(body)
        if body.get("method") != RPC_METHOD:
            raise HTTPException(status_code=500, detail=f"no method {body.get('method')}")
        args = body.get("args", [])
        assert all(isinstance(a, str) for a in args), "vLLM passes only string args over HTTP"
        assert isinstance(body.get("timeout"), int | float)
        return {"results": [json.dumps(c.handle(json.loads(args[0]))) for c in cores]}

    @app.get("/health")
    def health() -> dict:
        return {}

    return app


def test_engine_over_http_transport() -> None:
    v0 = checkpoint()
    v1 = step(v0, 3)
    pairs = []
    for rank in range(2):
        model = FakeLlama(**DIMS, rank=rank, size=2)
        model.load_weights(v0.items())
        pairs.append((model, WorkerCore(model, rank=rank, policy=fake_policy, reloader=make_reloader(model))))
    seen: list[dict] = []
    with serve(fake_vllm_server([c for _, c in pairs], seen)) as url:
        engine = VllmEngine(HttpTransport(url), specs_of(v0), table=FingerprintTable.of(v0))
        patch, t1 = diff_views(v0, v1)
        undo = engine.commit(engine.stage(patch))
        assert bits_equal(held_view(pairs, engine), v1)
        assert engine.recompute_table().view_fp() == t1.view_fp()
        engine.rollback(undo)
        assert bits_equal(held_view(pairs, engine), v0)
        assert engine.health()
        engine.close()
    assert [json.loads(b["args"][0])["op"] for b in seen] == ["attach", "gather", "apply", "fingerprint", "undo"]
    with pytest.raises(EngineUnavailableError):
        HttpTransport("http://127.0.0.1:9").call({"op": "describe"}, 2.0)
    assert HttpTransport("http://127.0.0.1:9").health() is False


def test_server_without_dev_mode_is_a_config_error() -> None:
    with serve(FastAPI()) as url, pytest.raises(ConfigError, match="VLLM_SERVER_DEV_MODE"):
        VllmEngine(HttpTransport(url), {"w": specs_of({"w": torch.zeros(2)})["w"]})


def test_the_sidecar_builds_the_engine_with_its_audit_settings(tmp_path) -> None:
    """``--engine-option audit=...`` / ``repair=...`` reach the workers; a wrong value is a config error."""
    from flipsync.checkpoint import save_checkpoint
    from flipsync.engines.registry import EngineOptions, load_engine

    v0 = checkpoint()
    save_checkpoint(v0, tmp_path / "model")
    model = FakeLlama(**DIMS)
    model.load_weights(v0.items())
    core = WorkerCore(model, policy=fake_policy, reloader=make_reloader(model))
    with serve(fake_vllm_server([core], [])) as url:
        opts = {"model_dir": str(tmp_path / "model"), "audit": "sample", "repair": "off"}
        engine = load_engine("vllm", EngineOptions(upstream_url=url, options=opts))
        assert engine.audit == "sample" and core.audit == "sample" and core.repair is False
        engine.close()
        for bad in ({"audit": "often"}, {"repair": "maybe"}):
            with pytest.raises(ConfigError, match=r"audit|repair"):
                load_engine("vllm", EngineOptions(upstream_url=url, options={"model_dir": opts["model_dir"], **bad}))
