"""`RolloutClient` given one URL in place of a list of islands: a gateway's, or a board's (the client reads
the member records and routes by the gateway's rules itself); through the openai client."""

from __future__ import annotations

import asyncio

import pytest

from flipsync.integrations.rollouts import RolloutClient, RolloutError
from tests.fleet.fleet_helpers import GatewayFactory, MemberFactory
from tests.sidecar.sidecar_helpers import Trainer, wait_until

pytest.importorskip("openai")

PROMPTS = ["one", "two", "three", "four", "five", "six"]


def test_a_gateway_url(trainer: Trainer, make_member: MemberFactory, make_gateway: GatewayFactory) -> None:
    a, b = make_member(), make_member(start_loop=False)
    trainer.step()
    trainer.step()
    assert wait_until(lambda: a.sidecar.replica.version == 2)
    assert b.sidecar.replica.sync_once()
    gw = make_gateway(max_lag=0)
    assert wait_until(lambda: gw.fleet()["ready"] == 2)

    async def loop() -> None:
        async with RolloutClient(gw.url + "/v1", max_staleness=1, patience_s=20.0) as client:
            assert client.islands == [gw.url + "/v1"]
            batch = await client.collect(PROMPTS, version=2, max_tokens=3)
            assert len(batch.kept) == len(PROMPTS) and {r.version_start for r in batch.kept} == {2}
            assert client.model == "flipsync-torch" and client.stats.refused == 0
            trainer.step()
            assert await asyncio.to_thread(wait_until, lambda: a.sidecar.replica.version == 3)
            # b stays at v2: the gateway sends min_version 3 to a only, and the client never sees a refusal.
            batch = await client.collect(PROMPTS, version=4, max_tokens=3)  # min_version 3
            assert {r.version_start for r in batch.kept} == {3} and client.stats.refused == 0
            chat = await client.complete([{"role": "user", "content": "hi"}], exact_version=2, max_tokens=2)
            assert chat.version_start == 2  # only b holds it
        async with RolloutClient(gw.url + "/v1", patience_s=1.0) as impatient:
            with pytest.raises(RolloutError, match="no island served"):
                await impatient.complete("x", exact_version=99, max_tokens=2)

    asyncio.run(loop())


def test_a_board_url(board_dir: str, trainer: Trainer, make_member: MemberFactory) -> None:
    a, b = make_member(), make_member(start_loop=False)
    assert b.sidecar.replica.sync_once() and b.sidecar.replica.version == 0
    for _ in range(3):
        trainer.step()
    assert wait_until(lambda: a.sidecar.replica.version == 3)

    async def loop() -> None:
        async with RolloutClient(board_dir, max_staleness=1, refresh_s=0.2, patience_s=20.0) as client:
            assert client.pool is not None and client.islands == []
            # Unconstrained requests: only the replica within max_lag (1) of HEAD (3).
            for _ in range(4):
                r = await client.complete("hi", max_tokens=2)
                assert (r.island, r.version_start) == (a.url + "/v1", 3)
            old = await client.complete("hi", exact_version=0, max_tokens=2)
            assert old.island == b.url + "/v1"
            assert b.sidecar.replica.sync_once() and b.sidecar.replica.version == 3
            a.kill()
            # a's record lingers until it expires, as ready as b's: requests that try a first fail over to b.
            for _ in range(6):
                r = await client.complete("hi", max_tokens=2)
                assert (r.island, r.version_start) == (b.url + "/v1", 3)
            assert client.stats.per_island[b.url + "/v1"] >= 7

    asyncio.run(loop())
