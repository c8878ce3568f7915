"""Named tensors in and out, for other RL stacks: `StepPublisher` publishes one set of whole named tensors
per sync, `HostReplica` follows a run and says what each catch-up changed (docs/integrations/verl.md, slime.md)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from flipsync.board import BoardReader, Follower, KeyframeStep, PatchStep, Step
from flipsync.board.reader import join_step
from flipsync.codec import ClassIndex, commit, stage
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.errors import BoardError, ConfigError, VerificationError
from flipsync.stores import Store, StoreOptions, open_store
from flipsync.trainer import Publisher, PublisherConfig, SoloGroup
from flipsync.trainer.rounds import Published

log = logging.getLogger(__name__)


class StepPublisher:
    """Publishes whole sets of named tensors as consecutive versions of one run, each at the caller's step.

    The first ``publish`` starts the run (or adopts / takes over HEAD with ``resume=True``), later ones
    publish a patch; each returns once the version is on the board. A step that does not move forward (None,
    or a step synced twice) is published as the last step + 1, the caller's number kept in ``meta[step_key]``.
    Single process: the caller gathers the tensors on one rank and calls this there; they are not kept.
    """

    def __init__(
        self,
        board: str | os.PathLike[str] | Store,
        *,
        run: str,
        format: str = "bf16",
        resume: bool = False,
        new_weights: bool = False,
        step_key: str = "source_step",
        config: PublisherConfig | None = None,
    ) -> None:
        if not run:
            raise ConfigError("name the run (run=...): the trainer and the rollout side must agree on it")
        self.config = config or PublisherConfig()
        self.store = open_store(board, self.config.store_options)
        self.run = run
        self.format = format
        self.resume = resume
        self.new_weights = new_weights
        self.step_key = step_key
        self.publisher: Publisher | None = None
        self.last_step: int | None = None
        self._tensors: Mapping[str, torch.Tensor] = {}

    def publish(
        self, tensors: Mapping[str, torch.Tensor], step: int | None, meta: Mapping[str, str | int] | None = None
    ) -> Published:
        """Publish ``tensors`` as the next version at ``step``; the `Published` version."""
        extra: dict[str, str | int] = dict(meta or {})
        if step is not None:
            extra[self.step_key] = int(step)
        self._tensors = tensors
        try:
            if self.publisher is None:
                first = int(step) if step is not None and step >= 0 else 0
                self.publisher = Publisher(
                    lambda: self._tensors,
                    self.store,
                    format=self.format,
                    run=self.run,
                    resume=self.resume,
                    new_weights=self.new_weights,
                    group=SoloGroup(),
                    config=replace(self.config, meta={**self.config.meta, **extra}),
                    first_step=first,
                )
                self.last_step = first
            else:
                assert self.last_step is not None
                moved = step is not None and step > self.last_step
                at = int(step) if moved and step is not None else self.last_step + 1
                if not moved:
                    log.info("step %s does not move past %d: publishing it as step %d", step, self.last_step, at)
                self.publisher.step(step=at, meta=extra)
                self.last_step = at
            published = self.publisher.flush()
        finally:
            self._tensors = {}
        if published is None:  # resumed onto a HEAD that already holds these weights
            head = self.publisher.stats.head
            return Published(head if head is not None else 0, self.last_step or 0, 0, "adopt", 0, 0)
        return published

    def close(self) -> None:
        pub, self.publisher = self.publisher, None
        if pub is not None:
            pub.close()


@dataclass(frozen=True)
class Catchup:
    """What one `HostReplica.sync` did: the version now held and what moved since the last sync.

    ``changed``: per tensor name, the flat positions (int64, sorted, unique) whose values changed; None when
    every tensor must be taken whole (the first sync, or a keyframe replaced the view).
    """

    version: int
    step: int
    changed: dict[str, torch.Tensor] | None


class HostReplica:
    """A host copy of one run's served view, kept current from the board."""

    def __init__(
        self,
        board: str | os.PathLike[str] | Store,
        *,
        run: str,
        store_options: StoreOptions | None = None,
        poll_s: float = 0.2,
    ) -> None:
        if not run:
            raise ConfigError("name the run (run=...): the trainer and the rollout side must agree on it")
        self.store = open_store(board, store_options)
        self.run = run
        self.reader = BoardReader(self.store, run)
        self.follower = Follower(self.reader)
        self.poll_s = poll_s
        self.tensors: dict[str, torch.Tensor] = {}
        self.table = FingerprintTable()
        self.index = ClassIndex()
        self._changed: dict[str, list[torch.Tensor]] | None = None

    def version_for_step(self, step: int | None, timeout_s: float) -> int:
        """The newest version once HEAD holds trainer step ``step`` or a later one (HEAD as it is for None);
        BoardError after ``timeout_s`` without one."""
        deadline = time.monotonic() + timeout_s
        while True:
            head = self.reader.head()
            if head is not None:
                if step is None:
                    return head
                held = self.reader.catalog.version(head).meta.get("step")
                if isinstance(held, int) and held >= step:
                    return head
            left = deadline - time.monotonic()
            if left <= 0:
                raise BoardError(
                    f"no version of run {self.run!r} on {self.store.url} holds trainer step {step} after "
                    f"{timeout_s:g} s (HEAD: {'none' if head is None else f'v{head}'}); is the trainer side "
                    "publishing to the same board and run?"
                )
            waited = self.reader.wait_for_version(0 if head is None else head + 1, min(left, 1.0))
            if waited is None:
                time.sleep(min(left, self.poll_s))

    def sync(self, version: int) -> Catchup:
        """Catch up to ``version`` (applying every step in between) and say what changed."""
        held = self.follower.version
        if held is not None and version <= held:  # already there (a repeated sync): nothing moved
            return Catchup(held, self._step(held), {})
        self._changed = None if held is None else {}
        self.follower.sync(self._apply, goal=version)
        changed = None if self._changed is None else {n: torch.unique(torch.cat(p)) for n, p in self._changed.items()}
        self._changed = {}
        return Catchup(version, self._step(version), changed)

    def _step(self, version: int) -> int:
        """The trainer step ``version`` holds (its number when the manifest names none)."""
        step = self.reader.catalog.version(version).meta.get("step")
        return step if isinstance(step, int) else version

    def _apply(self, step: Step) -> None:
        if isinstance(step, KeyframeStep):
            self.tensors = {k: v.clone() for k, v in step.tensors.items()}
            self.table = FingerprintTable.of(self.tensors)
            self.index = ClassIndex()
            self._changed = None  # the whole view was replaced
        else:
            assert isinstance(step, PatchStep)
            patch = join_step(step, self.table, self.tensors)
            writes = stage(self.tensors, patch, self.table, index=self.index)
            commit(self.tensors, writes, self.table, index=self.index)
            if self._changed is not None:
                for w in writes:
                    if w.positions.numel():
                        self._changed.setdefault(w.name, []).append(w.positions.to(torch.int64).reshape(-1))
        if self.table.view_fp() != step.manifest.target_view_fp:
            raise VerificationError(
                f"after applying v{step.manifest.target_version} the host copy is not the version's view"
            )
