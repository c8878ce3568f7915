"""The one follow-and-replan loop: `Follower` advances one replica's position only over steps the caller
applied, replanning around missing or damaged artifacts. See docs/board.md ("Catch-up").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from flipsync.board.reader import BoardReader, Step, check_continuity
from flipsync.domain.catchup import CatchupPlan, Edge
from flipsync.domain.manifest import Manifest
from flipsync.errors import BoardError, IntegrityError, NotFoundError, UnusableArtifactError

log = logging.getLogger(__name__)


class Replan(Exception):
    """Raised by ``apply`` after it moved the follower (e.g. to nothing: the engine lost the version it held),
    so that the rest of the way is planned again from the new position."""


class Follower:
    """One replica's position on the board; advances only over verified, applied steps."""

    def __init__(
        self,
        reader: BoardReader,
        *,
        version: int | None = None,
        view_fp: str | None = None,
        max_replans: int = 3,
        on_move: Callable[[int | None, str | None], None] | None = None,  # the new (version, view fp), on each change
        on_fetch: Callable[[Manifest, float], None] | None = None,  # each checked download, seconds waited for it
    ) -> None:
        self.reader = reader
        self.version = version
        self.view_fp = view_fp
        self.max_replans = max_replans
        self.bytes_downloaded = 0
        # Artifacts whose content proved unusable: skipped by every plan until the position is past them.
        self.excluded: dict[Edge, UnusableArtifactError] = {}
        self._on_move = on_move
        self._on_fetch = on_fetch

    def move_to(self, version: int | None, view_fp: str | None) -> None:
        """Set the position (after an apply, an adoption, or None: the view held is unknown, boot from a keyframe)."""
        self.version, self.view_fp = version, view_fp
        if version is not None:  # artifacts that end at or below the version held are no longer in the way
            self.excluded = {e: why for e, why in self.excluded.items() if e[2] > version}
        if self._on_move is not None:
            self._on_move(version, view_fp)

    def sync(self, apply: Callable[[Step], None], *, goal: int | None = None) -> int | None:
        """Catch up to ``goal`` (default HEAD), calling ``apply`` on each verified step in order; return the
        version now held. An error is raised with the position on the last version whose ``apply`` returned."""
        target = goal if goal is not None else self.reader.head()
        if target is None or self.version == target:
            return self.version
        if self.version is not None and self.version > target:
            raise BoardError(
                f"the replica is at v{self.version} but the board's HEAD is v{target}: HEAD moved backwards; "
                "staying on the last good version"
            )
        self._check_local_view()
        transient: set[Edge] = set()
        last: IntegrityError | None = None
        for attempt in range(self.max_replans + 1):
            try:
                plan = self.reader.plan(self.version, target, exclude=transient | set(self.excluded))
            except NotFoundError as e:
                cause = last or next(iter(self.excluded.values()), None)
                if cause is None:
                    raise
                # Routing around a damaged artifact left no way: report the damage itself.
                msg = f"{cause}; and no other way to v{target} yet (waiting for a keyframe or span past it): {e}"
                if isinstance(cause, UnusableArtifactError):
                    raise UnusableArtifactError(msg, edge=cause.edge, kind=cause.kind) from e
                raise IntegrityError(msg) from e
            try:
                failure = self._follow(plan, apply)
            except Replan:
                continue
            if failure is None:
                return self.version
            m, err = failure
            last = err
            if isinstance(err, UnusableArtifactError):
                self.excluded[m.edge] = err
            else:
                transient.add(m.edge)
            self.reader.catalog.forget(m)
            log.warning("excluding %s and planning again: %s", m.where, err)
            if attempt == self.max_replans:
                raise err
        raise BoardError(
            f"still not at v{target} after {self.max_replans + 1} plans (the weights held kept changing under the "
            "replica); trying again"
        )

    def _follow(self, plan: CatchupPlan, apply: Callable[[Step], None]) -> tuple[Manifest, IntegrityError] | None:
        """Fetch and apply a plan's steps in order; return the artifact that proved unusable, if any."""
        t_wait = time.perf_counter()
        for m, fut in self.reader.prefetch(plan):
            try:
                step = fut.result()
                check_continuity(m, self.view_fp)
            except IntegrityError as e:
                return m, e
            self.bytes_downloaded += m.total_size
            if self._on_fetch is not None:
                self._on_fetch(m, time.perf_counter() - t_wait)
            try:
                apply(step)  # any other error propagates as it is; the position stays where it was
            except UnusableArtifactError as e:
                return m, e
            if (self.version, self.view_fp) != (m.target_version, m.target_view_fp):
                self.move_to(m.target_version, m.target_view_fp)
            t_wait = time.perf_counter()
        return None

    def _check_local_view(self) -> None:
        """If the board's record of our version is another view (the board was replaced), start over."""
        if self.version is None or self.view_fp is None:
            return
        try:
            m = self.reader.catalog.version(self.version)
        except (NotFoundError, IntegrityError):
            return  # retention removed it, or it is damaged: the first step's base check still applies
        if m.target_view_fp != self.view_fp:
            log.warning(
                "the board says v%d is view %s, the replica holds %s: no longer serving it, resyncing from a keyframe",
                self.version,
                m.target_view_fp[:16],
                self.view_fp[:16],
            )
            self.move_to(None, None)
