"""Fixtures for the sidecar tests: a real local-directory board, a trainer publishing real patches of a tiny
Llama, torch engines, and sidecar stacks served by uvicorn on random loopback ports.

Everything binds to 127.0.0.1, every wait is bounded, and torch runs on one thread per test (CI has two
cores shared by two xdist workers).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from flipsync.engines.base import Engine
from flipsync.engines.torch.engine import TorchEngine
from flipsync.engines.torch.openai_server import create_engine_app
from flipsync.serving import ServerThread
from flipsync.sidecar.gate import CommitMode
from flipsync.sidecar.proxy import ProxyConfig
from flipsync.sidecar.service import Sidecar
from flipsync.stores import ObstoreStore, open_store
from tests.sidecar.sidecar_helpers import FAST, Stack, StackFactory, fast_replica, tiny_engine


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread (tests/sidecar/board_fixtures.py, with board_dir, store, trainer)."""


@pytest.fixture
def make_stack(board_dir: str) -> Iterator[StackFactory]:
    made: list[tuple[Stack, ObstoreStore]] = []

    def make(
        *,
        mode: CommitMode = CommitMode.IN_PLACE,
        fmt: str = "bf16",
        engine: Engine | None = None,
        start_loop: bool = True,
        upstream: str | None = None,
        read_timeout_s: float = 30.0,
        **replica_kw: float,
    ) -> Stack:
        wrapped = engine if engine is not None else tiny_engine(fmt)
        inner = getattr(wrapped, "inner", wrapped)
        assert isinstance(inner, TorchEngine)
        server = ServerThread(create_engine_app(inner, max_concurrency=4)).start()
        store = open_store(board_dir, FAST)
        sidecar = Sidecar(
            store,
            "run",
            wrapped,
            upstream or server.url,
            replica_config=fast_replica(mode, **replica_kw),
            proxy_config=ProxyConfig(upstream or server.url, admit_timeout_s=10.0, request_timeout_s=read_timeout_s),
        )
        if start_loop:
            sidecar.start()
        else:  # the proxy only: tests drive the replica with sync_once()
            sidecar.server = ServerThread(sidecar.app).start()
        client = httpx.Client(base_url=sidecar.url, timeout=30.0)
        stack = Stack(wrapped, inner, server, sidecar, client)
        made.append((stack, store))
        return stack

    yield make
    for stack, store in made:
        stack.client.close()
        stack.sidecar.stop()
        stack.engine_server.stop()
        store.close()
