"""Affinity: the turns of one session and the samples of one GRPO group go to one replica (its KV cache holds
their prefix) while it stays eligible, bounded so that no key overloads a replica (docs/fleet.md#affinity).

The first request of a key goes to the replica rendezvous hashing names among the eligible ones (so gateways
that see the same fleet agree without talking), skipping any that holds more than ``factor`` times the mean load
(bounded-load consistent hashing). The replica that served a key is remembered (a bounded LRU per gateway), so
its next turns go there even when a spill or a replica leaving moved it off its hash."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flipsync.domain.balance import load_cap, rendezvous_score
from flipsync.domain.fleet import MemberRecord

OUTCOMES = ("hit", "new", "moved", "spilled", "none")


@dataclass(frozen=True)
class AffinityPolicy:
    """``factor``: a replica at ``factor`` x the mean load (requests in flight here plus its engine's queue) takes
    no new key; ``sticky_factor``: at that multiple it takes no more of the keys it holds (a hot session spills
    over, but the turns of ordinary ones are not moved by a passing imbalance); ``floor``: below this load it
    always may. ``remember``: keys kept per gateway. ``prefix_chars``: how much of a completion prompt names its
    group."""

    enabled: bool = True
    factor: float = 1.25
    sticky_factor: float = 2.0
    floor: int = 8
    remember: int = 100_000
    prefix_chars: int = 1024


class Affinity:
    """Orders a request's candidates with its affine replica first; ``served`` records where a key went."""

    def __init__(self, policy: AffinityPolicy) -> None:
        self.policy = policy
        self.where: OrderedDict[str, str] = OrderedDict()  # key -> replica that last served it

    def order(
        self, key: str | None, ranked: Sequence[MemberRecord], in_flight: Mapping[str, int]
    ) -> tuple[list[MemberRecord], str]:
        """``ranked`` (least loaded first) with the replica for ``key`` moved to the front, and what happened
        (one of OUTCOMES)."""
        if key is None or not self.policy.enabled or not ranked:
            return list(ranked), "none"
        loads = {r.replica: in_flight.get(r.replica, 0) + (r.load.queued if r.load else 0) for r in ranked}
        cap = load_cap(list(loads.values()), self.policy.factor, self.policy.floor)
        remembered = self.where.get(key)
        by_id = {r.replica: r for r in ranked}
        if remembered is not None and remembered in by_id:
            sticky = load_cap(list(loads.values()), self.policy.sticky_factor, self.policy.floor)
            if loads[remembered] < sticky:
                return self._first(ranked, by_id[remembered]), "hit"
        best = max(ranked, key=lambda r: rendezvous_score(key, r.replica))
        if loads[best.replica] < cap:
            chosen, outcome = best, ("new" if remembered is None else "moved")
        else:  # the next by hash under the cap: still deterministic, so other gateways likely agree
            under = [r for r in ranked if loads[r.replica] < cap]
            chosen = max(under, key=lambda r: rendezvous_score(key, r.replica)) if under else ranked[0]
            outcome = "spilled"
        if remembered is not None and remembered in by_id and outcome != "hit":
            outcome = "spilled"  # its replica is there but full
        return self._first(ranked, chosen), outcome

    @staticmethod
    def _first(ranked: Sequence[MemberRecord], chosen: MemberRecord) -> list[MemberRecord]:
        return [chosen, *(r for r in ranked if r is not chosen)]

    def served(self, key: str | None, replica: str) -> None:
        if key is None or not self.policy.enabled:
            return
        where = self.where
        where[key] = replica
        where.move_to_end(key)
        while len(where) > self.policy.remember:
            where.popitem(last=False)
