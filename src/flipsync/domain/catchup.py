"""Catch-up planning, pure: the cheapest way, in downloaded bytes, from a replica's version to a goal version (a
shortest path over patches, spans and keyframes). See docs/board.md#catch-up."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from flipsync.domain.manifest import Kind, Manifest
from flipsync.errors import BoardError, NotFoundError

Edge = tuple[str, int | None, int]  # (kind, base, target), as Manifest.edge


@dataclass(frozen=True)
class CatchupPlan:
    """An ordered list of artifacts whose application moves ``start`` to ``goal``."""

    start: int | None
    goal: int
    steps: tuple[Manifest, ...]

    @property
    def total_bytes(self) -> int:
        return sum(m.total_size for m in self.steps)

    @property
    def downloads(self) -> int:
        return len(self.steps)

    def describe(self) -> str:
        if not self.steps:
            return f"already at v{self.goal}"
        hops = ", ".join(f"keyframe v{m.target_version}" if m.kind is Kind.KEYFRAME else m.where for m in self.steps)
        return f"{'new replica' if self.start is None else f'v{self.start}'} -> v{self.goal}: {hops}"


def plan_catchup(
    start: int | None, goal: int, artifacts: Iterable[Manifest], *, exclude: Collection[Edge] = ()
) -> CatchupPlan:
    """Plan the cheapest path from ``start`` (None: a replica with no weights) to ``goal``, by (bytes, downloads):
    among equally large plans the one with fewer round trips wins. ``exclude``: edges not to take."""
    if start is not None and start > goal:
        raise BoardError(
            f"the replica is at v{start} but the board's HEAD is v{goal}: HEAD moved backwards "
            "(the board was rolled back or replaced); refusing to downgrade"
        )
    if start == goal:
        return CatchupPlan(start, goal, ())

    excluded = set(exclude)
    # Dedupe: for one (kind, base, target) keep the smallest artifact.
    best: dict[Edge, Manifest] = {}
    for m in artifacts:
        e = m.edge
        if e in excluded or m.target_version > goal:
            continue
        if e not in best or m.total_size < best[e].total_size:
            best[e] = m

    # A keyframe can be taken from any state, so it is an edge out of the start node; taking it later in a
    # path could only cost more than taking it first.
    from_node: dict[int | None, list[Manifest]] = {}
    keyframes: list[Manifest] = []
    for e, m in sorted(best.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1] or -1)):
        if m.kind is Kind.KEYFRAME:
            keyframes.append(m)
        else:
            from_node.setdefault(e[1], []).append(m)

    # Dijkstra; nodes are version numbers plus the start (which may be None).
    dist: dict[int | None, tuple[int, int]] = {start: (0, 0)}
    prev: dict[int | None, tuple[int | None, Manifest]] = {}
    counter = itertools.count(1)  # tie-breaker so the heap never compares None with int
    heap: list[tuple[int, int, int, int | None]] = [(0, 0, 0, start)]
    done: set[int | None] = set()
    while heap:
        cost, hops, _, node = heapq.heappop(heap)
        if node in done:
            continue
        done.add(node)
        if node == goal:
            break
        out = list(from_node.get(node, ()))
        if node == start:
            out.extend(keyframes)
        for m in out:
            nxt = m.target_version
            cand = (cost + m.total_size, hops + 1)
            if nxt not in dist or cand < dist[nxt]:
                dist[nxt] = cand
                prev[nxt] = (node, m)
                heapq.heappush(heap, (cand[0], cand[1], next(counter), nxt))

    if goal not in done:
        where = "a new replica" if start is None else f"v{start}"
        raise NotFoundError(
            f"no way from {where} to v{goal} with the artifacts on the board "
            f"({len(best)} usable): the patch chain has a gap and no keyframe reaches v{goal}"
        )
    steps: list[Manifest] = []
    node = goal
    while node != start:
        parent, m = prev[node]
        steps.append(m)
        node = parent
    steps.reverse()
    return CatchupPlan(start, goal, tuple(steps))
