"""The load of the engine behind a sidecar, for its status and member record (docs/fleet.md#load-from-the-engines):
what the engine reports itself (``Engine.load``: the torch engine's queue), else, for a vLLM or SGLang server,
its Prometheus ``/metrics`` (requests waiting and running, KV-cache use), read at most once a second."""

from __future__ import annotations

import logging
import threading
import time

import httpx

from flipsync.domain.balance import EngineLoad
from flipsync.engines.base import Engine

log = logging.getLogger(__name__)

# (waiting, running, KV-cache use) metric names per engine server; the first name found wins.
_SERIES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "vllm": (
        ("vllm:num_requests_waiting",),
        ("vllm:num_requests_running",),
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # a fraction in [0, 1] despite the name
    ),
    "sglang": (("sglang:num_queue_reqs",), ("sglang:num_running_reqs",), ("sglang:token_usage",)),
}


def parse_metrics(text: str, kind: str) -> EngineLoad | None:
    """The load in a vLLM or SGLang ``/metrics`` page: counts summed over label sets (one per model or
    data-parallel rank), the KV-cache use their mean; None when the page has none of the series."""
    names = _SERIES.get(kind)
    if names is None:
        return None
    found: dict[str, list[float]] = {}
    wanted = {n for group in names for n in group}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in wanted:
            continue
        try:
            found.setdefault(name, []).append(float(line.rsplit(" ", 1)[1]))
        except (ValueError, IndexError):
            continue

    def pick(group: tuple[str, ...]) -> list[float] | None:
        return next((found[n] for n in group if n in found), None)

    waiting, running, kv = (pick(g) for g in names)
    if waiting is None and running is None and kv is None:
        return None
    return EngineLoad(
        waiting=None if waiting is None else max(0, round(sum(waiting))),
        running=None if running is None else max(0, round(sum(running))),
        kv_cache=None if not kv else min(1.0, max(0.0, sum(kv) / len(kv))),
    )


class LoadReader:
    """``read()``: the engine's load now (cached ``max_age_s``), or None where neither the engine nor its
    server's metrics say. A server whose metrics cannot be read is asked again after ``retry_s``."""

    def __init__(
        self,
        engine: Engine,
        upstream_url: str | None,
        *,
        max_age_s: float = 1.0,
        timeout_s: float = 1.0,
        retry_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.url = None if upstream_url is None else upstream_url.rstrip("/") + "/metrics"
        self.kind = engine.name if engine.name in _SERIES else None
        self.max_age_s = max_age_s
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._lock = threading.Lock()
        self._last: EngineLoad | None = None
        self._next = 0.0  # monotonic time of the next scrape
        self._failing = False
        self._client: httpx.Client | None = None  # kept: a client per scrape built a TLS context each second

    def read(self) -> EngineLoad | None:
        own = self.engine.load()
        if own is not None or self.kind is None or self.url is None:
            return own
        with self._lock:  # one scrape at a time; the others take its answer
            now = time.monotonic()
            if now < self._next:
                return self._last
            try:
                if self._client is None:
                    # idle connections expire before a server's own keep-alive (uvicorn: 5 s) closes them
                    self._client = httpx.Client(timeout=self.timeout_s, limits=httpx.Limits(keepalive_expiry=2.0))
                r = self._client.get(self.url)
                r.raise_for_status()
                self._last = parse_metrics(r.text, self.kind)
                self._next = now + self.max_age_s
                if self._failing:
                    log.info("reading the engine's load from %s again", self.url)
                self._failing = False
            except httpx.HTTPError as e:
                if not self._failing:
                    log.warning(
                        "cannot read the engine's load from %s (routing goes on without it; asked again every "
                        "%g s): %s",
                        self.url,
                        self.retry_s,
                        e,
                    )
                self._failing = True
                self._last = None
                self._next = now + self.retry_s
            return self._last

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
