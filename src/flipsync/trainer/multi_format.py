"""`MultiFormatPublisher`: one trainer publishing several served formats of one model, a run per format, from one
gather per step; no run squashes, so version N is the same step in every run. See docs/fleet.md ("Islands").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from flipsync.errors import ConfigError, FlipsyncError
from flipsync.formats import get_format
from flipsync.stores import Store, open_store
from flipsync.trainer.config import PublisherConfig
from flipsync.trainer.pieces import Inputs, StateSource
from flipsync.trainer.publisher import Publisher, PublisherStats
from flipsync.trainer.rounds import Published
from flipsync.trainer.startup import new_run_name

log = logging.getLogger(__name__)


class MultiFormatPublisher:
    """A `Publisher` per served format (at least one, each once), each its own run ``{run}-{format}``, stepped
    together; the other arguments are `Publisher`'s, with ``squash`` off (see the module doc)."""

    def __init__(
        self,
        model: StateSource,
        board: str | os.PathLike[str] | Store,
        formats: Sequence[str],
        *,
        run: str | None = None,
        resume: bool = False,
        new_weights: bool = False,
        optimizer: torch.optim.Optimizer | None = None,
        config: PublisherConfig | None = None,
        first_step: int = 0,
    ) -> None:
        names = [get_format(f).name for f in formats]  # ConfigError for an unknown one
        if not names:
            raise ConfigError("MultiFormatPublisher needs at least one served format")
        if len(set(names)) != len(names):
            raise ConfigError(f"each served format once, not {list(formats)}")
        cfg = replace(config or PublisherConfig(), squash=False)
        store = open_store(board, cfg.store_options)
        base = run or new_run_name()
        self.publishers: dict[str, Publisher] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        try:
            for fmt in names:
                self.publishers[fmt] = Publisher(
                    model,
                    store,
                    format=fmt,
                    run=f"{base}-{fmt}",
                    resume=resume,
                    new_weights=new_weights,
                    config=cfg,
                    first_step=first_step,
                )
        except BaseException:
            self.close()
            raise
        plans = [p.plan for p in self.publishers.values()]
        # One gather serves every format when they all serve the same tensors the same way on this rank.
        self._shared = all(
            (q.owned, q.pieces, q.gathered) == (plans[0].owned, plans[0].pieces, plans[0].gathered) for q in plans
        )
        if not self._shared:
            log.info("the formats split the model differently across ranks: each gathers its own masters")
        if optimizer is not None:
            self.attach(optimizer)

    @property
    def runs(self) -> dict[str, str]:
        return {fmt: p.run for fmt, p in self.publishers.items()}

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Publish every format after every ``optimizer.step()`` (as `Publisher.attach`)."""
        if self._hooks:
            raise ConfigError("this publisher is already attached to an optimizer")
        pubs = list(self.publishers.values())
        for p in pubs:
            if p.background:
                p.feed.defer()

        def before(_opt: object, _args: object, _kwargs: object) -> None:
            for p in pubs:
                p._before_optimizer_step()

        def after(_opt: object, _args: object, _kwargs: object) -> None:
            (step,) = {p._count_optimizer_step() for p in pubs}  # they step together: one number
            inputs = self._gather(step)
            for p in pubs:
                p.feed.after_optimizer_step(step, inputs)

        self._hooks = [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]

    def step(self, *, meta: Mapping[str, str | int] | None = None, step: int | None = None) -> None:
        """Publish every format of the model's weights as they are now (as `Publisher.step`)."""
        pubs = list(self.publishers.values())
        (number,) = {p._begin_step(step) for p in pubs}
        inputs = self._gather(number)
        for p in pubs:
            p.feed.compute(inputs if inputs is not None else p.feed.gather(number), number, dict(meta or {}))

    def _gather(self, step: int) -> Inputs | None:
        """This step's masters, gathered once for every format (None: each gathers its own)."""
        if not self._shared:
            return None
        first, *others = self.publishers.values()
        try:
            return first.feed.gather(step)
        except FlipsyncError as e:
            for p in others:  # under torch.distributed, the other runs' ranks must learn it too
                p.feed.no_view(step, e)
            raise

    def flush(self, timeout_s: float | None = None) -> dict[str, Published | None]:
        """Wait until every step so far is published in every format; each format's last version."""
        return {fmt: p.flush(timeout_s) for fmt, p in self.publishers.items()}

    def close(self, timeout_s: float | None = None) -> None:
        """Close every format's publisher (all of them, even when one fails); raises the first failure."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        first: BaseException | None = None
        for p in self.publishers.values():
            try:
                p.close(timeout_s)
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    @property
    def stats(self) -> dict[str, PublisherStats]:
        return {fmt: p.stats for fmt, p in self.publishers.items()}

    @property
    def error(self) -> BaseException | None:
        """The first format's publisher that stopped for good: its error (see `Publisher.error`)."""
        return next((p.error for p in self.publishers.values() if p.error is not None), None)

    def __enter__(self) -> MultiFormatPublisher:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            self.close()
        except FlipsyncError as e:
            if exc_type is None:
                raise
            log.warning("closing the publishers after an error: %s", e)
