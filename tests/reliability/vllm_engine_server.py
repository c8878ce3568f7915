"""A stand-in for ``vllm serve`` in a process of its own, so that it outlives the sidecars killed in front of it.

Two tensor-parallel fake vLLM workers (``tests/engines/fake_vllm.py``: real ``WorkerCore`` objects over a
model that loads a Llama checkpoint the way vLLM does) behind vLLM's dev-mode ``POST /collective_rpc``
contract (the fake server of ``tests/engines/test_vllm_http.py``), plus two test routes that read what the
workers' kernels compute from, through the maps the workers learned:

- ``GET /test/held``: the held view as safetensors bytes (checkpoint names and shapes);
- ``POST /v1/completions``: an "answer" that carries ``held_view_fp``, the fingerprint of the view the request
  was served on, so a client of the sidecar's proxy can check it against the version it was told.

All routes are ``async``: they run one at a time on the event loop, like vLLM's engine core serializes
``collective_rpc`` with its steps. Usage: ``python vllm_engine_server.py SEED`` prints the base URL, then
serves until it is killed. The workers boot from ``fake_vllm.checkpoint(SEED)``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch
from fastapi import FastAPI, Response
from safetensors.torch import save

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engines"))

from fake_vllm import FakeLlama, WorkerCore, boot, checkpoint
from test_vllm_http import fake_vllm_server

from flipsync.codec.bits import dtype_named, int_view
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.engines.vllm.blockmap import expand_blocks
from flipsync.serving import ServerThread

TP = 2


def held_view(pairs: list[tuple[FakeLlama, WorkerCore]]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors reassembled from what the fake kernels compute from, rank by rank."""
    first = pairs[0][1]
    out: dict[str, torch.Tensor] = {}
    for name, (shape, dname) in first.specs.items():
        numel = int(np.prod(shape)) if shape else 1
        flat = torch.zeros(numel, dtype=dtype_named(dname).torch_dtype)
        seen = np.zeros(numel, dtype=bool)
        for model, core in pairs:
            for pname, blocks in core.maps.get(name, []):
                c, p = expand_blocks(blocks)
                int_view(flat).numpy()[c] = int_view(model.effective(pname).contiguous()).numpy()[p]
                seen[c] = True
        if not seen.all():
            raise RuntimeError(f"no worker holds all of {name!r}")
        out[name] = flat.reshape(shape)
    return out


def create_app(seed: int) -> FastAPI:
    pairs = boot(checkpoint(seed), size=TP)
    app = fake_vllm_server([core for _, core in pairs], [])

    @app.get("/test/held")
    async def held() -> Response:
        if not all(core.attached for _, core in pairs):
            return Response("not attached yet", status_code=409)
        return Response(save(held_view(pairs)), media_type="application/octet-stream")

    @app.post("/v1/completions")
    async def completions() -> dict:
        fp = FingerprintTable.of(held_view(pairs)).view_fp() if all(c.attached for _, c in pairs) else None
        return {
            "object": "text_completion",
            "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
            "held_view_fp": fp,
        }

    return app


def main() -> None:
    torch.set_num_threads(1)
    server = ServerThread(create_app(int(sys.argv[1]))).start()
    print(server.url, flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
