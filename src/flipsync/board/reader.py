"""`BoardReader`: discover HEAD, plan the cheapest catch-up, fetch and verify, hand over verified steps (a HEAD
that moved backwards, a board nobody can verify, a damaged artifact each raise a clear error)."""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Collection, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from flipsync.board.catalog import Catalog
from flipsync.board.signing import Verifier
from flipsync.domain.catchup import CatchupPlan, Edge, plan_catchup
from flipsync.domain.manifest import Kind, Manifest
from flipsync.errors import BoardError, IntegrityError, NotFoundError
from flipsync.stores import Store, WaitingStore

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from flipsync.codec import Patch
    from flipsync.codec.fingerprint import FingerprintTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Verified:
    manifest: Manifest

    @property
    def target_version(self) -> int:
        return self.manifest.target_version

    @property
    def target_view_fp(self) -> str:
        return self.manifest.target_view_fp


@dataclass(frozen=True)
class PatchStep(_Verified):
    """A verified patch (or squashed span): its parts, in manifest order, every hash checked."""

    parts: list[bytes]


def join_step(
    step: PatchStep, table: FingerprintTable | None = None, base: Mapping[str, torch.Tensor] | None = None
) -> Patch:
    """A verified board step as one patch: its parts joined by the codec (``table``, ``base``: the receiver's,
    see ``join_parts``), refused unless it goes from the manifest's base view to its target view."""
    from flipsync.codec import Patch, join_parts  # here: reading HEAD (the gateway) needs no torch or codec

    m = step.manifest
    patch = join_parts([Patch.from_bytes(p) for p in step.parts], target=m.target, table=table, base=base)
    m.check_patch(patch.header)
    return patch


@dataclass(frozen=True)
class KeyframeStep(_Verified):
    """A verified keyframe: the full served view at ``target_version``."""

    tensors: dict[str, torch.Tensor]


Step = PatchStep | KeyframeStep


class BoardReader:
    """Read one run of a board: HEAD, catch-up plans, verified downloads."""

    def __init__(self, store: Store, run: str, *, verifier: Verifier | None = None, max_parallel: int = 8) -> None:
        self.store = store
        self.catalog = Catalog(store, run, verifier=verifier, max_parallel=max_parallel)
        self.run = run
        self.prefetch_depth = 2  # downloads kept ahead of the step being applied
        self._max_head: int | None = None

    # -- HEAD -----------------------------------------------------------------------------------------

    def wait_for_version(self, version: int, timeout_s: float) -> bool | None:
        """Wait until ``version``'s manifest exists (True) or ``timeout_s`` passed (False); None at once when
        the store cannot wait (poll instead). Only a hint that HEAD moved: nothing it saw is trusted."""
        if not isinstance(self.store, WaitingStore):
            return None
        return self.store.wait_exists(self.catalog.layout.version_manifest(version), timeout_s)

    def head(self) -> int | None:
        """The board's newest version. Raises BoardError if it is older than one seen before."""
        v = self.catalog.discover_head(self._max_head)
        if self._max_head is not None and (v is None or v < self._max_head):
            raise BoardError(
                f"HEAD of run {self.run!r} on {self.store.url} moved backwards from v{self._max_head} to "
                f"{'nothing' if v is None else f'v{v}'}: the board was rolled back or replaced. "
                "Refusing to follow it; staying on the last good version"
            )
        self._max_head = v
        return v

    # -- planning -------------------------------------------------------------------------------------

    def _versions_back_to_keyframe(self, head: int, floor: int, problems: list[str]) -> list[Manifest]:
        """Version manifests from ``head`` down to the newest snapshot (or ``floor``), in parallel batches."""
        out: list[Manifest] = []
        hi = head
        batch = 4 * self.catalog.max_parallel
        while hi >= floor:
            lo = max(floor, hi - batch + 1)
            ms = list(self.catalog.read_versions(range(lo, hi + 1), problems).values())
            out.extend(ms)
            if any(m.kind is Kind.KEYFRAME for m in ms):
                break
            hi = lo - 1
        return out

    def artifacts(self, local_version: int | None, head: int, problems: list[str] | None = None) -> list[Manifest]:
        """The manifests a plan from ``local_version`` to ``head`` may use (unusable ones noted)."""
        problems = [] if problems is None else problems
        keyframes = [k for k in self.catalog.list_keyframes() if k <= head]
        newest_kf = max(keyframes, default=None)
        lowest = min(self.catalog.list_versions(), default=head)
        if local_version is not None:
            lower = local_version
            # Versions below the oldest retained one are gone: do not ask for each of them.
            ms = list(self.catalog.read_versions(range(max(local_version + 1, lowest), head + 1), problems).values())
            if newest_kf is None and not any(m.kind is Kind.KEYFRAME for m in ms):
                # No keyframe in reach yet: find the newest snapshot too, as a fallback.
                older = self._versions_back_to_keyframe(min(local_version, head), lowest, problems)
                ms += [m for m in older if m.kind is Kind.KEYFRAME]
        else:
            floor = newest_kf if newest_kf is not None else lowest
            ms = self._versions_back_to_keyframe(head, floor, problems)
            snapshots = [m.version for m in ms if m.kind is Kind.KEYFRAME]
            lower = max([*snapshots, *([newest_kf] if newest_kf is not None else []), lowest])
        wanted_kf = [k for k in keyframes if k >= lower or k == newest_kf]
        ms += self.catalog.read_many([partial(self.catalog.keyframe, k) for k in wanted_kf], problems)
        spans = [(a, b) for a, b in self.catalog.list_spans() if a >= lower and b <= head]
        ms += self.catalog.read_many([partial(self.catalog.span, a, b) for a, b in spans], problems)
        return ms

    def plan(
        self, local_version: int | None, goal: int | None = None, *, exclude: Collection[Edge] = ()
    ) -> CatchupPlan:
        """The cheapest way (in bytes) from ``local_version`` (None: a new replica) to ``goal`` (HEAD)."""
        if goal is None:
            goal = self.head()
            if goal is None:
                raise NotFoundError(f"run {self.run!r} on {self.store.url} has no published version yet")
        if local_version is not None and local_version >= goal:
            return plan_catchup(local_version, goal, [])  # nothing to do, or raises: the board moved backwards
        self.catalog.version(goal)  # a HEAD manifest that fails to parse or verify is an error of its own
        problems: list[str] = []
        artifacts = self.artifacts(local_version, goal, problems)
        try:
            plan = plan_catchup(local_version, goal, artifacts, exclude=exclude)
        except NotFoundError as e:
            if not problems:
                raise
            raise NotFoundError(f"{e}; unusable artifacts: {'; '.join(problems[:5])}") from None
        log.info("catch-up plan: %s (%d bytes)", plan.describe(), plan.total_bytes)
        return plan

    # -- fetching -------------------------------------------------------------------------------------

    def fetch(self, m: Manifest) -> Step:
        """Download and verify one artifact."""
        folder = self.catalog.artifact_dir(m)
        parts = self.catalog.fetch_parts(m, folder)
        if m.kind is not Kind.KEYFRAME:
            return PatchStep(m, parts)
        from flipsync.board.keyframes import tensors_from_files  # torch and safetensors: a keyframe's only

        files = {p.path.rsplit("/", 1)[-1]: data for p, data in zip(m.parts, parts, strict=True)}
        try:
            tensors = tensors_from_files(files)
        except IntegrityError as e:
            raise IntegrityError(f"keyframe v{m.version} in {self.store.url}/{folder}: {e}") from None
        return KeyframeStep(m, tensors)

    def prefetch(self, plan: CatchupPlan) -> Iterator[tuple[Manifest, Future[Step]]]:
        """Yield (manifest, future) in plan order, keeping up to ``prefetch_depth`` downloads ahead."""
        pool = ThreadPoolExecutor(self.prefetch_depth, thread_name_prefix="flipsync-fetch")
        pending: deque[tuple[Manifest, Future[Step]]] = deque()
        todo = iter(plan.steps)
        try:
            pending.extend((m, pool.submit(self.fetch, m)) for m in itertools.islice(todo, self.prefetch_depth))
            while pending:
                m, fut = pending.popleft()
                nxt = next(todo, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(self.fetch, nxt)))
                yield m, fut
        finally:
            for _, fut in pending:
                fut.cancel()
            pool.shutdown(wait=True, cancel_futures=True)

    def steps(self, plan: CatchupPlan) -> Iterator[Step]:
        """Verified steps of a plan, in order; each patch's base view is checked against the previous."""
        current: str | None = None
        for m, fut in self.prefetch(plan):
            step = fut.result()
            check_continuity(m, current)
            current = m.target_view_fp
            yield step

    # -- keyframes ------------------------------------------------------------------------------------

    def newest_keyframe(self) -> Manifest:
        """The newest keyframe (extra keyframe or snapshot version) at or below HEAD."""
        head = self.head()
        if head is None:
            raise NotFoundError(f"run {self.run!r} on {self.store.url} has no published version yet")
        candidates = [m for m in self.artifacts(None, head) if m.kind is Kind.KEYFRAME]
        if not candidates:
            raise NotFoundError(f"run {self.run!r} on {self.store.url} has no keyframe at or below v{head}")
        return max(candidates, key=lambda m: (m.version, m.total_size * -1))

    def load_keyframe(self, version: int | None = None) -> dict[str, torch.Tensor]:
        """The full view of a keyframe (the newest one by default, else the keyframe of ``version``)."""
        if version is None:
            m = self.newest_keyframe()
        else:
            try:
                m = self.catalog.keyframe(version)
            except NotFoundError:
                m = self.catalog.version(version)
                if m.kind is not Kind.KEYFRAME:
                    raise NotFoundError(f"v{version} of run {self.run!r} has no keyframe") from None
        step = self.fetch(m)
        assert isinstance(step, KeyframeStep)
        return step.tensors

    def checkpoint_location(self, m: Manifest) -> str:
        """Where a keyframe's shards and index sit, as a URL an engine can load as a checkpoint folder."""
        if m.kind is not Kind.KEYFRAME:
            raise BoardError(f"{m.kind.value} v{m.version} is not a keyframe")
        folder = self.catalog.artifact_dir(m)
        attempt = m.parts[0].path.rpartition("/")[0]
        return f"{self.store.url}/{folder}/{attempt}".rstrip("/")


def check_continuity(m: Manifest, current_fp: str | None) -> None:
    """A patch applies only to its base view; refuse a chain whose views do not line up."""
    if m.kind is Kind.KEYFRAME or current_fp is None:
        return
    if m.base_view_fp != current_fp:
        raise IntegrityError(
            f"{m.where} starts from view {str(m.base_view_fp)[:16]}, but the replica holds view {current_fp[:16]}: "
            "the board's chain does not line up"
        )
