"""Writing one verified board step into the engine: stage while serving, commit under the closed request gate,
check the view the engine then holds. The replica decides what to apply and keeps the books; `EngineUpdater`
only drives the engine, and says what went wrong in terms the replica acts on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from flipsync.board.reader import KeyframeStep, PatchStep, join_step
from flipsync.domain.manifest import Manifest
from flipsync.engines.base import Engine, Staged
from flipsync.errors import (
    BaseMismatchError,
    CorruptPatchError,
    EngineError,
    FlipsyncError,
    PatchError,
    UnusableArtifactError,
    VerificationError,
)
from flipsync.sidecar.gate import CommitMode, Pause, RequestGate

T = TypeVar("T")


class WeightsChangedError(BaseMismatchError):
    """A patch does not apply because the engine no longer holds the view on record (not the patch's fault)."""


class EngineUpdater:
    """Drives one engine through the port for one step at a time, behind a request gate.

    ``on_fault`` is called with any error of a write (commit, rollback, load): the port promises all or
    nothing, but the fault may have been mid-write, so the replica audits the weights.
    """

    def __init__(
        self,
        engine: Engine[Any, Any],
        gate: RequestGate,
        *,
        mode: CommitMode,
        drain_timeout_s: float,
        on_fault: Callable[[BaseException], None],
    ) -> None:
        self.engine = engine
        self.gate = gate
        self.mode = mode
        self.drain_timeout_s = drain_timeout_s
        self._on_fault = on_fault

    def call(self, what: str, fn: Callable[[], T]) -> T:
        """Call the engine; an error that is not a flipsync error becomes an EngineError naming the call."""
        try:
            return fn()
        except FlipsyncError:
            raise
        except Exception as e:
            raise EngineError(f"the {self.engine.name} engine failed in {what}: {type(e).__name__}: {e}") from e

    def _write(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return self.call(what, fn)
        except Exception as e:
            self._on_fault(e)
            raise

    def stage(self, step: PatchStep, view_on_record: str | None) -> Staged:
        """Decode a patch's parts and stage it while the engine serves.

        A patch that cannot be staged on the view it names raises ``UnusableArtifactError``; one refused
        because the engine's weights moved away from ``view_on_record`` raises ``WeightsChangedError``.
        """
        m = step.manifest
        where = m.where
        try:
            # an engine that holds its view in this process can join parts coded against it (ctx)
            patch = join_step(step, self.engine.table, self.engine.host_view)
            return self.call("stage", lambda: self.engine.stage(patch))
        except (CorruptPatchError, VerificationError) as e:
            raise UnusableArtifactError(f"{where} is unusable: {e}", edge=m.edge, kind="corrupt_patch") from e
        except BaseMismatchError as e:
            if self.engine.table.view_fp() != view_on_record:
                raise WeightsChangedError(f"the engine's weights changed under the sidecar ({e})") from e
            raise UnusableArtifactError(
                f"{where} does not apply to its own base view: {e}", edge=m.edge, kind="corrupt_patch"
            ) from e
        except PatchError as e:  # sound, but this engine cannot decode it (coded against a base it cannot read)
            raise UnusableArtifactError(
                f"{where} cannot be staged by the {self.engine.name} engine: {e}", edge=m.edge, kind="undecodable"
            ) from e

    def commit(
        self, staged: Staged, m: Manifest, committing: AbstractContextManager[None], report: Callable[[], None]
    ) -> tuple[Pause, float]:
        """Commit under the closed gate; ``report`` the version once the engine's view is ``m``'s target.

        ``committing`` is entered once the gate is closed (the replica marks the version under way). A view
        other than the target is rolled back and raises ``VerificationError``. Returns the pause and the
        seconds the commit itself took.
        """
        with self.gate.closed(self.mode, self.drain_timeout_s) as pause, committing:
            t1 = time.perf_counter()
            undo = self._write("commit", lambda: self.engine.commit(staged))
            commit_s = time.perf_counter() - t1
            held = self.engine.table.view_fp()
            if held != m.target_view_fp:
                self._write("rollback", lambda: self.engine.rollback(undo))
                raise VerificationError(
                    f"after committing v{m.target_version} the engine holds view {held[:16]}, not "
                    f"{m.target_view_fp[:16]}; rolled back to v{m.base_version}"
                )
            report()
        return pause, commit_s

    def load(
        self,
        step: KeyframeStep,
        committing: AbstractContextManager[None],
        report: Callable[[], None],
        lost: Callable[[str], None],
    ) -> tuple[Pause, float]:
        """Load a keyframe under the closed gate; ``report`` it once the engine holds its view.

        A keyframe that loads as another view calls ``lost`` (the engine holds no version now) and raises
        ``UnusableArtifactError``.
        """
        m = step.manifest
        with self.gate.closed(self.mode, self.drain_timeout_s) as pause, committing:
            t1 = time.perf_counter()
            self._write("load_view", lambda: self.engine.load_view(step.tensors))
            commit_s = time.perf_counter() - t1
            held = self.engine.table.view_fp()
            if held != m.target_view_fp:
                lost(f"keyframe v{m.version} loaded as view {held[:16]}")
                raise UnusableArtifactError(
                    f"keyframe v{m.version} holds view {held[:16]}, but its manifest says {m.target_view_fp[:16]}",
                    edge=m.edge,
                    kind="bad_keyframe",
                )
            report()
        return pause, commit_s
