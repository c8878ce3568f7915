"""One replica's reconcile loop: follow the board, stage while serving, commit with a short pause, and report a
version only once the engine holds it verified; on any failure keep serving the last verified version and
converge once the fault is gone. See docs/sidecar.md ("The reconcile loop").
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from flipsync.board.ahead import FetchAhead
from flipsync.board.follow import Follower, Replan
from flipsync.board.reader import BoardReader, KeyframeStep, PatchStep, Step
from flipsync.domain.manifest import Manifest
from flipsync.engines.base import Engine
from flipsync.errors import EngineUnavailableError, FlipsyncError
from flipsync.sidecar.engine_update import EngineUpdater, WeightsChangedError
from flipsync.sidecar.gate import CommitMode, Notifier, Pause, RequestGate
from flipsync.sidecar.metrics import SidecarMetrics
from flipsync.sidecar.records import Failure, State, Update, classify, now_iso

__all__ = ["Failure", "Replica", "ReplicaConfig", "State", "Update", "classify"]

log = logging.getLogger(__name__)


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
    # Compile (or load from the numba cache) the codec kernels before the first pass (sidecar.warmup): a cold
    # cache then costs its ~10-25 s before the replica reports a version, not inside its first catch-up.
    warm_kernels: bool = True


class Replica:
    """Keeps one engine at the board's HEAD; thread-safe reads of its state for the proxy and control API."""

    def __init__(
        self,
        reader: BoardReader,
        engine: Engine[Any, Any],
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
        # The position on the board (version and view held, artifacts excluded) is the follower's.
        self.follower = Follower(
            reader, max_replans=self.config.max_replans, on_move=self._moved, on_fetch=self._fetched
        )
        self.committer = EngineUpdater(
            engine,
            self.gate,
            mode=self.config.commit_mode,
            drain_timeout_s=self.config.drain_timeout_s,
            on_fault=self._after_engine_fault,
        )
        self._committing: int | None = None
        self.head: int | None = None  # HEAD when last polled
        self.state = State.IDLE
        self._state_since = time.monotonic()
        self._engine_up = True
        self._need_audit = False
        self._adopt_pending = True  # the engine may outlive its sidecar: look at what it holds first
        self._adopted: dict[str, Any] | None = None
        # the served format of the version held (its manifest's), or the engine's before any version
        self.served_format: str | None = getattr(engine, "served_format", None)
        self._fetch_s = 0.0  # how long the step being applied was waited for
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
        self.warmup_s: float | None = None  # how long the codec kernel warm-up took (None: not run)

    # -- what the proxy and the control API read ----------------------------------------------------------

    @property
    def version(self) -> int | None:
        """The verified version the engine holds (None: none yet, or lost after a fault)."""
        return self.follower.version

    @property
    def view_fp(self) -> str | None:
        return self.follower.view_fp

    @property
    def serving(self) -> bool:
        """True when requests may be sent to the engine: a verified version and a healthy engine."""
        return self.version is not None and self._engine_up and not self._need_audit

    def version_upper_bound(self) -> int | None:
        """The newest version a token generated now may come from: a commit under way counts already."""
        with self._n.lock:
            return max((v for v in (self.version, self._committing) if v is not None), default=None)

    def _at_least(self, min_version: int) -> bool:
        version = self.version
        return version is not None and version >= min_version

    def wait_version(self, min_version: int, timeout: float) -> bool:
        return self._n.wait(lambda: self._at_least(min_version), timeout)

    async def wait_version_async(self, min_version: int, timeout: float) -> bool:
        return await self._n.wait_async(lambda: self._at_least(min_version), timeout)

    def status(self) -> dict[str, Any]:
        with self._n.lock:
            version, head = self.version, self.head
            return {
                "run": self.reader.run,
                "served_format": self.served_format,
                "state": self.state.value,
                "state_for_s": round(time.monotonic() - self._state_since, 3),
                "version": version,
                "view_fp": self.view_fp,
                "head": head,
                "lag": None if head is None else head - (version if version is not None else -1),
                "serving": self.serving,
                "committing": self._committing,
                "engine": {"name": self.engine.name, "up": self._engine_up},
                "commit_mode": self.config.commit_mode.value,
                "updates": self._updates,
                "fetched_bytes": self._fetched_bytes,
                "last_update": asdict(self._last_update) if self._last_update else None,
                "adopted": self._adopted,
                "error": asdict(self._error) if self._error else None,
                "last_error": asdict(self._last_error) if self._last_error else None,
                "excluded": [
                    {"kind": e[0], "base": e[1], "target": e[2], "why": str(why)}
                    for e, why in self.follower.excluded.items()
                ],
                "requests_in_flight": self.gate.in_flight,
                "warmup_s": self.warmup_s,
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

    def _warm_kernels(self, served_format: str) -> None:
        from flipsync.sidecar.warmup import warm_codec_kernels  # torch + numba: only where a replica runs

        try:
            self.warmup_s = warm_codec_kernels(served_format)
        except Exception as e:  # optional: the kernels then compile lazily, in the first pass
            log.warning("codec kernel warm-up for %s skipped: %s", served_format, e)

    def wake(self) -> None:
        """Poll now instead of at the next interval (e.g. on a notification that HEAD moved)."""
        self._wakeup.set()

    def _loop(self) -> None:
        failures = 0
        cfg = self.config
        if cfg.warm_kernels and self.served_format is not None:
            self._warm_kernels(self.served_format)
        while not self._stop.is_set():
            ok = self.sync_once()
            failures = 0 if ok else failures + 1
            delay = cfg.poll_interval_s if ok else min(cfg.max_backoff_s, cfg.poll_interval_s * 2 ** min(failures, 20))
            if not ok and (error := self._error) is not None and error.kind == "board_refused":
                delay = cfg.max_backoff_s  # waiting does not heal a refusal: poll slowly until someone fixes it
            delay *= 1 + cfg.jitter * (2 * self._rng.random() - 1)
            if not (ok and self.wait_for_next(delay)):
                self._wakeup.wait(delay)
            self._wakeup.clear()

    def wait_for_next(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the version after HEAD (True: waited, whatever the outcome), at the
        relay when the board is one, in slices of at most a second so that ``stop`` and ``wake`` are seen.
        A `FetchAhead` store also watches that version's folder every ``interval_s``, downloading its parts
        while the trainer is still uploading them. False when the store can do neither (the loop sleeps)."""
        nxt = 0 if self.head is None else self.head + 1
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
            if state is not self.state:
                self.state, self._state_since = state, time.monotonic()
        self.metrics.state.state(state.value)

    def _set_version(self, version: int | None, view_fp: str | None) -> None:
        """Report a version (the engine holds it, verified) or None; the follower notifies ``_moved``."""
        with self._n.lock:
            self.follower.move_to(version, view_fp)

    def _moved(self, version: int | None, view_fp: str | None) -> None:
        with self._n.lock:
            self._n.notify_all()
        self.metrics.version.set(-1 if version is None else version)
        self._update_lag()

    def _update_lag(self) -> None:
        head, version = self.head, self.version
        if head is not None:
            self.metrics.lag.set(head - (version if version is not None else -1))

    def _lose_version(self, why: str) -> None:
        if self.version is not None:
            log.warning("no longer serving v%d: %s; resyncing from a keyframe", self.version, why)
        self._set_version(None, None)

    def _fail(self, e: BaseException) -> None:
        kind = classify(e)
        message = str(e) or type(e).__name__
        with self._n.lock:
            n = self._error.consecutive + 1 if self._error and self._error.kind == kind else 1
            self._error = self._last_error = Failure(kind, message, now_iso(), n)
        self._set_state(State.ERROR)
        self.metrics.failures.labels(kind=kind).inc()
        if n == 1 or n % 50 == 0:
            log.warning("sync failed (%s, %d in a row); still serving %s: %s", kind, n, self.version, message)
        if kind == "internal":
            log.exception("unexpected error in the reconcile loop", exc_info=e)

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
        held = self.committer.call("recompute_table", self.engine.recompute_table).view_fp()
        view_fp = self.view_fp
        if view_fp is not None and held != view_fp:
            self._lose_version(f"{why}, the engine holds view {held[:16]}, not v{self.version}'s {view_fp[:16]}")
        if self.version is None:
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

    def _adopt(self, head: int) -> None:
        """Report the version an engine already holds (it outlived its sidecar), if the board has it."""
        match = self._held_version(head)
        self._adopt_pending = False
        if match is None:
            return
        self.engine.label_version(match.target_view_fp, match.target_version)
        version, view_fp = match.target_version, match.target_view_fp
        with self._n.lock:
            self._adopted = {"version": version, "view_fp": view_fp, "at": now_iso()}
        self._report(match)
        log.info("adopted v%d: the %s engine already holds its view %s", version, self.engine.name, view_fp[:16])

    def _held_version(self, head: int) -> Manifest | None:
        """The manifest of the newest of the ``adopt_search`` versions up to ``head`` whose view the engine holds.

        None (logged) when adoption is off or nothing matches: the caller then loads a keyframe (see
        docs/sidecar.md#adopt-on-boot). Raises ``EngineUnavailableError`` when the engine does not answer.
        """
        engine, reader, search = self.engine, self.reader, self.config.adopt_search
        name = engine.name
        if search <= 0 or not engine.adoptable:
            log.info("not adopting what the %s engine holds (disabled for it); loading a keyframe", name)
            return None
        try:
            held = self.committer.call("recompute_table", engine.recompute_table).view_fp()
        except EngineUnavailableError:
            raise
        except FlipsyncError as e:  # e.g. tensor-parallel replicas disagree: a commit reached some ranks only
            log.warning("cannot read back a consistent view from the %s engine (%s); loading a keyframe", name, e)
            return None
        tracked = engine.table.view_fp()
        if held != tracked:  # patches are staged against ``table``: it must describe the weights
            log.warning(
                "the %s engine's fingerprint table (%s) does not describe its weights (%s); loading a keyframe",
                name,
                tracked[:16],
                held[:16],
            )
            return None
        lowest = max(head - search + 1, min(reader.catalog.list_versions(), default=0))
        match: Manifest | None = None
        hi = head
        while match is None and hi >= lowest:  # newest first, in small batches: usually it is HEAD or close
            lo = max(lowest, hi - 7)
            found = reader.catalog.read_versions(range(lo, hi + 1))
            match = max((m for m in found.values() if m.target_view_fp == held), key=lambda m: m.version, default=None)
            hi = lo - 1
        if match is None:  # the usual case for an engine started from its base weights: info, not a warning
            log.info(
                "the %s engine holds view %s, which is none of v%d..v%d on the board (other weights, or a commit "
                "cut short); loading a keyframe",
                name,
                held[:16],
                lowest,
                head,
            )
        return match

    def _reconcile(self) -> None:
        self._set_state(State.FETCHING)
        head = self.reader.head()
        with self._n.lock:
            self.head = head
        self.metrics.head.set(-1 if head is None else head)
        self._update_lag()
        if head is None:
            return
        if self.version is None and self._adopt_pending:
            self._adopt(head)
        self.follower.sync(lambda step: self._apply(step, self._fetch_s), goal=head)

    def _fetched(self, m: Manifest, wait_s: float) -> None:
        self._fetch_s = wait_s
        with self._n.lock:
            self._fetched_bytes += m.total_size
        self.metrics.fetched_bytes.inc(m.total_size)
        self.metrics.fetch_seconds.observe(wait_s)

    @contextmanager
    def _committing_to(self, version: int) -> Iterator[None]:
        """Mark a commit of ``version`` under way (the proxy stamps tokens with it already)."""
        with self._n.lock:
            self._committing = version
        try:
            yield
        finally:
            with self._n.lock:
                self._committing = None

    def _apply(self, step: Step, fetch_s: float) -> None:
        if isinstance(step, KeyframeStep):
            self._apply_keyframe(step, fetch_s)
        else:
            self._apply_patch(step, fetch_s)
        self._set_state(State.FETCHING)

    def _report(self, m: Manifest) -> None:
        with self._n.lock:
            self.served_format = m.served_format
        self._set_version(m.target_version, m.target_view_fp)

    def _apply_patch(self, step: PatchStep, fetch_s: float) -> None:
        m = step.manifest
        self._set_state(State.STAGING)
        t0 = time.perf_counter()
        try:
            staged = self.committer.stage(step, self.view_fp)
        except WeightsChangedError as e:
            self._lose_version(str(e))
            raise Replan() from e
        stage_s = time.perf_counter() - t0
        self.metrics.stage_seconds.observe(stage_s)
        self._set_state(State.COMMITTING)
        self.engine.label_version(m.target_view_fp, m.target_version)
        pause, commit_s = self.committer.commit(
            staged, m, self._committing_to(m.target_version), lambda: self._report(m)
        )
        self._record(m, m.kind.value, fetch_s, stage_s, commit_s, pause, staged.n_changed)

    def _apply_keyframe(self, step: KeyframeStep, fetch_s: float) -> None:
        m = step.manifest
        self._set_state(State.COMMITTING)
        self.engine.label_version(m.target_view_fp, m.target_version)
        pause, commit_s = self.committer.load(
            step, self._committing_to(m.target_version), lambda: self._report(m), self._lose_version
        )
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
            at=now_iso(),
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
