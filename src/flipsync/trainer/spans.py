"""Squashed spans for the board's catch-up, each the squash of two halves: the right one just built, the left one
kept from ``2**(l-1)`` versions ago, so at most one left half per level is held. See docs/trainer.md ("Spans").
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from flipsync.codec import Patch, squash

log = logging.getLogger(__name__)

Edge = tuple[int, int]


class SpanMaker:
    """Builds the spans a publisher's cadence asks for from the patches of the versions it published."""

    def __init__(self, due: Callable[[int], list[Edge]]) -> None:
        self._due = due  # version -> the (base, target) spans to publish after it
        self._halves: dict[Edge, list[Patch]] = {}

    def add(self, version: int, patches: list[Patch]) -> list[tuple[int, int, Patch]]:
        """Record version ``version`` (its parts, in order) and return the spans due now."""
        built: dict[Edge, list[Patch]] = {(version - 1, version): patches}
        out: list[tuple[int, int, Patch]] = []
        right: Edge = (version - 1, version)
        for a, b in self._due(version):  # smallest first
            mid = (a + b) // 2
            left = self._halves.get((a, mid))
            if left is None or right != (mid, b):
                log.debug("span v%d-v%d skipped: its left half v%d-v%d is not at hand", a, b, a, mid)
                break
            merged = squash([*left, *built[right]])
            built[(a, b)] = [merged]
            out.append((a, b, merged))
            right = (a, b)
        # Keep what a later span uses as its left half; drop everything else.
        candidates = {**self._halves, **built}
        self._halves = {e: p for e, p in candidates.items() if self._needed(e, version)}
        return out

    def _needed(self, edge: Edge, version: int) -> bool:
        """Whether ``edge`` is the left half of a span due after a later version."""
        a, b = edge
        end = b + (b - a)
        return end > version and (a, end) in self._due(end)
