"""Helpers for the fleet tests: sidecars that join the fleet, gateways over a board, an impostor server."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request

from flipsync.board.signing import Signer, Verifier
from flipsync.engines.torch.engine import TorchEngine
from flipsync.engines.torch.openai_server import create_engine_app
from flipsync.fleet.gateway import Gateway
from flipsync.fleet.pool import BoardPool, Pool
from flipsync.fleet.routing import GatewayConfig
from flipsync.serving import ServerThread
from flipsync.sidecar.heartbeat import MembershipConfig
from flipsync.sidecar.proxy import ProxyConfig
from flipsync.sidecar.service import Sidecar
from flipsync.stores import ObstoreStore, open_store
from tests.sidecar.sidecar_helpers import FAST, fast_replica, tiny_engine

# Fast beats: records change within a fraction of a second, and a dead replica expires in under two.
BEAT_S = 0.2
TTL_S = 1.5


@dataclass
class Member:
    """A torch engine behind its OpenAI server, and a sidecar in front of it that joined the fleet."""

    engine: TorchEngine
    engine_server: ServerThread
    sidecar: Sidecar
    store: ObstoreStore

    @property
    def url(self) -> str:
        return self.sidecar.url

    @property
    def replica_id(self) -> str:
        assert self.sidecar.heartbeat is not None
        return self.sidecar.heartbeat.replica_id

    def kill(self) -> None:
        """What a crash leaves: the proxy and loop stop, the record stays (and expires)."""
        self.sidecar.stop(deregister=False)
        self.engine_server.stop()


MemberFactory = Callable[..., Member]


class Members:
    def __init__(self, board_dir: str) -> None:
        self.board_dir = board_dir
        self.made: list[Member] = []

    def make(
        self,
        *,
        run: str = "run",
        fmt: str = "bf16",
        start_loop: bool = True,
        join: bool = True,
        signer: Signer | None = None,
        island: str = "local",
        model: str | None = None,
    ) -> Member:
        engine = tiny_engine(fmt)
        if model is not None:
            engine.model_name = model
        server = ServerThread(create_engine_app(engine, max_concurrency=4)).start()
        store = open_store(self.board_dir, FAST)
        sidecar = Sidecar(
            store,
            run,
            engine,
            server.url,
            replica_config=fast_replica(),
            proxy_config=ProxyConfig(server.url, admit_timeout_s=10.0, request_timeout_s=30.0),
        )
        if start_loop:
            sidecar.start()
        else:  # the proxy only: the test moves the replica with sync_once()
            sidecar.server = ServerThread(sidecar.app).start()
        if join:
            sidecar.join(
                MembershipConfig(public_url=sidecar.url, island=island, interval_s=BEAT_S, ttl_s=TTL_S, min_gap_s=0.02),
                signer=signer,
            )
        member = Member(engine, server, sidecar, store)
        self.made.append(member)
        return member

    def close(self) -> None:
        for m in self.made:
            m.sidecar.stop()
            m.engine_server.stop()
            m.store.close()


@dataclass
class GatewayUnderTest:
    gateway: Gateway
    server: ServerThread
    client: httpx.Client

    @property
    def url(self) -> str:
        return self.server.url

    def fleet(self) -> dict[str, Any]:
        return self.client.get("/flipsync/fleet").json()

    def complete(self, **body: Any) -> httpx.Response:
        return self.client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})


GatewayFactory = Callable[..., GatewayUnderTest]


def make_gateways(board_dir: str) -> tuple[GatewayFactory, Callable[[], None]]:
    made: list[GatewayUnderTest] = []

    def make(
        pool: Pool | None = None,
        *,
        member_verifier: Verifier | None = None,
        runs: tuple[str, ...] | None = None,
        **config: Any,
    ) -> GatewayUnderTest:
        if pool is None:
            pool = BoardPool(open_store(board_dir, FAST), runs=runs, member_verifier=member_verifier)
        cfg = GatewayConfig(**{"refresh_s": 0.1, "held_refresh_s": 0.05, "hold_s": 3.0, **config})
        gateway = Gateway(pool, cfg)
        server = ServerThread(gateway.app).start()
        g = GatewayUnderTest(gateway, server, httpx.Client(base_url=server.url, timeout=30.0))
        made.append(g)
        return g

    def close() -> None:
        for g in made:
            g.client.close()
            g.server.stop()
            g.gateway.pool.close()

    return make, close


def impostor() -> tuple[ServerThread, list[str]]:
    """An OpenAI-looking server that is no sidecar: it answers everything with a made-up version stamp. The
    list collects the paths it was asked for (it must stay empty when only trusted records route)."""
    hits: list[str] = []
    app = FastAPI()

    @app.post("/{path:path}")
    async def answer(request: Request, path: str) -> dict[str, Any]:
        hits.append(path)
        return {"choices": [{"text": "forged", "index": 0}], "weight_version": {"start": 999, "end": 999}}

    return ServerThread(app).start(), hits
