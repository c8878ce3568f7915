"""The ranks that publish one version together: a single process, or a gloo group of the publisher's own
(docs/trainer.md#sharded-training). Every collective is bounded by the group's timeout; a failure becomes one
``BoardError`` that says the version was not published.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from flipsync.errors import BoardError, ConfigError

log = logging.getLogger(__name__)
T = TypeVar("T")


class RankGroup(Protocol):
    """The collectives the publisher needs; every call is made by every rank, in the same order."""

    rank: int
    size: int

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        """Every rank's ``obj``, by rank. ``what`` names the exchange in error messages."""
        ...

    def broadcast(self, obj: Any, what: str) -> Any:
        """Rank 0's ``obj`` on every rank."""
        ...

    def gather(self, obj: Any, what: str) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        ...

    def close(self) -> None: ...


class SoloGroup:
    """One process: every collective is the identity."""

    rank = 0
    size = 1

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any, what: str) -> Any:
        return obj

    def gather(self, obj: Any, what: str) -> list[Any] | None:
        return [obj]

    def close(self) -> None:
        pass


class TorchGroup:
    """A gloo group over the ranks of the default torch.distributed world, created for the publisher."""

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("torch.distributed is not initialized; call init_process_group first")
        self._dist = dist
        self.timeout_s = timeout_s
        # new_group is itself a collective over the default group: every rank builds its Publisher.
        self._pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.rank = dist.get_rank(self._pg)
        self.size = dist.get_world_size(self._pg)
        self._root = dist.get_global_rank(self._pg, 0)  # rank 0 of the group, in the default world
        self._broken: str | None = None

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        if self._broken is not None:
            raise BoardError(f"the publisher's process group is broken since {self._broken}; restart the job")
        try:
            return fn()
        except Exception as e:  # gloo raises RuntimeError (peer closed, timeout) and DistBackendError
            self._broken = what
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise BoardError(
                f"rank {self.rank}: exchanging {what} with the other ranks failed within {self.timeout_s:g} s "
                f"({first}); a rank died, hung or left. The version in progress was not published (readers "
                "keep the previous one); restart the job and resume the run"
            ) from e

    def all_gather(self, obj: Any, what: str) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._call(what, lambda: self._dist.all_gather_object(out, obj, group=self._pg))
        return out

    def broadcast(self, obj: Any, what: str) -> Any:
        box = [obj]
        self._call(what, lambda: self._dist.broadcast_object_list(box, src=self._root, group=self._pg))
        return box[0]

    def gather(self, obj: Any, what: str) -> list[Any] | None:
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        self._call(what, lambda: self._dist.gather_object(obj, out, dst=self._root, group=self._pg))
        return out

    def close(self) -> None:
        if self._broken is not None:
            return  # destroying a group with a dead peer can hang; the process is going away anyway
        try:
            # Every rank done with the group before any tears its side down (a gloo shutdown racing a peer
            # that is still using the group, or already gone, is how teardown hangs).
            self._dist.barrier(group=self._pg)
            self._dist.destroy_process_group(self._pg)
        except Exception as e:
            log.debug("could not destroy the publisher's process group: %s", e)


def make_group(timeout_s: float) -> RankGroup:
    """A TorchGroup when torch.distributed runs with more than one rank, else a SoloGroup."""
    import torch.distributed as dist  # present in every torch build (is_available() says whether it works)

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchGroup(timeout_s)
    return SoloGroup()
