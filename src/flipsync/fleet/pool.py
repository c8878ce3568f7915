"""The Pool port (where a fleet's replicas are found, as a point-in-time `FleetSnapshot`), `BoardPool` and
`StaticPool`; `flipsync.fleet.ray_pool.RayPool` also starts and stops replicas (``scale``). See
docs/fleet.md#the-pool-port."""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from flipsync.board.layout import RunLayout
from flipsync.board.membership import MemberReader, Rejected
from flipsync.board.reader import BoardReader
from flipsync.board.signing import Verifier
from flipsync.domain.balance import EngineLoad
from flipsync.domain.fleet import (
    MEMBER_STATES,
    MemberRecord,
    is_ready,
    lag_behind,
    readiness,
    replica_id_for,
    tokenizer_outliers,
)
from flipsync.domain.manifest import utc_now_iso
from flipsync.errors import ConfigError, FlipsyncError
from flipsync.stores import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetSnapshot:
    """The fleet at one moment: live replicas, each run's HEAD, and the records refused."""

    members: tuple[MemberRecord, ...]
    heads: Mapping[str, int | None]
    rejected: tuple[Rejected, ...] = ()
    at: datetime = field(default_factory=lambda: datetime.now(UTC))

    def head(self, record: MemberRecord) -> int | None:
        return self.heads.get(record.run)

    def one_tokenizer_per_model(self) -> FleetSnapshot:
        """This snapshot with the replicas that tokenize unlike the rest of their model name's replicas moved to
        ``rejected`` (``tokenizer_mismatch``, saying why): a model name routes to replicas that agree only."""
        outliers = tokenizer_outliers(self.members)
        if not outliers:
            return self
        moved = tuple(
            Rejected(RunLayout(r.run).member_path(r.replica), "tokenizer_mismatch", outliers[r.replica])
            for r in self.members
            if r.replica in outliers
        )
        kept = tuple(r for r in self.members if r.replica not in outliers)
        return FleetSnapshot(kept, self.heads, (*self.rejected, *moved), self.at)

    def ready(self, max_lag: int) -> list[MemberRecord]:
        return [r for r in self.members if is_ready(r, self.head(r), max_lag)]

    def runs(self) -> dict[str, dict[str, Any]]:
        """Per run: HEAD, members, how many hold HEAD, readiness (the fraction at HEAD), versions held."""
        out: dict[str, dict[str, Any]] = {}
        for run in sorted(set(self.heads) | {r.run for r in self.members}):
            mine = [r for r in self.members if r.run == run]
            head = self.heads.get(run)
            versions: dict[str, int] = {}
            for r in mine:
                key = "none" if r.version is None else str(r.version)
                versions[key] = versions.get(key, 0) + 1
            out[run] = {
                "head": head,
                "members": len(mine),
                "at_head": sum(1 for r in mine if r.version is not None and r.version == head),
                "readiness": readiness(mine, head),
                "versions": versions,
            }
        return out

    def describe(self, max_lag: int) -> list[dict[str, Any]]:
        """Every member's record with what the snapshot says of it: lag behind the board's HEAD, ready."""
        return [
            {
                **r.to_dict(with_signature=False),
                "signed": r.signature is not None,
                "board_head": self.head(r),
                "board_lag": lag_behind(r, self.head(r)),
                "ready": is_ready(r, self.head(r), max_lag),
            }
            for r in self.members
        ]


class Pool(ABC):
    """Where a fleet's replicas are found; see the module doc."""

    def gateway_url(self) -> str | None:
        """The one URL rollout traffic goes to (None: this pool has no gateway of its own)."""
        return None

    @abstractmethod
    def discover_replicas(self) -> FleetSnapshot:
        """The fleet now. Raises a FlipsyncError when the pool cannot be read (the caller keeps its last)."""

    def wake(self, replicas: Sequence[str], version: int) -> None:
        """Ask stopped (scaled-to-zero) replicas to start and load ``version``; optional."""
        raise NotImplementedError(f"{type(self).__name__} cannot wake replicas: its replicas are always up")

    def scale(self, min_replicas: int, max_replicas: int) -> None:
        """Bound the number of replicas an autoscaler keeps (`RayPool`: add or drain replicas to the nearest
        bound); optional."""
        raise NotImplementedError(f"{type(self).__name__} cannot scale: it does not start or stop replicas")

    def close(self) -> None:  # noqa: B027 - optional: most pools hold nothing
        """Release what the pool holds (stores, clients)."""


class BoardPool(Pool):
    """The replicas whose member records are live on the board (docs/fleet.md#membership).

    ``runs``: None reads every run with records. ``member_verifier`` / ``verifier``: the trusted member keys
    (unsigned records refused) and the publisher's keys (HEAD read from signed manifests only).
    """

    def __init__(
        self,
        store: Store,
        *,
        runs: Sequence[str] | None = None,
        member_verifier: Verifier | None = None,
        verifier: Verifier | None = None,
        gateway_url: str | None = None,
        max_skew_s: float = 5.0,
        max_ttl_s: float | None = None,
    ) -> None:
        self.store = store
        self.runs = tuple(runs) if runs else None
        self.members = MemberReader(
            store, runs=self.runs, verifier=member_verifier, max_skew_s=max_skew_s, max_ttl_s=max_ttl_s
        )
        self.verifier = verifier
        self._gateway_url = gateway_url
        self._readers: dict[str, BoardReader] = {}

    def gateway_url(self) -> str | None:
        return self._gateway_url

    def head(self, run: str) -> int | None:
        reader = self._readers.get(run)
        if reader is None:
            reader = self._readers[run] = BoardReader(self.store, run, verifier=self.verifier)
        return reader.head()

    def discover_replicas(self) -> FleetSnapshot:
        scan = self.members.scan()
        runs = sorted({r.run for r in scan.live} | set(self.runs or ()))
        heads = {run: self.head(run) for run in runs}
        return FleetSnapshot(scan.live, heads, scan.rejected, scan.at)

    def close(self) -> None:
        self.members.close()
        self.store.close()


class StaticPool(Pool):
    """A fixed list of sidecar proxies (``http://HOST:PORT``), each asked for its status at every discovery.

    Unsigned: the sidecars' answers are the records, HEAD the newest any reports. One that does not answer keeps
    its last answer until ``ttl_s`` after it, as a board record lives until its heartbeat's ttl ends: one slow or
    lost status poll (a loaded host, a GC pause) must not take a replica out of rotation and move its sessions off
    their KV caches; a replica that is truly gone fails its requests, and the gateway ejects it on those. Then it
    is left out (``rejected``: ``unreadable``).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        timeout_s: float = 2.0,
        ttl_s: float = 15.0,
        gateway_url: str | None = None,
        api_key: str | None = None,
    ) -> None:
        if not urls:
            raise ConfigError("a static pool needs at least one sidecar URL")
        self.urls = [u.rstrip("/").removesuffix("/v1") for u in urls]
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._gateway_url = gateway_url
        # ``api_key``: for sidecars whose model API needs one (their /v1/models; /flipsync/status is open)
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        self._client = httpx.Client(timeout=timeout_s, headers=headers)
        self._models: dict[str, str] = {}
        self._started = utc_now_iso()
        self._executor = ThreadPoolExecutor(min(16, len(self.urls)), thread_name_prefix="flipsync-pool")
        self._last: dict[str, tuple[float, MemberRecord]] = {}  # url -> (monotonic time read, its last record)
        self._silent: set[str] = set()  # urls kept on their last answer (warned once per silence)

    def gateway_url(self) -> str | None:
        return self._gateway_url

    def _model(self, url: str) -> str:
        if url not in self._models:
            data = self._client.get(f"{url}/v1/models").json().get("data") or []
            self._models[url] = str(data[0]["id"]) if data else "unknown"
        return self._models[url]

    def _record(self, url: str) -> tuple[MemberRecord | None, Rejected | None]:
        try:
            st = self._client.get(f"{url}/flipsync/status").json()
            version = st.get("version")
            draining = bool((st.get("proxy") or {}).get("draining"))
            state = "draining" if draining else st.get("state")
            record = MemberRecord(
                replica=replica_id_for(url),
                run=st.get("run") or "default",
                island="static",
                url=url,
                engine=str((st.get("engine") or {}).get("name") or "engine"),
                served_format=st.get("served_format") or "unknown",
                model=self._model(url),
                version=version,
                view_fp=st.get("view_fp") if version is not None else None,
                head=st.get("head"),
                state=state if state in MEMBER_STATES else "error",
                serving=bool(st.get("serving")) and version is not None,
                in_flight=int(st.get("requests_in_flight") or 0),
                heartbeat=utc_now_iso(),
                ttl_s=self.ttl_s,
                started=self._started,
                tokenizer=st.get("tokenizer"),
                load=EngineLoad.from_dict(st["load"]) if st.get("load") is not None else None,
            )
        except (httpx.HTTPError, ValueError, TypeError, KeyError, AttributeError) as e:
            return None, Rejected(url, "unreadable", f"{url} did not answer its status: {e}")
        except FlipsyncError as e:
            return None, Rejected(url, "malformed", f"{url}: {e}")
        return record, None

    def discover_replicas(self) -> FleetSnapshot:
        now = time.monotonic()
        kept: list[MemberRecord] = []
        rejected: list[Rejected] = []
        for url, (record, refused) in zip(self.urls, self._executor.map(self._record, self.urls), strict=True):
            if record is not None:
                self._last[url] = (now, record)
                self._silent.discard(url)
                kept.append(record)
                continue
            assert refused is not None
            read_at, last = self._last.get(url, (-math.inf, None))
            if last is not None and refused.reason == "unreadable" and now - read_at < self.ttl_s:
                if url not in self._silent:
                    self._silent.add(url)
                    log.warning("%s; keeping its last answer until %g s after it", refused.message, self.ttl_s)
                kept.append(last)
            else:
                self._last.pop(url, None)
                self._silent.discard(url)
                rejected.append(refused)
        members, rejected = tuple(kept), tuple(rejected)
        heads: dict[str, int | None] = {}
        for r in members:
            if r.head is not None:
                heads[r.run] = max(heads.get(r.run) or 0, r.head)
            else:
                heads.setdefault(r.run, None)
        return FleetSnapshot(members, heads, rejected)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._client.close()
