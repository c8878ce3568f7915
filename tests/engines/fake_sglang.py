"""A fake SGLang server implementing the weight-update HTTP contract the ``sglang`` engine relies on.

Routes and payloads follow SGLang's ``http_server.py`` / ``io_struct.py``: ``POST /update_weights_from_disk``
with ``UpdateWeightFromDiskReqInput`` fields (``model_path``, ``load_format``, ``abort_all_requests``,
``weight_version``, ``flush_cache``, ...), answering ``{"success", "message", "num_paused_requests"}`` and
HTTP 400 on failure; ``GET /get_weight_version``; ``GET /get_model_info``; ``POST /get_weights_by_name``
``{"name", "truncate_size"}``; ``GET /health``. Loading a directory reads every ``*.safetensors`` file in it
and replaces whole tensors, as SGLang's ``load_weights`` does. Unknown body fields are refused (stricter
than SGLang) so that a typo in the client shows up here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from safetensors import safe_open


class UpdateWeightFromDiskReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


class GetWeightsByNameReqInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    truncate_size: int = 100


class FakeSglang:
    def __init__(self, weights: dict[str, torch.Tensor], model_path: str = "/models/start") -> None:
        self.weights = {n: t.clone() for n, t in weights.items()}
        self.weight_version: str | None = "default"
        self.model_path = model_path
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.loaded: list[list[str]] = []
        self.fail_next = False
        # faults of a real engine's reload path: tensors whose update is acknowledged but not applied (a stale
        # reload), and tensors the model holds in another layout than the checkpoint's (read back transposed)
        self.stale: set[str] = set()
        self.transposed: set[str] = set()
        # tensors whose reload comes out wrong at one row (name -> row): one element's lowest bit flipped
        self.wrong_row: dict[str, int] = {}
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        def health() -> dict:
            return {}

        @app.get("/get_weight_version")
        def get_weight_version() -> dict:
            return {"weight_version": self.weight_version}

        @app.get("/get_model_info")
        def get_model_info() -> dict:
            return {"model_path": self.model_path, "is_generation": True, "weight_version": self.weight_version}

        @app.post("/update_weights_from_disk")
        def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput) -> JSONResponse:
            self.calls.append(("update_weights_from_disk", obj.model_dump()))
            ok, message = self._load_dir(Path(obj.model_path))
            if ok and obj.weight_version is not None:
                self.weight_version = obj.weight_version
                message += f" Weight version updated to {obj.weight_version}."
            body = {"success": ok, "message": message, "num_paused_requests": 0}
            return JSONResponse(body, status_code=200 if ok else 400)

        @app.post("/get_weights_by_name")
        def get_weights_by_name(obj: GetWeightsByNameReqInput) -> JSONResponse:
            t = self.weights.get(obj.name)
            if t is None:
                return JSONResponse({"error": {"message": "Get parameter by name failed"}}, status_code=400)
            if obj.name in self.transposed and t.dim() == 2:
                t = t.t()
            return JSONResponse(t[: obj.truncate_size].to(torch.float32).tolist())

        return app

    def _load_dir(self, path: Path) -> tuple[bool, str]:
        if self.fail_next:
            self.fail_next = False
            return False, "Failed to update weights: injected failure.\nRolling back to original weights."
        if not path.is_dir():
            return False, f"Failed to get weights iterator: {path} is not a local directory."
        files = sorted(path.glob("*.safetensors"))
        if not files:
            return False, f"Failed to get weights iterator: no *.safetensors in {path}."
        staged: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    t = f.get_tensor(name)
                    cur = self.weights.get(name)
                    if cur is None or cur.shape != t.shape or cur.dtype != t.dtype:
                        return False, f"Failed to update weights: unexpected tensor {name}.\nRolling back."
                    staged[name] = t
        self.weights.update({n: t for n, t in staged.items() if n not in self.stale})
        for name, row in self.wrong_row.items():
            if name in staged:
                t = self.weights[name].clone()
                bits = t.view(torch.int16 if t.element_size() == 2 else torch.int32)
                bits[row].view(-1)[0] ^= 1
                self.weights[name] = t
        self.loaded.append(sorted(staged))
        self.model_path = str(path)
        return True, "Succeeded to update model weights."


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """Run ``app`` with uvicorn on 127.0.0.1 (an ephemeral port) in a thread; yields its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the fake server did not start within 15s")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
