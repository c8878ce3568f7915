"""Retention: delete old versions without breaking any reader inside the retention window, each manifest before
its parts, plus unreferenced parts past a grace period and stale member records. See docs/board.md ("Retention").
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from flipsync.board.catalog import Catalog
from flipsync.board.layout import MANIFEST, MEMBERS, parse_span_name, parse_version_name
from flipsync.domain.manifest import Kind, Manifest
from flipsync.errors import ConfigError, IntegrityError, NotFoundError
from flipsync.stores import ObjectInfo, Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPolicy:
    keep_versions: int = 100  # the newest versions a lagging replica can still catch up from by patches
    keep_seconds: float | None = None  # also keep every version created within this time
    orphan_grace_s: float = 3600.0  # unreferenced parts younger than this may belong to a publish in flight
    member_grace_s: float = 3600.0  # a member record not rewritten for this long belongs to a replica long dead

    def __post_init__(self) -> None:
        if self.keep_versions < 1:
            raise ConfigError("keep_versions must be at least 1 (HEAD always stays)")
        if self.keep_seconds is not None and self.keep_seconds < 0:
            raise ConfigError("keep_seconds must be >= 0")
        if self.orphan_grace_s < 0:
            raise ConfigError("orphan_grace_s must be >= 0")
        if self.member_grace_s <= 0:
            raise ConfigError("member_grace_s must be > 0 (a live replica's record is rewritten every few seconds)")


@dataclass
class GcReport:
    run: str
    head: int | None
    cutoff: int | None  # the oldest version kept (None: nothing to keep or decide)
    newest_keyframe: int | None
    dry_run: bool
    deleted_versions: list[int] = field(default_factory=list)
    deleted_keyframes: list[int] = field(default_factory=list)
    deleted_spans: list[tuple[int, int]] = field(default_factory=list)
    deleted_orphans: int = 0  # objects
    deleted_members: int = 0  # member records of replicas gone for member_grace_s
    deleted_bytes: int = 0
    kept_unreadable: list[str] = field(default_factory=list)  # folders whose manifest could not be read


def _newest_keyframe(cat: Catalog, head: int) -> int | None:
    """The newest readable keyframe at or below HEAD: an extra keyframe, or a newer snapshot version."""
    best = next((k for k in reversed(cat.list_keyframes()) if k <= head and _readable(cat.keyframe, k)), None)
    for v in reversed([v for v in cat.list_versions() if v <= head and (best is None or v > best)]):
        m = _readable(cat.version, v)
        if m is not None and m.kind is Kind.KEYFRAME:
            return v
    return best


def _readable(read: Callable[[int], Manifest], v: int) -> Manifest | None:
    try:
        return read(v)
    except (NotFoundError, IntegrityError):
        return None


def _window_start(cat: Catalog, head: int, policy: RetentionPolicy, now: datetime) -> int:
    start = max(0, head - policy.keep_versions + 1)
    if policy.keep_seconds is None:
        return start
    oldest = now - timedelta(seconds=policy.keep_seconds)
    for v in range(start - 1, -1, -1):
        try:
            m = cat.version(v)
        except NotFoundError:
            break
        except IntegrityError:
            continue  # unreadable: keep it and look further down
        if m.created_at < oldest:
            break
        start = v
    return start


def collect_garbage(
    store: Store, run: str, policy: RetentionPolicy | None = None, *, dry_run: bool = False, now: datetime | None = None
) -> GcReport:
    """Apply the retention policy to one run; return what was (or, with ``dry_run``, would be) deleted."""
    policy = policy or RetentionPolicy()
    now = now or datetime.now(UTC)
    cat = Catalog(store, run)
    head = cat.discover_head()
    if head is None:
        return GcReport(run, None, None, None, dry_run)
    kf = _newest_keyframe(cat, head)
    window = _window_start(cat, head, policy, now)
    versions = cat.list_versions()
    # Without any keyframe a new replica cannot boot anyway; keep every version rather than guess.
    cutoff = min(window, kf) if kf is not None else min(versions, default=head)
    report = GcReport(run, head, cutoff, kf, dry_run)

    grace = now - timedelta(seconds=policy.orphan_grace_s)
    members_gone = now - timedelta(seconds=policy.member_grace_s)
    groups: dict[tuple[str, str], list[ObjectInfo]] = defaultdict(list)
    stale_members: list[ObjectInfo] = []
    root = cat.layout.root + "/"
    for obj in store.list(cat.layout.root):
        bits = obj.path.removeprefix(root).split("/")
        if len(bits) >= 3 and bits[0] in ("versions", "keyframes", "spans"):
            groups[bits[0], bits[1]].append(obj)
        elif len(bits) == 2 and bits[0] == MEMBERS and obj.modified < members_gone:
            stale_members.append(obj)
    report.deleted_members = len(stale_members)
    _delete(store, report, stale_members)

    doomed: list[tuple[tuple[int, int], str, list[ObjectInfo]]] = []
    for (area, name), objs in groups.items():
        v = parse_version_name(name)  # a version or keyframe folder sits among the spans as (v, v)
        span = parse_span_name(name) if area == "spans" else None if v is None else (v, v)
        if span is None:
            continue
        if span[0] < cutoff:
            doomed.append((span, area, objs))
        else:
            report.deleted_orphans += _orphans(cat, f"{root}{area}/{name}", area, span, objs, grace, report)

    # Oldest first, each manifest before its parts.
    for span, area, objs in sorted(doomed):
        _delete(store, report, sorted(objs, key=lambda o: not o.path.endswith("/" + MANIFEST)))
        if area == "versions":
            report.deleted_versions.append(span[0])
        elif area == "keyframes":
            report.deleted_keyframes.append(span[0])
        else:
            report.deleted_spans.append(span)
    log.info(
        "gc %s: HEAD v%d, cutoff v%d, deleted %d versions, %d keyframes, %d spans, %d orphans, %d member records "
        "(%d bytes)%s",
        run,
        head,
        cutoff,
        len(report.deleted_versions),
        len(report.deleted_keyframes),
        len(report.deleted_spans),
        report.deleted_orphans,
        report.deleted_members,
        report.deleted_bytes,
        " [dry run]" if dry_run else "",
    )
    return report


def _orphans(
    cat: Catalog,
    folder: str,
    area: str,
    span: tuple[int, int],
    objs: list[ObjectInfo],
    grace: datetime,
    report: GcReport,
) -> int:
    """Delete the objects of a kept folder that no manifest references and that are past the grace period."""
    manifest_path = f"{folder}/{MANIFEST}"
    referenced: set[str] = set()
    if any(o.path == manifest_path for o in objs):
        try:
            m = _read(cat, area, span)
        except (IntegrityError, NotFoundError) as e:
            # Never delete what an unreadable manifest might reference.
            log.warning("gc keeps %s untouched: %s", folder, e)
            report.kept_unreadable.append(folder)
            return 0
        referenced = {f"{folder}/{path}" for p in m.parts for path, _ in p.objects} | {manifest_path}
    stale = [o for o in objs if o.path not in referenced and o.modified < grace]
    _delete(cat.store, report, stale)
    return len(stale)


def _read(cat: Catalog, area: str, span: tuple[int, int]) -> Manifest:
    if area == "versions":
        return cat.version(span[0])
    if area == "keyframes":
        return cat.keyframe(span[0])
    return cat.span(*span)


def _delete(store: Store, report: GcReport, objs: list[ObjectInfo]) -> None:
    if objs and not report.dry_run:
        store.delete([o.path for o in objs])
    report.deleted_bytes += sum(o.size for o in objs)
