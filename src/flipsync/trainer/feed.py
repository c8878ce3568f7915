"""`ViewFeed`: each step's served view, from the model's masters to an `Item` for the publisher's worker.

It also owns the memory the views take; which thread does what: docs/trainer.md#what-runs-where.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from flipsync.errors import FlipsyncError
from flipsync.formats.cast_diff import CastDiffer
from flipsync.trainer.config import PublisherConfig
from flipsync.trainer.pieces import (
    Fuse,
    FusedDiff,
    Inputs,
    LocalView,
    PieceSpec,
    StateSource,
    ViewPlan,
    check_layout,
    dedupe_tied,
    master_infos,
    plan_view,
    state_of,
    tied_targets,
    view_bytes,
)
from flipsync.trainer.publish_thread import lower_priority
from flipsync.trainer.rank_group import RankGroup
from flipsync.trainer.slot import Item, MemoryAccount
from flipsync.trainer.staging import Stager, StreamFence, cuda_devices


class ViewFeed:
    """Computes, checks and stages the served views of one rank and hands them to ``submit``; ``drop_pending``
    (or None) frees a pending view that the view about to be computed supersedes."""

    def __init__(
        self,
        model: StateSource,
        group: RankGroup,
        fmt: str,
        config: PublisherConfig,
        *,
        submit: Callable[[Item], None],
        drop_pending: Callable[[], None] | None,
    ) -> None:
        self.model = model
        self.group = group
        self.format = fmt
        self.config = config
        self._submit = submit
        self._drop_pending = drop_pending
        self.account = MemoryAccount()
        self.stager = Stager(config.keep_on)
        self.viewer: threading.Thread | None = None  # the view thread, once deferred
        self._jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()  # its jobs, one per step; None: stop
        self._error: BaseException | None = None  # the last job's failure, taken by the publisher
        self._read: StreamFence | None = None  # GPU: the deferred view's reads of the masters
        self.plan = self._make_plan()
        self.expected: dict[str, PieceSpec] = {}
        # The newest view handed on and its item's token: the next view's casts diff against it (`Fuse`).
        # The worker uses those changes only if that view is still its base when it publishes the next one.
        self._ref: tuple[LocalView, object] | None = None
        self._caster: CastDiffer | None = None
        # Plain casts find their changes while they cast (`flipsync.formats.cast_diff`); False: a cast, then a diff
        # of both views (the same patches: ``flipsync bench fused`` and the tests compare the two).
        self.fuse = True

    def _make_plan(self) -> ViewPlan:
        drop_first = tied_targets(self.model)
        masters, aliases = dedupe_tied(state_of(self.model), drop_first)
        infos = self.group.all_gather(master_infos(masters, self.format, self.config.keep), "the model's tensors")
        return plan_view(
            rank=self.group.rank,
            infos=infos,
            order=list(masters),
            aliases=aliases,
            drop_first=drop_first,
            fmt=self.format,
            from_fp32=self.config.from_fp32,
            keep=self.config.keep,
            fused_groups=self.config.fused_groups,
            dtypes=self.config.dtypes,
        )

    # -- full views ---------------------------------------------------------------------------------------

    def _full_view(self) -> tuple[LocalView, Callable[[], None]]:
        """The served view from the plan, staged and held: the layout every later step must keep."""
        view, wait = self.stager.stage(self.plan.compute(self.plan.gather(self.plan.masters(self.model))))
        self.account.add(view_bytes(view))
        self.expected = {n: p.spec(n, self.group.rank) for n, p in view.items()}
        return view, wait

    def first_view(self) -> tuple[LocalView, object]:
        """The served view at start-up, and the token for its item (the next view's changes name it)."""
        view, wait = self._full_view()
        wait()
        self._ref = (view, object())
        return self._ref

    def snapshot(self, step: int) -> Item:
        """A new plan and full view after a layout change (single process): the item of a snapshot."""
        self.plan = self._make_plan()
        view, wait = self._full_view()
        item = Item(step, view, wait, snapshot=True)
        self._ref = (view, item.token)
        return item

    # -- per step -----------------------------------------------------------------------------------------

    def defer(self) -> None:
        """Compute the views of ``after_optimizer_step`` on a background thread from now on."""
        if self.viewer is None:
            self.viewer = threading.Thread(target=self._view_main, name="flipsync-view", daemon=True)
            self.viewer.start()

    def _view_main(self) -> None:
        lower_priority(self.config.nice)
        torch.set_num_threads(self.config.pool_threads)  # per thread (an OpenMP setting): training keeps its own
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                job()
            except BaseException as e:
                self._error = e
            finally:
                self._jobs.task_done()

    def gather(self, step: int) -> Inputs:
        """References to this step's masters (the training thread: may run collectives)."""
        try:
            return self.plan.gather(self.plan.masters(self.model))
        except FlipsyncError as e:
            self.no_view(step, e)
            raise

    def compute(self, inputs: Inputs, step: int, meta: dict[str, str | int]) -> None:
        """This step's served view, checked and handed to the worker (any thread)."""
        if self._drop_pending is not None:
            self._drop_pending()  # about to be superseded: free it before computing the next
        t0 = time.perf_counter()
        ref, fuse = self._ref, None
        if ref is not None and self.fuse:
            # made by the first view computed (the view thread once deferred): its pool inherits that priority
            self._caster = self._caster or CastDiffer(self.config.pool_threads)
            fuse = Fuse(self._caster, ref[0])
        try:
            with self.stager.buffers() as alloc:
                view = self.plan.compute(inputs, alloc, fuse)
                check_layout(view, self.expected)
        except FlipsyncError as e:
            self.no_view(step, e)
            raise
        held, wait = self.stager.stage(view)
        self.account.add(view_bytes(held))
        # Dense changes (Adam's first step) would take more memory than their piece while the view waits:
        # those pieces are diffed again by the worker instead.
        kept = {n: c for n, c in fuse.found.items() if c.nbytes <= view[n].nbytes} if fuse is not None else {}
        fused = FusedDiff(ref[1], kept) if ref is not None and kept else None
        item = Item(step, held, wait, meta=meta, view_s=time.perf_counter() - t0, fused=fused)
        self._ref = (held, item.token)
        self._submit(item)

    def after_optimizer_step(self, step: int, inputs: Inputs | None = None) -> None:
        """The post-step hook's work: gather here (unless ``inputs`` were gathered for this step already),
        compute here or on the view thread."""
        inputs = inputs if inputs is not None else self.gather(step)
        if self.viewer is None:
            self.compute(inputs, step, {})
            return
        devices = cuda_devices(inputs.tensors())
        # GPU: the view's kernels start after the optimizer's (issued on the training thread's stream) ...
        updated = StreamFence(devices).record()

        def job() -> None:
            with torch.cuda.device(devices[0]) if devices else nullcontext():  # a new thread starts on device 0
                updated.wait()
                self.compute(inputs, step, {})
                # ... and the next optimizer step starts after the view's kernels read the masters.
                self._read = StreamFence(devices).record()

        self._jobs.put(job)  # the pre-step hook waits for it before the next one

    def no_view(self, step: int, e: FlipsyncError) -> None:
        if self.group.size > 1:  # the other ranks must learn that this step has no view here
            self._submit(Item(step, None, error=f"{type(e).__name__}: {e}"))

    def settle(self) -> None:
        """Wait for a served view being computed in the background (the masters are about to change)."""
        if self.viewer is not None:
            self._jobs.join()
            read, self._read = self._read, None
            if read is not None:
                read.wait()

    def take_error(self) -> BaseException | None:
        """Why the last deferred view could not be computed (once), or None."""
        e, self._error = self._error, None
        return e

    def close_viewer(self) -> None:
        if self.viewer is not None:
            self._jobs.put(None)
            self.viewer.join()
        if self._caster is not None:
            self._caster.close()
            self._caster = None

    # -- memory -------------------------------------------------------------------------------------------

    def release_view(self, view: LocalView | None) -> None:
        ref = self._ref
        if ref is not None and ref[0] is view:  # its buffers go back to the pool: never diff against it
            self._ref = None
        if view:
            self.stager.release(view)
            self.account.sub(view_bytes(view))

    def release_item(self, item: Item) -> None:
        self.release_view(item.view)
        item.view = None
