"""One replica's reconcile loop: follow the board, stage while serving, commit with a short pause.

A pass of the loop:

1. **fetching**: read HEAD (a relay or the store itself), plan the cheapest catch-up from the version held
   (chain, squashed spans, or a keyframe), download each artifact a step or two ahead and verify its
   hashes (and signature, with a verifier);
2. **staging**: decode a patch into ready-to-scatter buffers and check it against the weights held, while
   the engine keeps serving;
3. **committing**: close the request gate (new requests wait), drain in-flight requests as the commit mode
   asks, let the engine write in place, check the fingerprint of the view it now holds, publish the new
   version, open the gate.

The replica reports a version only once the engine holds it and its fingerprint matches the board's. On any
failure it keeps serving its last verified version, says why (``status()``, metrics), backs off and tries
again, and converges once the fault is gone:

- a damaged or undecodable artifact is excluded and the rest of the way planned again (a span falls back
  to the chain, a chain to a keyframe); a patch whose content is bad although its hashes match stays
  excluded until a way past it appears;
- an engine that refuses a commit keeps its weights (the port is all-or-nothing), and a post-commit
  fingerprint mismatch is rolled back;
- after an engine fault or restart the weights are audited (fingerprints recomputed); if they are not the
  version on record, the replica stops serving and resyncs from a keyframe;
- on boot (and after an audit lost the version) the replica *adopts* what an engine that outlived its
  sidecar holds: if the recomputed view fingerprint is a version among the newest manifests on the board,
  that version is reported and patches continue from it; anything else (a commit cut short by a killed
  sidecar, other weights) resyncs from a keyframe, so a half-written engine is never reported;
- a base mismatch (the engine no longer holds the base it should) resyncs from a keyframe;
- a board that cannot be reached, or whose HEAD moved backwards, leaves everything as it is.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, TypeVar

from flipsync.board.ahead import FetchAhead
from flipsync.board.parts import patch_from_parts
from flipsync.board.reader import BoardReader, KeyframeStep, PatchStep, Step, check_continuity
from flipsync.domain.catchup import CatchupPlan, Edge
from flipsync.domain.manifest import Manifest
from flipsync.engines.base import Engine
from flipsync.errors import (
    BaseMismatchError,
    BoardError,
    CorruptPatchError,
    EngineError,
    EngineUnavailableError,
    FlipsyncError,
    IntegrityError,
    NotFoundError,
    PatchError,
    StoreError,
    UnusableArtifactError,
    VerificationError,
)
from flipsync.sidecar.gate import CommitMode, Pause, RequestGate
from flipsync.sidecar.metrics import SidecarMetrics
from flipsync.sidecar.notify import Notifier

log = logging.getLogger(__name__)
T = TypeVar("T")


class State(StrEnum):
    IDLE = "idle"
    FETCHING = "fetching"
    STAGING = "staging"
    COMMITTING = "committing"
    ERROR = "error"


@dataclass(frozen=True)
class ReplicaConfig:
    commit_mode: CommitMode = CommitMode.IN_PLACE
    poll_interval_s: float = 1.0
    max_backoff_s: float = 30.0
    drain_timeout_s: float = 30.0
    max_replans: int = 3
    jitter: float = 0.1  # +-10% on every wait, so a fleet does not poll in lockstep
    # How many of the newest version manifests to compare with what the engine holds on boot (0: never adopt).
    adopt_search: int = 64


@dataclass(frozen=True)
class Update:
    """One applied artifact and what it cost."""

    kind: str
    base: int | None
    target: int
    bytes: int
    n_changed: int | None
    fetch_s: float
    stage_s: float
    commit_s: float
    pause_s: float
    drain_s: float
    drained: bool
    at: str


@dataclass(frozen=True)
class Failure:
    kind: str
    message: str
    at: str
    consecutive: int


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def classify(e: BaseException) -> str:
    """A short, stable name for a failure (status and the ``kind`` label of the failure counter)."""
    if isinstance(e, UnusableArtifactError):
        return e.kind
    if isinstance(e, EngineUnavailableError):
        return "engine_down"
    if isinstance(e, EngineError):
        return "engine_rejected"
    if isinstance(e, IntegrityError):
        return "integrity"
    if isinstance(e, StoreError):
        return "board_unreachable"
    if isinstance(e, NotFoundError):
        return "no_route"
    if isinstance(e, BoardError):
        return "board"
    if isinstance(e, BaseMismatchError):
        return "base_mismatch"
    if isinstance(e, VerificationError):
        return "verification"
    if isinstance(e, CorruptPatchError | PatchError):
        return "corrupt_patch"
    if isinstance(e, FlipsyncError):
        return "error"
    return "internal"


def _no_way_past(cause: IntegrityError, head: int, e: NotFoundError) -> IntegrityError:
    msg = f"{cause}; and no other way to v{head} yet (waiting for a keyframe or span past it): {e}"
    if isinstance(cause, UnusableArtifactError):
        return UnusableArtifactError(msg, edge=cause.edge, kind=cause.kind)
    return IntegrityError(msg)


class _Resync(Exception):
    """The engine no longer holds the version on record: plan again from nothing (a keyframe)."""


class Replica:
    """Keeps one engine at the board's HEAD; thread-safe reads of its state for the proxy and control API."""

    def __init__(
        self,
        reader: BoardReader,
        engine: Engine,
        *,
        config: ReplicaConfig | None = None,
        gate: RequestGate | None = None,
        metrics: SidecarMetrics | None = None,
    ) -> None:
        self.reader = reader
        self.engine = engine
        self.config = config or ReplicaConfig()
        self.gate = gate or RequestGate()
        self.metrics = metrics or SidecarMetrics()
        self._n = Notifier()  # guards the fields below and wakes waiters on a new version
        self._version: int | None = None
        self._view_fp: str | None = None
        self._committing: int | None = None
        self._head: int | None = None
        self._state = State.IDLE
        self._state_since = time.monotonic()
        self._engine_up = True
        self._need_audit = False
        self._adopt_pending = True  # the engine may outlive its sidecar: look at what it holds first
        self._adopted: dict[str, Any] | None = None
        self._bad_edges: dict[Edge, UnusableArtifactError] = {}
        self._error: Failure | None = None
        self._last_error: Failure | None = None
        self._last_update: Update | None = None
        self._updates = 0
        self._fetched_bytes = 0
        self._sync_lock = threading.Lock()
        self._stop = threading.Event()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._rng = random.Random()

    # -- what the proxy and the control API read ----------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The verified version the engine holds (None: none yet, or lost after a fault)."""
        return self._version

    @property
    def view_fp(self) -> str | None:
        return self._view_fp

    @property
    def head(self) -> int | None:
        return self._head

    @property
    def state(self) -> State:
        return self._state

    @property
    def serving(self) -> bool:
        """True when requests may be sent to the engine: a verified version and a healthy engine."""
        return self._version is not None and self._engine_up and not self._need_audit

    def version_upper_bound(self) -> int | None:
        """The newest version a token generated now may come from: a commit under way counts already."""
        with self._n.lock:
            if self._committing is not None and (self._version is None or self._committing > self._version):
                return self._committing
            return self._version

    def wait_version(self, min_version: int, timeout: float) -> bool:
        return self._n.wait(lambda: self._version is not None and self._version >= min_version, timeout)

    async def wait_version_async(self, min_version: int, timeout: float) -> bool:
        return await self._n.wait_async(lambda: self._version is not None and self._version >= min_version, timeout)

    def status(self) -> dict[str, Any]:
        with self._n.lock:
            version, head = self._version, self._head
            return {
                "state": self._state.value,
                "state_for_s": round(time.monotonic() - self._state_since, 3),
                "version": version,
                "view_fp": self._view_fp,
                "head": head,
                "lag": None if head is None else head - (version if version is not None else -1),
                "serving": self.serving,
                "committing": self._committing,
                "engine": {"name": getattr(self.engine, "name", type(self.engine).__name__), "up": self._engine_up},
                "commit_mode": self.config.commit_mode.value,
                "updates": self._updates,
                "fetched_bytes": self._fetched_bytes,
                "last_update": asdict(self._last_update) if self._last_update else None,
                "adopted": self._adopted,
                "error": asdict(self._error) if self._error else None,
                "last_error": asdict(self._last_error) if self._last_error else None,
                "excluded": [
                    {"kind": e[0], "base": e[1], "target": e[2], "why": str(why)} for e, why in self._bad_edges.items()
                ],
                "requests_in_flight": self.gate.in_flight,
            }

    # -- the loop ---------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="flipsync-reconcile", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the reconcile loop did not stop within %.0f s (a download in progress)", timeout)
            self._thread = None

    def wake(self) -> None:
        """Poll now instead of at the next interval (e.g. on a notification that HEAD moved)."""
        self._wakeup.set()

    def _loop(self) -> None:
        failures = 0
        cfg = self.config
        while not self._stop.is_set():
            ok = self.sync_once()
            failures = 0 if ok else failures + 1
            delay = cfg.poll_interval_s if ok else min(cfg.max_backoff_s, cfg.poll_interval_s * 2 ** min(failures, 20))
            delay *= 1 + cfg.jitter * (2 * self._rng.random() - 1)
            if not (ok and self.wait_for_next(delay)):
                self._wakeup.wait(delay)
            self._wakeup.clear()

    def wait_for_next(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the version after HEAD (True: waited, whatever the outcome), at the
        relay when the board is one, in slices of at most a second so that ``stop`` and ``wake`` are seen.
        A `FetchAhead` store also watches that version's folder every ``interval_s``, downloading its parts
        while the trainer is still uploading them. False when the store can do neither (the loop sleeps)."""
        nxt = 0 if self._head is None else self._head + 1
        ahead = self.reader.store if isinstance(self.reader.store, FetchAhead) else None
        folder = self.reader.catalog.layout.version_dir(nxt)
        slice_s = 1.0 if ahead is None else ahead.interval_s
        end = time.monotonic() + timeout_s
        while (left := end - time.monotonic()) > 0 and not (self._stop.is_set() or self._wakeup.is_set()):
            try:
                if ahead is not None and ahead.watch(folder):
                    break
                arrived = self.reader.wait_for_version(nxt, min(slice_s, left))
            except FlipsyncError as e:  # the next pass reports a board or relay that is really gone
                log.debug("waiting for v%d failed: %s", nxt, e)
                return False
            if arrived is None:
                if ahead is None:
                    return False
                self._wakeup.wait(min(slice_s, left))
            elif arrived:
                break
        return True

    def sync_once(self) -> bool:
        """One reconcile pass: catch up to HEAD. Returns False (and records why) on failure."""
        with self._sync_lock:
            try:
                self._check_engine()
                self._reconcile()
            except Exception as e:
                self._fail(e)
                return False
            with self._n.lock:
                self._error = None
            self._set_state(State.IDLE)
            return True

    # -- internals --------------------------------------------------------------------------------------------

    def _set_state(self, state: State) -> None:
        with self._n.lock:
            if state is not self._state:
                self._state, self._state_since = state, time.monotonic()
        self.metrics.state.state(state.value)

    def _set_version(self, version: int | None, view_fp: str | None) -> None:
        with self._n.lock:
            self._version, self._view_fp = version, view_fp
            if version is not None:  # artifacts that end at or below the version held are no longer in the way
                self._bad_edges = {e: why for e, why in self._bad_edges.items() if e[2] > version}
            self._n.notify_all()
        self.metrics.version.set(-1 if version is None else version)
        self._update_lag()

    def _update_lag(self) -> None:
        head, version = self._head, self._version
        if head is not None:
            self.metrics.lag.set(head - (version if version is not None else -1))

    def _lose_version(self, why: str) -> None:
        if self._version is not None:
            log.warning("no longer serving v%d: %s; resyncing from a keyframe", self._version, why)
        self._set_version(None, None)

    def _fail(self, e: BaseException) -> None:
        kind = classify(e)
        message = str(e) or type(e).__name__
        with self._n.lock:
            n = self._error.consecutive + 1 if self._error and self._error.kind == kind else 1
            self._error = self._last_error = Failure(kind, message, _now(), n)
        self._set_state(State.ERROR)
        self.metrics.failures.labels(kind=kind).inc()
        if n == 1 or n % 50 == 0:
            log.warning("sync failed (%s, %d in a row); still serving %s: %s", kind, n, self._version, message)
        if kind == "internal":
            log.exception("unexpected error in the reconcile loop", exc_info=e)

    def _engine_call(self, what: str, fn: Callable[[], T]) -> T:
        """Call the engine; an error that is not a flipsync error becomes an EngineError naming the call."""
        try:
            return fn()
        except FlipsyncError:
            raise
        except Exception as e:
            raise EngineError(f"the {self.engine.name} engine failed in {what}: {type(e).__name__}: {e}") from e

    def _check_engine(self) -> None:
        try:
            up = bool(self.engine.health())
        except Exception:
            up = False
        self._engine_up = up
        self.metrics.engine_up.set(int(up))
        if not up:
            self._need_audit = True  # it may come back with other weights (a restart)
            raise EngineUnavailableError(f"the {self.engine.name} engine reports it is down; waiting for it")
        if self._need_audit:
            self._audit("after an engine fault")

    def _audit(self, why: str) -> None:
        """Recompute the engine's fingerprints (O(size)); drop the version on record if they disagree."""
        held = self._engine_call("recompute_table", self.engine.recompute_table).view_fp()
        if self._view_fp is not None and held != self._view_fp:
            self._lose_version(f"{why}, the engine holds view {held[:16]}, not v{self._version}'s {self._view_fp[:16]}")
        if self._version is None:
            self._adopt_pending = True  # a restarted engine may hold a published version (its checkpoint)
        self._need_audit = False

    def _after_engine_fault(self, e: BaseException) -> None:
        """The port promises all-or-nothing; check it, since the fault may have been mid-write."""
        log.warning("engine fault: %s; auditing its weights", e)
        try:
            self._audit("after a failed write")
        except Exception as audit_error:  # cannot even read it back: do not serve until it can
            self._need_audit = True
            log.warning("cannot audit the engine's weights: %s", audit_error)

    def _check_local_view(self) -> None:
        """If the board's record of our version is another view (the board was replaced), start over."""
        if self._version is None:
            return
        try:
            m = self.reader.catalog.version(self._version)
        except (NotFoundError, IntegrityError):
            return  # retention removed it, or it is damaged; the first step's base check still applies
        if m.target_view_fp != self._view_fp:
            self._lose_version(f"the board says v{m.version} is view {m.target_view_fp[:16]}")

    def _adopt(self, head: int) -> None:
        """Report the version an engine already holds (it outlived its sidecar), if the board has it.

        The engine's fingerprints are recomputed from its weights (O(size), once) and compared with the
        target view of the newest ``adopt_search`` version manifests (signature-checked with a verifier).
        No match (a commit cut short between ranks or tensors, weights from elsewhere) means a keyframe.
        """
        name = self.engine.name
        if self.config.adopt_search <= 0 or not getattr(self.engine, "adoptable", True):
            self._adopt_pending = False
            log.info("not adopting what the %s engine holds (disabled for it); loading a keyframe", name)
            return
        try:
            held_table = self._engine_call("recompute_table", self.engine.recompute_table)
        except EngineUnavailableError:
            raise  # try again once it answers
        except FlipsyncError as e:  # e.g. tensor-parallel replicas disagree: a commit reached some ranks only
            self._adopt_pending = False
            log.warning("cannot read back a consistent view from the %s engine (%s); loading a keyframe", name, e)
            return
        held = held_table.view_fp()
        tracked = self.engine.table.view_fp()
        if held != tracked:  # patches are staged against ``table``: it must describe the weights
            self._adopt_pending = False
            log.warning(
                "the %s engine's fingerprint table (%s) does not describe its weights (%s); loading a keyframe",
                name,
                tracked[:16],
                held[:16],
            )
            return
        lowest = max(head - self.config.adopt_search + 1, min(self.reader.catalog.list_versions(), default=0))
        match: Manifest | None = None
        hi = head
        while match is None and hi >= lowest:  # newest first, in small batches: usually it is HEAD or close
            lo = max(lowest, hi - 7)
            found = self.reader.catalog.read_versions(range(lo, hi + 1))
            match = max((m for m in found.values() if m.target_view_fp == held), key=lambda m: m.version, default=None)
            hi = lo - 1
        self._adopt_pending = False
        if match is None:  # the usual case for an engine started from its base weights: info, not a warning
            log.info(
                "the %s engine holds view %s, which is none of v%d..v%d on the board (other weights, or a commit "
                "cut short); loading a keyframe",
                name,
                held[:16],
                lowest,
                head,
            )
            return
        self._label(match)
        with self._n.lock:
            self._adopted = {"version": match.target_version, "view_fp": held, "at": _now()}
        self._set_version(match.target_version, match.target_view_fp)
        log.info("adopted v%d: the %s engine already holds its view %s", match.target_version, name, held[:16])

    def _reconcile(self) -> None:
        self._set_state(State.FETCHING)
        head = self.reader.head()
        with self._n.lock:
            self._head = head
        self.metrics.head.set(-1 if head is None else head)
        self._update_lag()
        if head is None:
            return
        if self._version is None and self._adopt_pending:
            self._adopt(head)
        if self._version == head:
            return
        self._check_local_view()
        transient: set[Edge] = set()
        last: IntegrityError | None = None
        for attempt in range(self.config.max_replans + 1):
            exclude = transient | set(self._bad_edges)
            try:
                plan = self.reader.plan(self._version, head, exclude=exclude)
            except NotFoundError as e:
                cause = last or next(iter(self._bad_edges.values()), None)
                if cause is None:
                    raise
                # Routing around a damaged artifact left no way: report the damage itself.
                raise _no_way_past(cause, head, e) from e
            try:
                failure = self._follow(plan)
            except _Resync:
                continue  # the version on record was dropped: plan from a keyframe
            if failure is None:
                return
            m, err = failure
            last = err
            if isinstance(err, UnusableArtifactError):
                with self._n.lock:
                    self._bad_edges[m.edge] = err
            else:
                transient.add(m.edge)
            self.reader.catalog.forget(m)
            log.warning("excluding %s v%s->v%d and planning again: %s", m.kind.value, m.base_version, m.version, err)
            if attempt == self.config.max_replans:
                raise err
        raise BoardError(
            f"still not at v{head} after {self.config.max_replans + 1} plans (the engine's weights kept "
            "changing under the sidecar); trying again"
        )

    def _follow(self, plan: CatchupPlan) -> tuple[Manifest, IntegrityError] | None:
        """Fetch and apply a plan's steps in order; return the artifact that proved unusable, if any."""
        t_wait = time.perf_counter()
        for m, fut in self.reader.prefetch(plan):
            try:
                step = fut.result()
                check_continuity(m, self._view_fp)
            except IntegrityError as e:
                return m, e
            fetch_s = time.perf_counter() - t_wait
            with self._n.lock:
                self._fetched_bytes += m.total_size
            self.metrics.fetched_bytes.inc(m.total_size)
            self.metrics.fetch_seconds.observe(fetch_s)
            try:
                self._apply(step, fetch_s)
            except UnusableArtifactError as e:
                return m, e
            t_wait = time.perf_counter()
            self._set_state(State.FETCHING)
        return None

    def _label(self, m: Manifest) -> None:
        label = getattr(self.engine, "label_version", None)
        if callable(label):
            label(m.target_view_fp, m.target_version)

    def _apply(self, step: Step, fetch_s: float) -> None:
        if isinstance(step, KeyframeStep):
            self._apply_keyframe(step, fetch_s)
        else:
            self._apply_patch(step, fetch_s)

    def _apply_patch(self, step: PatchStep, fetch_s: float) -> None:
        m = step.manifest
        where = f"{m.kind.value} v{m.base_version}->v{m.target_version}"
        self._set_state(State.STAGING)
        t0 = time.perf_counter()
        try:
            patch = patch_from_parts(step.parts, m, self.engine.table)
            staged = self._engine_call("stage", lambda: self.engine.stage(patch))
        except (CorruptPatchError, VerificationError) as e:
            raise UnusableArtifactError(f"{where} is unusable: {e}", edge=m.edge, kind="corrupt_patch") from e
        except BaseMismatchError as e:
            if self.engine.table.view_fp() != self._view_fp:
                self._lose_version(f"the engine's weights changed under the sidecar ({e})")
                raise _Resync() from e
            raise UnusableArtifactError(
                f"{where} does not apply to its own base view: {e}", edge=m.edge, kind="corrupt_patch"
            ) from e
        stage_s = time.perf_counter() - t0
        self.metrics.stage_seconds.observe(stage_s)
        self._set_state(State.COMMITTING)
        self._label(m)
        with self.gate.closed(self.config.commit_mode, self.config.drain_timeout_s) as pause:
            with self._n.lock:
                self._committing = m.target_version
            try:
                t1 = time.perf_counter()
                try:
                    undo = self._engine_call("commit", lambda: self.engine.commit(staged))
                except Exception as e:
                    self._after_engine_fault(e)
                    raise
                commit_s = time.perf_counter() - t1
                held = self.engine.table.view_fp()
                if held != m.target_view_fp:
                    try:
                        self._engine_call("rollback", lambda: self.engine.rollback(undo))
                    except Exception as e:
                        self._after_engine_fault(e)
                        raise
                    raise VerificationError(
                        f"after committing v{m.target_version} the engine holds view {held[:16]}, not "
                        f"{m.target_view_fp[:16]}; rolled back to v{m.base_version}"
                    )
                self._set_version(m.target_version, m.target_view_fp)
            finally:
                with self._n.lock:
                    self._committing = None
        n_changed = getattr(staged, "n_changed", None)
        self._record(m, m.kind.value, fetch_s, stage_s, commit_s, pause, n_changed)

    def _apply_keyframe(self, step: KeyframeStep, fetch_s: float) -> None:
        m = step.manifest
        self._set_state(State.COMMITTING)
        self._label(m)
        with self.gate.closed(self.config.commit_mode, self.config.drain_timeout_s) as pause:
            with self._n.lock:
                self._committing = m.target_version
            try:
                t1 = time.perf_counter()
                try:
                    self._engine_call("load_view", lambda: self.engine.load_view(step.tensors))
                except Exception as e:
                    self._after_engine_fault(e)
                    raise
                commit_s = time.perf_counter() - t1
                held = self.engine.table.view_fp()
                if held != m.target_view_fp:
                    self._lose_version(f"keyframe v{m.version} loaded as view {held[:16]}")
                    raise UnusableArtifactError(
                        f"keyframe v{m.version} holds view {held[:16]}, but its manifest says {m.target_view_fp[:16]}",
                        edge=m.edge,
                        kind="bad_keyframe",
                    )
                self._set_version(m.target_version, m.target_view_fp)
            finally:
                with self._n.lock:
                    self._committing = None
        self._record(m, "keyframe", fetch_s, 0.0, commit_s, pause, None)

    def _record(
        self, m: Manifest, kind: str, fetch_s: float, stage_s: float, commit_s: float, pause: Pause, n: int | None
    ) -> None:
        u = Update(
            kind=kind,
            base=m.base_version,
            target=m.target_version,
            bytes=m.total_size,
            n_changed=n,
            fetch_s=round(fetch_s, 6),
            stage_s=round(stage_s, 6),
            commit_s=round(commit_s, 6),
            pause_s=round(pause.closed_s, 6),
            drain_s=round(pause.drain_s, 6),
            drained=pause.drained,
            at=_now(),
        )
        with self._n.lock:
            self._last_update = u
            self._updates += 1
        self.metrics.updates.labels(kind=kind).inc()
        self.metrics.commit_seconds.observe(commit_s)
        self.metrics.pause_seconds.observe(pause.closed_s)
        log.info(
            "v%s -> v%d (%s, %d bytes): stage %.1f ms, commit %.1f ms, pause %.1f ms",
            m.base_version,
            m.target_version,
            kind,
            m.total_size,
            stage_s * 1e3,
            commit_s * 1e3,
            pause.closed_s * 1e3,
        )
