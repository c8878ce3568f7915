"""`CadenceTracker` keeps the numbers the cadence policies (`flipsync.board.cadence`) look at current for a
`BoardWriter`: read back from the board on resume, then moved forward by every artifact the writer publishes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from flipsync.board.cadence import KeyframePolicy, SpanPolicy, should_write_keyframe, spans_to_publish
from flipsync.board.catalog import Catalog
from flipsync.domain.manifest import Kind, Manifest
from flipsync.errors import IntegrityError, NotFoundError

log = logging.getLogger(__name__)

SCAN_BATCH = 32  # version manifests read per listing while walking back to the newest keyframe


@dataclass(frozen=True)
class CadenceState:
    """What the keyframe policy looks at, as the publisher last saw the board."""

    keyframe_version: int | None
    keyframe_bytes: int | None
    chain_bytes: int
    versions_since: int


EMPTY = CadenceState(None, None, 0, 0)


def origin_of(m: Manifest) -> int:
    """The first version of ``m``'s lineage: the snapshot its patch chain starts from."""
    if m.kind is Kind.KEYFRAME:
        return m.version
    origin = m.meta.get("origin")
    return origin if isinstance(origin, int) and not isinstance(origin, bool) else 0


class CadenceTracker:
    """One run's cadence state and lineage origin, kept current as its writer publishes."""

    def __init__(self, catalog: Catalog, keyframe_policy: KeyframePolicy, span_policy: SpanPolicy) -> None:
        self.catalog = catalog
        self.keyframe_policy = keyframe_policy
        self.span_policy = span_policy
        self.state = EMPTY
        self.origin: int | None = None  # None: no version seen yet

    def resume(self, head: Manifest | None) -> None:
        """Read the state back from the board at ``head`` (None: an empty run)."""
        if head is None:
            self.state, self.origin = EMPTY, None
            return
        self.origin = origin_of(head)
        self.state = self._scan(head)

    def _scan(self, head: Manifest) -> CadenceState:
        """Walk back from HEAD to the newest keyframe, summing the chain's bytes (bounded, batched reads)."""
        keyframes = set(self.catalog.list_keyframes())
        chain = 0
        since = 0
        hi = head.version
        while since <= self.keyframe_policy.max_interval and hi >= 0:
            lo = max(0, hi - (SCAN_BATCH - 1))
            batch = self.catalog.read_versions(range(lo, hi + 1))
            for v in range(hi, lo - 1, -1):
                if v in keyframes:
                    try:
                        kf = self.catalog.keyframe(v)
                        return CadenceState(v, kf.total_size, chain, since)
                    except (NotFoundError, IntegrityError) as e:
                        log.warning("ignoring unreadable keyframe v%d: %s", v, e)
                m = batch.get(v)
                if m is None:
                    # Retention removed it, or it is damaged: no keyframe in reach.
                    return CadenceState(None, None, chain, since)
                if m.kind is Kind.KEYFRAME:
                    return CadenceState(v, m.total_size, chain, since)
                chain += m.total_size
                since += 1
            hi = lo - 1
        return CadenceState(None, None, chain, since)

    # -- moved forward by the writer ------------------------------------------------------------------

    def snapshot_published(self, m: Manifest) -> None:
        """A snapshot starts a new lineage and is its own keyframe."""
        self.origin = m.version
        self.state = CadenceState(m.version, m.total_size, 0, 0)

    def patch_published(self, m: Manifest) -> None:
        """A patch version lengthens the chain since the keyframe."""
        c = self.state
        self.state = replace(c, chain_bytes=c.chain_bytes + m.total_size, versions_since=c.versions_since + 1)

    def keyframe_published(self, m: Manifest, head_version: int) -> None:
        """An extra keyframe of version ``m.version``: the chain restarts there (up to ``head_version``)."""
        c = self.state
        if c.keyframe_version is not None and m.version < c.keyframe_version:
            return
        later = range(m.version + 1, head_version + 1)
        chain = sum(self.catalog.version(v).total_size for v in later)
        self.state = CadenceState(m.version, m.total_size, chain, len(later))

    # -- what the policies ask for --------------------------------------------------------------------

    @property
    def lineage_origin(self) -> int:
        """The origin recorded in a new patch's manifest (0 before any version)."""
        return self.origin if self.origin is not None else 0

    def keyframe_due(self) -> bool:
        c = self.state
        return should_write_keyframe(
            chain_bytes=c.chain_bytes,
            keyframe_bytes=c.keyframe_bytes,
            versions_since=c.versions_since,
            policy=self.keyframe_policy,
        )

    def spans_due(self, version: int) -> list[tuple[int, int]]:
        return spans_to_publish(version, origin=self.lineage_origin, policy=self.span_policy)
