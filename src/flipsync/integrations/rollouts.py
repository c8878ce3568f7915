"""`RolloutClient`: rollouts from the islands in your own async loop with the ``openai`` client, version
constraints sent, each completion's version read back, stale rollouts dropped. See docs/integrations/rollouts.md."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from flipsync.domain.fleet import MemberRecord, Want, admits, floor_version, rank
from flipsync.errors import ConfigError, FlipsyncError
from flipsync.fleet.pool import BoardPool, FleetSnapshot, Pool

log = logging.getLogger(__name__)

BODY_FIELD = "weight_version"  # the proxy's request constraint and response tag (flipsync.sidecar.proxy)
H_START = "x-flipsync-weight-version-start"
H_END = "x-flipsync-weight-version-end"
H_MIN = "X-Flipsync-Min-Version"


class RolloutError(FlipsyncError):
    """No island could serve a request within the client's patience (all behind, booting or down)."""


@dataclass(frozen=True)
class Rollout:
    """One completion and the policy versions that produced it."""

    prompt: str | Sequence[Mapping[str, Any]]
    text: str
    island: str  # the base URL of the proxy that served it
    version_start: int  # the version when generation started (the oldest weights it used)
    version_end: int  # the version when it finished (>= start)
    finish_reason: str | None = None

    def staleness(self, version: int) -> int:
        """How many versions the weights that started this rollout are behind ``version``."""
        return version - self.version_start


@dataclass
class Batch:
    """The result of `RolloutClient.collect`: fresh rollouts and the stale ones it dropped."""

    kept: list[Rollout] = field(default_factory=list)
    dropped: list[Rollout] = field(default_factory=list)


@dataclass
class RolloutStats:
    """Counters over a client's life."""

    sampled: int = 0  # completions received
    dropped: int = 0  # of them, dropped as too stale
    refused: int = 0  # 409 (behind the constraint) and 503 (no verified version) answers, retried elsewhere
    per_island: dict[str, int] = field(default_factory=dict)


class RolloutClient:
    """Samples completions from island proxies with ``openai.AsyncOpenAI``.

    ``islands``: the proxies' OpenAI base URLs (``http://HOST:PORT/v1``); or one URL: a gateway's (any
    http(s) URL) or a board's (``s3://``, ``file://``, a path, ...), or a `Pool`. ``model``: the model name
    sent (default: the first one the first island lists). ``max_staleness``: how many versions a rollout's
    start may be behind the trainer's. ``patience_s``: how long one request keeps trying refusing islands
    before `RolloutError`. ``client_options`` go to ``AsyncOpenAI``. With a board or pool: ``max_lag``
    (default ``max_staleness``) bounds how far behind HEAD a replica may serve unconstrained requests, and
    the replicas are looked up again every ``refresh_s``.
    """

    def __init__(
        self,
        islands: Sequence[str] | str | Pool,
        *,
        model: str | None = None,
        max_staleness: int = 1,
        patience_s: float = 120.0,
        api_key: str = "flipsync",
        max_lag: int | None = None,
        refresh_s: float = 2.0,
        **client_options: Any,
    ) -> None:
        try:
            from openai import AsyncOpenAI
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ConfigError("the rollout client needs the openai package: pip install 'flipsync[rollouts]'") from e
        if max_staleness < 0 or not patience_s > 0:
            raise ConfigError(f"max_staleness must be >= 0 and patience_s > 0, got {max_staleness}, {patience_s}")
        if isinstance(islands, str):
            if islands.startswith(("http://", "https://")):  # a gateway (or one proxy)
                islands = [islands]
            else:  # a board: its member records name the replicas
                from flipsync.stores import open_store

                islands = BoardPool(open_store(islands))
        self.pool = islands if isinstance(islands, Pool) else None
        if not isinstance(islands, Pool) and not islands:
            raise ConfigError("give at least one island proxy URL (http://HOST:PORT/v1), a gateway's or a board's URL")
        # Retries are ours: a refusing island is skipped for the next, and the wait honours Retry-After.
        self._make_client = lambda url: AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, **client_options)
        self.islands = [] if isinstance(islands, Pool) else [u.rstrip("/") for u in islands]
        self.clients = {u: self._make_client(u) for u in self.islands}
        self.model = model
        self.max_staleness = max_staleness
        self.max_lag = max_staleness if max_lag is None else max_lag
        self.patience_s = patience_s
        self.refresh_s = refresh_s
        self.stats = RolloutStats(per_island={u: 0 for u in self.islands})
        self._next = itertools.cycle(range(max(1, len(self.islands))))
        self._snapshot: FleetSnapshot | None = None
        self._snapshot_at = 0.0
        self._in_flight: dict[str, int] = {}
        self._rng = random.Random()  # ties between equally loaded replicas

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        for c in self.clients.values():
            await c.close()
        if self.pool is not None:
            self.pool.close()

    # -- where to send ------------------------------------------------------------------------------------

    def _client(self, url: str) -> Any:
        if url not in self.clients:
            self.clients[url] = self._make_client(url)
            self.stats.per_island.setdefault(url, 0)
        return self.clients[url]

    async def _fleet(self) -> FleetSnapshot:
        assert self.pool is not None
        if self._snapshot is None or time.monotonic() - self._snapshot_at >= self.refresh_s:
            try:
                self._snapshot = await asyncio.to_thread(self.pool.discover_replicas)
                self._snapshot_at = time.monotonic()
            except FlipsyncError as e:
                if self._snapshot is None:
                    raise RolloutError(f"cannot find the fleet's replicas: {e}") from e
                log.warning("cannot refresh the fleet (using the last look at it): %s", e)
        return self._snapshot

    async def _targets(self, want: Want) -> list[tuple[str, dict[str, str]]]:
        """(base URL, extra headers) to try, in order: every island round-robin, or the fleet's replicas that
        may serve ``want``, least loaded first (unconstrained: ready ones, asked for HEAD - max_lag at least)."""
        if self.pool is None:
            k = next(self._next)
            return [(u, {}) for u in self.islands[k:] + self.islands[:k]]
        snap = await self._fleet()
        ready: list[MemberRecord] = [r for r in snap.members if admits(r, want, snap.head(r), self.max_lag)]
        ranked = [(r, floor_version(want, snap.head(r), self.max_lag)) for r in rank(ready, self._in_flight, self._rng)]
        return [(r.url.rstrip("/") + "/v1", {H_MIN: str(floor)} if floor is not None else {}) for r, floor in ranked]

    # -- one request ----------------------------------------------------------------------------------

    async def _model(self) -> str:
        if self.model is None:
            if self.pool is not None:
                snap = await self._fleet()
                if not snap.members:
                    raise RolloutError("the fleet has no live replica to ask for its model name; pass model=")
                self.model = snap.members[0].model
            else:
                models = await self._client(self.islands[0]).models.list()
                if not models.data:
                    raise RolloutError(f"{self.islands[0]} lists no model; pass model=")
                self.model = models.data[0].id
        return self.model

    async def complete(
        self,
        prompt: str | Sequence[Mapping[str, Any]],
        *,
        min_version: int | None = None,
        exact_version: int | None = None,
        **params: Any,
    ) -> Rollout:
        """One completion (a ``str`` prompt) or chat completion (a list of messages) from some island that
        satisfies the constraint; ``params`` go to the OpenAI call (``max_tokens``, ``temperature``, ...)."""
        import openai

        constraint = {
            k: v for k, v in (("min_version", min_version), ("exact_version", exact_version)) if v is not None
        }
        body = {**params.pop("extra_body", {}), **({BODY_FIELD: constraint} if constraint else {})}
        extra_headers = dict(params.pop("extra_headers", None) or {})
        given = {"prompt": prompt} if isinstance(prompt, str) else {"messages": list(prompt)}
        model = await self._model()
        name, _, fmt = model.partition("@")  # NAME@FORMAT: one served format (a gateway reads it too)
        want = Want(min_version=min_version, exact_version=exact_version, model=name, served_format=fmt or None)
        if self.pool is not None:
            model = name  # sent straight to a replica, which knows its model by name
        deadline = time.monotonic() + self.patience_s
        last = ""
        while True:
            wait_s = 0.0
            targets = await self._targets(want)
            if not targets:
                last = f"no live replica of the fleet serves {want.describe()}"
                wait_s = 0.5
                self._snapshot_at = 0.0  # a fleet: look again before the next try
            for url, headers in targets:
                client = self._client(url)
                api = client.completions if isinstance(prompt, str) else client.chat.completions
                sent = {**extra_headers, **headers}
                self._in_flight[url] = self._in_flight.get(url, 0) + 1
                try:
                    raw = await api.with_raw_response.create(
                        model=model, extra_body=body, extra_headers=sent, **given, **params
                    )
                except (openai.ConflictError, openai.InternalServerError) as e:
                    # 409: this replica does not hold the version asked for; 503: it has none verified yet.
                    self.stats.refused += 1
                    last = f"{url}: {e.status_code} {_message(e)}"
                    wait_s = max(wait_s, _retry_after(e.response))
                    continue
                except openai.APIConnectionError as e:
                    last = f"{url}: {e}"
                    wait_s = max(wait_s, 1.0)
                    self._snapshot_at = 0.0  # a replica went away: look at the fleet again
                    continue
                finally:
                    self._in_flight[url] -= 1
                return self._rollout(prompt, url, raw)
            if time.monotonic() + wait_s > deadline:
                raise RolloutError(
                    f"no island served the request ({constraint or 'no constraint'}) within {self.patience_s:g} s; "
                    f"last answer: {last}. Are the islands following the board (GET /flipsync/status)?"
                )
            await asyncio.sleep(wait_s)

    def _rollout(self, prompt: str | Sequence[Mapping[str, Any]], url: str, raw: Any) -> Rollout:
        body = raw.parse()
        tag = (body.model_extra or {}).get(BODY_FIELD) or {}
        start = tag.get("start", raw.headers.get(H_START))
        end = tag.get("end", raw.headers.get(H_END, start))
        if start is None:
            raise RolloutError(f"{url} did not report a weight version: is it a flipsync sidecar's proxy?")
        choice = body.choices[0]
        text = choice.text if hasattr(choice, "text") else (choice.message.content or "")
        self.stats.sampled += 1
        self.stats.per_island[url] = self.stats.per_island.get(url, 0) + 1
        return Rollout(prompt, text, url, int(start), int(end), choice.finish_reason)

    # -- a batch --------------------------------------------------------------------------------------

    def fresh(self, rollout: Rollout, version: int) -> bool:
        """Whether a rollout may be trained on at trainer ``version`` (its start within ``max_staleness``)."""
        return rollout.staleness(version) <= self.max_staleness

    async def collect(
        self,
        prompts: Sequence[str | Sequence[Mapping[str, Any]]],
        *,
        version: int,
        current: Callable[[], int] | None = None,
        concurrency: int = 8,
        exact: bool = False,
        **params: Any,
    ) -> Batch:
        """Sample every prompt once, concurrently; keep the fresh rollouts, drop the stale ones.

        Each request asks for ``min_version = version - max_staleness`` (``exact=True``: exactly ``version``).
        Freshness is judged against ``current()`` when given (the trainer's version as results come back:
        a loop whose optimizer runs meanwhile), else against ``version``.
        """
        sem = asyncio.Semaphore(max(1, concurrency))
        constraint = {"exact_version": version} if exact else {"min_version": max(0, version - self.max_staleness)}

        async def one(p: str | Sequence[Mapping[str, Any]]) -> Rollout:
            async with sem:
                return await self.complete(p, **constraint, **params)

        batch = Batch()
        for r in await asyncio.gather(*(one(p) for p in prompts)):
            now = current() if current is not None else version
            if self.fresh(r, now):
                batch.kept.append(r)
            else:
                self.stats.dropped += 1
                batch.dropped.append(r)
                log.debug(
                    "dropping a v%d rollout at trainer v%d (max staleness %d)", r.version_start, now, self.max_staleness
                )
        return batch


def _retry_after(response: Any) -> float:
    try:
        return min(30.0, max(0.05, float(response.headers.get("retry-after", "1"))))
    except (TypeError, ValueError):
        return 1.0


def _message(e: Any) -> str:
    body = getattr(e, "body", None)
    err = body.get("error", body) if isinstance(body, dict) else None
    return str(err["message"]) if isinstance(err, dict) and "message" in err else str(e)
