"""The async rollout loop of flipsync.integrations.rollouts against two real islands (torch engines behind
sidecars on loopback, following a board the trainer publishes real patches to), through the openai client."""

from __future__ import annotations

import asyncio

import pytest

from flipsync.integrations.rollouts import RolloutClient, RolloutError
from tests.sidecar.sidecar_helpers import StackFactory, Trainer, wait_until

pytest.importorskip("openai")

PROMPTS = ["the trainer", "a sidecar", "hello", "every replica", "one", "two"]


def test_rollout_loop_constraints_versions_and_staleness(trainer: Trainer, make_stack: StackFactory) -> None:
    fast = make_stack()  # follows the board by itself
    slow = make_stack(start_loop=False)  # moves only when the test says so
    trainer.step()
    trainer.step()
    assert slow.replica.sync_once() and slow.replica.version == 2
    assert wait_until(lambda: fast.replica.version == 2)
    islands = [fast.sidecar.url + "/v1", slow.sidecar.url + "/v1"]

    async def loop() -> None:
        async with RolloutClient(islands, max_staleness=1, patience_s=20.0) as client:
            # 1. Both islands at v2: every prompt sampled, round-robin over both, every rollout tagged v2.
            batch = await client.collect(PROMPTS, version=2, max_tokens=4, temperature=0.0)
            assert len(batch.kept) == len(PROMPTS) and not batch.dropped
            assert {(r.version_start, r.version_end) for r in batch.kept} == {(2, 2)}
            assert all(n > 0 for n in client.stats.per_island.values())
            assert all(isinstance(r.text, str) for r in batch.kept)

            # 2. The trainer moves on to v4; the slow island stays on v2. Asking for min_version 3 (v4 with a
            #    staleness bound of 1), the slow island refuses (409) and the fast one serves every request.
            trainer.step()
            trainer.step()
            assert await asyncio.to_thread(wait_until, lambda: fast.replica.version == 4)
            before = dict(client.stats.per_island)
            batch = await client.collect(PROMPTS, version=4, max_tokens=4)
            assert len(batch.kept) == len(PROMPTS)
            assert all(r.version_start >= 3 and r.island == islands[0] for r in batch.kept)
            assert client.stats.refused >= 1
            assert client.stats.per_island[islands[1]] == before[islands[1]]

            # 3. Rollouts sampled at v2, consumed when the trainer is at v4: two versions behind, dropped.
            old = await client.complete("hello", exact_version=2, max_tokens=4)  # only the slow island has v2
            assert (old.island, old.version_start, old.version_end) == (islands[1], 2, 2)
            assert not client.fresh(old, 4) and client.fresh(old, 3)
            # Sampled on-policy at v2 (exact), judged when they come back against the trainer's v4.
            batch = await client.collect(["hello", "one"], version=2, exact=True, current=lambda: 4, max_tokens=4)
            assert len(batch.dropped) == 2 and not batch.kept
            assert {r.version_start for r in batch.dropped} == {2}
            assert client.stats.dropped == 2

            # 4. Chat completions are tagged the same way.
            chat = await client.complete([{"role": "user", "content": "hi"}], min_version=4, max_tokens=4)
            assert chat.version_start == 4 and chat.island == islands[0]

        # 5. A version nobody will serve: a clear error once the client's patience runs out.
        async with RolloutClient(islands, patience_s=1.5) as impatient:
            with pytest.raises(RolloutError, match="no island served"):
                await impatient.complete("hello", exact_version=99, max_tokens=2)

    asyncio.run(loop())
