"""The sidecar's side of fleet membership: `Heartbeat` keeps the replica's record on the board fresh, rewrites it
at once when routing-relevant state changes, and removes it when the sidecar leaves. See docs/fleet.md.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from flipsync.board.membership import MemberWriter
from flipsync.domain.fleet import MemberRecord, check_model, check_url, replica_id_for
from flipsync.domain.manifest import utc_now_iso
from flipsync.errors import ConfigError, FlipsyncError
from flipsync.sidecar.load import LoadReader
from flipsync.sidecar.replica import Replica

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 5.0
DEFAULT_TTL_S = 15.0


@dataclass(frozen=True)
class MembershipConfig:
    """How a sidecar appears in the fleet; the record's fields and defaults: docs/fleet.md#membership.

    ``replica_id`` / ``model``: None takes the defaults there. ``ttl_s`` should be a few ``interval_s``.
    """

    public_url: str
    replica_id: str | None = None
    island: str = "default"
    model: str | None = None
    interval_s: float = DEFAULT_INTERVAL_S
    ttl_s: float = DEFAULT_TTL_S
    min_gap_s: float = 0.25

    def __post_init__(self) -> None:
        try:
            check_url(self.public_url)
            if self.model is not None:
                check_model(self.model)
        except FlipsyncError as e:
            raise ConfigError(str(e).replace("invalid member record: ", "")) from None
        if not 0 < self.interval_s < self.ttl_s:
            raise ConfigError(
                f"the heartbeat interval ({self.interval_s:g} s) must be positive and below the record's TTL "
                f"({self.ttl_s:g} s); a TTL of about three intervals survives one lost write"
            )

    @property
    def replica(self) -> str:
        return self.replica_id or replica_id_for(self.public_url)


class Heartbeat:
    """Keeps one replica's member record on the board (a thread); see the module doc."""

    def __init__(
        self,
        writer: MemberWriter,
        replica: Replica,
        config: MembershipConfig,
        *,
        upstream_url: str | None = None,
        load: LoadReader | None = None,
    ) -> None:
        self.writer = writer
        self.load = load  # the engine's load, on each record (routing ranks by it)
        self.replica = replica
        self.gate = replica.gate
        self.config = config
        self.upstream_url = upstream_url
        self.started = utc_now_iso()
        self.seq = 0
        self.writes = 0
        self.failures = 0
        self.last: MemberRecord | None = None
        self._model = config.model or getattr(replica.engine, "model_name", None)
        self._tokenizer: tuple[str | None] | None = None  # worked out at the first record (vLLM's loads a tokenizer)
        self._key: tuple[Any, ...] | None = None
        self._last_attempt = -1e18
        self._lock = threading.Lock()  # one write at a time (the thread, a drain's beat, stop)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def replica_id(self) -> str:
        return self.config.replica

    # -- the record -------------------------------------------------------------------------------------

    def model(self) -> str | None:
        """The model name it serves, asked of the upstream once when neither config nor engine says."""
        if self._model is None and self.upstream_url:
            try:
                r = httpx.get(self.upstream_url.rstrip("/") + "/v1/models", timeout=5.0)
                data = r.json().get("data") or []
                if r.status_code == 200 and data and isinstance(data[0], dict):
                    self._model = check_model(data[0].get("id"))
            except (httpx.HTTPError, ValueError, AttributeError, FlipsyncError) as e:
                log.warning("cannot learn the served model name from %s/v1/models: %s", self.upstream_url, e)
        return self._model

    def tokenizer(self) -> str | None:
        """The engine's tokenizer digest, asked once (None where the engine cannot tell, or asking failed)."""
        if self._tokenizer is None:
            try:
                self._tokenizer = (self.replica.engine.tokenizer_digest,)
            except Exception as e:  # a digest is optional: the record goes out without one
                log.warning("cannot tell how the engine tokenizes (the record will not say): %s", e)
                self._tokenizer = (None,)
        return self._tokenizer[0]

    def _routing_key(self) -> tuple[Any, ...]:
        return (self.replica.version, self.replica.serving, self.gate.draining)

    def record(self) -> MemberRecord | None:
        """The record as it stands now (None while the model name is unknown: nothing could route to it)."""
        model = self.model()
        if model is None:
            return None
        st = self.replica.status()
        version = st["version"]
        return MemberRecord(
            replica=self.config.replica,
            run=self.replica.reader.run,
            island=self.config.island,
            url=self.config.public_url,
            engine=re.sub(r"[^A-Za-z0-9._-]", "-", self.replica.engine.name) or "engine",
            served_format=st["served_format"] or "unknown",
            model=model,
            version=version,
            view_fp=st["view_fp"] if version is not None else None,
            head=st["head"],
            state="draining" if self.gate.draining else st["state"],
            serving=bool(st["serving"]) and version is not None,
            in_flight=self.gate.in_flight,
            heartbeat=utc_now_iso(),
            ttl_s=self.config.ttl_s,
            started=self.started,
            seq=self.seq,
            load=None if self.load is None else self.load.read(),
            tokenizer=self.tokenizer(),
        )

    def beat(self) -> bool:
        """Write the record now; False (logged) when the store refused or the record cannot be built yet."""
        with self._lock:
            self._last_attempt = time.monotonic()
            key = self._routing_key()
            record = self.record()
            if record is None:
                return False
            try:
                self.last = self.writer.put(record)
            except FlipsyncError as e:
                self.failures += 1
                if self.failures == 1 or self.failures % 20 == 0:
                    log.warning("cannot write the member record (%d failures): %s", self.failures, e)
                return False
            self.seq += 1
            self.writes += 1
            self._key = key
            return True

    # -- the thread -------------------------------------------------------------------------------------

    def start(self) -> Heartbeat:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="flipsync-heartbeat", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        cfg = self.config
        while not self._stop.is_set():
            since = time.monotonic() - self._last_attempt
            if since >= cfg.interval_s or (self._routing_key() != self._key and since >= cfg.min_gap_s):
                self.beat()
            self._stop.wait(min(0.05, cfg.min_gap_s))

    def stop(self, *, deregister: bool = True) -> None:
        """Stop the beats; with ``deregister``, delete the record (a replica that left on purpose)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        if deregister:
            with self._lock:
                try:
                    self.writer.remove(self.config.replica)
                except FlipsyncError as e:
                    log.warning("cannot delete the member record (it expires in %g s): %s", self.config.ttl_s, e)
