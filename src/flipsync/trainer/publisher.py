"""`flipsync.trainer.Publisher`: assembles the parts beside it (`config`, `startup`, `feed`, `publish_thread`,
`rounds`) and drives the publisher's life (start, steps, flush, close). See docs/trainer.md.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from flipsync.board import BoardWriter
from flipsync.codec.bits import dtype_named
from flipsync.domain.manifest import check_name
from flipsync.errors import BoardError, ConfigError, ConflictError, FlipsyncError
from flipsync.formats import get_format
from flipsync.stores import Store, open_store
from flipsync.trainer.config import PublisherConfig
from flipsync.trainer.feed import ViewFeed
from flipsync.trainer.pieces import StateSource, ViewPlan
from flipsync.trainer.publish_thread import PublishThread
from flipsync.trainer.rank_group import RankGroup, make_group
from flipsync.trainer.rounds import Published, VersionRounds
from flipsync.trainer.slot import Item, Slot
from flipsync.trainer.startup import Start, decide_start, layout_fingerprint, new_run_name

log = logging.getLogger(__name__)

RETRY_DELAY_S = 0.05  # flush/close: the first wait before publishing a failed last step again (then doubled)
MAX_RETRY_DELAY_S = 2.0


@dataclass(frozen=True)
class PublisherStats:
    """What the publisher did so far (this rank's view of it)."""

    steps: int  # step() calls
    versions: int  # versions this publisher put on the board
    squashed_steps: int  # steps folded into a later version because uploads were behind
    store_failures: int  # failed publications in a row right now
    view_bytes: int  # bytes of this rank's served view
    peak_view_bytes: int  # most bytes of served views held at once (base, in flight, pending)
    head: int | None  # the newest version published (or adopted)


class Publisher:
    """Publishes a model's served view after every optimizer step; docs/trainer.md ("API") tables the arguments.

    Under torch.distributed every rank builds one (a collective) and steps together (docs/trainer.md#sharded-training);
    ``group`` replaces torch.distributed by another `RankGroup` (the tests use threads).
    """

    def __init__(
        self,
        model: StateSource,
        board: str | os.PathLike[str] | Store,
        *,
        format: str = "bf16",
        run: str | None = None,
        resume: bool = False,
        new_weights: bool = False,
        optimizer: torch.optim.Optimizer | None = None,
        group: RankGroup | None = None,
        config: PublisherConfig | None = None,
        first_step: int = 0,
    ) -> None:
        if isinstance(first_step, bool) or not isinstance(first_step, int) or first_step < 0:
            raise ConfigError(f"first_step must be a whole number >= 0, not {first_step!r}")
        # ConfigError for an unknown name, before any collective; manifests carry the canonical name ('BF16' -> bf16)
        format = get_format(format).name
        self.config = cfg = config or PublisherConfig()
        self.model = model
        self.format = format
        self.background = cfg.background
        self._closed = False
        self._reported: BaseException | None = None
        self._hooks: list[Any] = []
        self.store = open_store(board, cfg.store_options)
        self.group: RankGroup = group or make_group(cfg.timeout_s)
        self.run = check_name(self.group.broadcast(run or new_run_name(), "the run name"), "run name")
        self.feed = ViewFeed(
            model,
            self.group,
            format,
            cfg,
            submit=self._submit,
            drop_pending=(lambda: self.slot.drop_pending_view()) if cfg.background and cfg.squash else None,
        )
        self.slot = Slot(self.feed.release_item, squash=cfg.squash)
        self._step = first_step
        self._calls = 0  # step() calls and optimizer steps (the stats), whatever their step numbers
        view, token = self.feed.first_view()

        self.board: BoardWriter | None = None
        if self.group.rank == 0:
            self.board = BoardWriter(
                self.store,
                self.run,
                publisher_id=cfg.publisher_id,
                signer=cfg.signer,
                keyframe_policy=cfg.keyframe_policy,
                span_policy=cfg.span_policy,
            )
        # "context": whether patches code positions against their base, so that a replica that cannot hold the
        # base (a vLLM sidecar without a mirror) refuses the run at boot instead of excluding every patch
        run_meta: dict[str, str | int] = {"format": format, "context": int(cfg.context and cfg.keep_on == "host")}
        if self.plan.aliases:  # served once, under the name a checkpoint keeps
            run_meta["tied"] = ";".join(f"{a}={k}" for a, k in sorted(self.plan.aliases.items()))[:4096]
        self.rounds = VersionRounds(
            group=self.group,
            run=self.run,
            store=self.store,
            board=self.board,
            served_format=format,
            release=self.feed.release_view,
            drop=self.feed.release_item,
            meta=run_meta,
            config=cfg,
        )
        self.worker = PublishThread(self.rounds, self.slot, self.group, cfg)
        layout, table = self.rounds.survey(view)
        if cfg.background:
            self.rounds.close_pools()  # their last use here; the worker makes its own, at its lower priority
        # Every manifest names the view's layout, so that a resume can tell another model from other weights.
        layout_fp = layout_fingerprint(table)
        self.rounds.meta["layout"] = layout_fp
        start: Start | None = None
        if self.board is not None:  # rank 0 decides from the board's HEAD
            start = decide_start(
                self.board.resume(),
                run=self.run,
                board_url=self.store.url,
                view_fp=table.view_fp(),
                layout=layout_fp,
                served_format=format,
                resume=resume,
                new_weights=new_weights,
            )
        kind, head, message = self.group.broadcast(start, "how to start")
        self.started: str = kind  # "new", "adopt" (HEAD held this view), "takeover" (snapshot on HEAD)
        if kind in ("refuse", "refuse_model"):
            self.feed.release_view(view)
            self._shutdown_resources()
            raise ConflictError(message) if kind == "refuse" else ConfigError(message)
        if kind == "adopt":
            self.rounds.adopt(view, first_step, layout, table, head)
            log.info("resumed run %s at v%d: HEAD holds this model's view", self.run, head)
        if cfg.background:
            self.worker.start()
        if kind != "adopt":
            self._submit(Item(first_step, view, snapshot=True, meta=dict(cfg.meta), token=token))
        if optimizer is not None:
            self.attach(optimizer)

    # -- setup ------------------------------------------------------------------------------------------

    @property
    def plan(self) -> ViewPlan:
        """Which pieces of which tensors this rank serves."""
        return self.feed.plan

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Publish after every ``optimizer.step()`` (post-step hook; in the background, a pre-step hook waits for
        the view's reads). Nothing else may change the parameters in place between two optimizer steps."""
        if self._hooks:
            raise ConfigError("this publisher is already attached to an optimizer")
        if self.background:
            self.feed.defer()
        self._hooks = [
            optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self._before_optimizer_step()),
            optimizer.register_step_post_hook(
                lambda _opt, _args, _kwargs: self.feed.after_optimizer_step(self._count_optimizer_step())
            ),
        ]

    # -- per step ---------------------------------------------------------------------------------------

    def step(self, *, meta: Mapping[str, str | int] | None = None, step: int | None = None) -> None:
        """Publish the model's weights as they are now (the view is computed here), with extra manifest ``meta``;
        ``step``: the trainer step they are (``meta.step``, greater than the last one; default the last + 1)."""
        step_no = self._begin_step(step)
        self.feed.compute(self.feed.gather(step_no), step_no, dict(meta or {}))

    def _begin_step(self, step: int | None) -> int:
        """Check and count a ``step()`` call; the trainer step it publishes."""
        self._check_open()
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step <= self._step):
            raise ConfigError(f"step must be a whole number greater than the last step ({self._step}), not {step!r}")
        self.feed.settle()
        self._raise_pending()
        self._step = self._step + 1 if step is None else step
        self._calls += 1
        return self._step

    def _before_optimizer_step(self) -> None:
        self.feed.settle()
        self._raise_pending()  # e.g. the last step's weights were not finite: stop before changing them

    def _count_optimizer_step(self) -> int:
        self._check_open()
        self._raise_pending()
        self._step += 1
        self._calls += 1
        return self._step

    def snapshot(self) -> None:
        """Publish the current weights as a full view at the next version, for a model whose tensors changed
        shape, dtype or names (a patch cannot express that). Single-process only."""
        self._check_open()
        if self.group.size > 1:
            raise ConfigError(
                "snapshot() after a layout change is single-process only; restart the job with resume=True"
            )
        self.flush()
        self._step += 1
        self._calls += 1
        self._submit(self.feed.snapshot(self._step))

    def _submit(self, item: Item) -> None:
        if self.background:
            self.slot.push(item)
            return
        try:
            self.worker.handle(item, item.step)
        except BaseException as e:
            self._reported = e  # raised to the caller right here
            raise
        self._raise_pending()

    # -- waiting and closing ----------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> Published | None:
        """Wait until every step so far is published (or squashed into a published version). A last step
        whose publication failed is published again, until it lands or ``max_store_failures`` is reached."""
        self.feed.settle()
        if not self.slot.wait_idle(timeout_s, lambda: self.worker.alive):
            raise TimeoutError(f"the publisher did not finish uploading within {timeout_s} s")
        self._publish_unpublished(timeout_s)
        self._raise_pending()
        return self.rounds.last

    def _publish_unpublished(self, timeout_s: float | None) -> None:
        """Try again the newest step whose publication failed while no newer step came to cover it."""
        delay = RETRY_DELAY_S
        while self.worker.error is None and (item := self.worker.take_unpublished()) is not None:
            time.sleep(delay)
            delay = min(2 * delay, MAX_RETRY_DELAY_S)
            self._submit(item)
            if self.background and not self.slot.wait_idle(timeout_s, lambda: self.worker.alive):
                raise TimeoutError(f"the publisher did not finish uploading within {timeout_s} s")

    def close(self, timeout_s: float | None = None) -> None:
        """Publish what is pending, stop the background thread and release the held views; raises the
        publisher's fatal error if no earlier call raised it."""
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        try:
            self.feed.close_viewer()
            self.slot.wait_idle(timeout_s, lambda: self.worker.alive)  # inline: at once
            self._publish_unpublished(timeout_s)
            self.slot.close()
            self.worker.join(timeout_s)
            self._raise_pending(closing=True)
        finally:
            self._shutdown_resources()

    def _shutdown_resources(self) -> None:
        self.slot.close()
        self.slot.clear()
        if (held := self.worker.take_unpublished()) is not None:
            self.feed.release_item(held)
        self.rounds.close()
        if not self.background:
            self.rounds.close_pools()
        self.feed.stager.clear()
        self.group.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            self.close()
        except FlipsyncError as e:
            if exc_type is None:
                raise
            log.warning("closing the publisher after an error: %s", e)  # do not hide the original error

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this publisher is closed")

    def _raise_pending(self, *, closing: bool = False) -> None:
        """Raise what the worker hit: a one-off notice, or the fatal error (again on every call but close)."""
        if (failed := self.feed.take_error()) is not None:
            raise failed  # the served view of the last step could not be computed
        w = self.worker
        if w.notice is not None:
            notice, w.notice = w.notice, None
            raise notice
        if w.error is not None and not (closing and w.error is self._reported):
            self._reported = w.error
            if isinstance(w.error, FlipsyncError | TimeoutError):
                raise w.error
            raise BoardError(f"the publisher's background thread failed: {w.error!r}") from w.error

    # -- state ------------------------------------------------------------------------------------------

    @property
    def error(self) -> BaseException | None:
        """What stopped this publisher for good (a refused store, a conflict, a lost rank); None while it
        publishes. A stopped publisher raises it from every later call but ``close()``."""
        return self.worker.error

    @property
    def stats(self) -> PublisherStats:
        return PublisherStats(
            steps=self._calls,
            versions=len(self.worker.published),
            squashed_steps=self.slot.squashed_steps,
            store_failures=self.worker.store_failures,
            view_bytes=sum(s.numel * dtype_named(s.dtype).bits // 8 for s in self.feed.expected.values()),
            peak_view_bytes=self.feed.account.peak,
            head=self.rounds.head,
        )
