"""`FlipsyncCallback`: publish every optimizer step of a Hugging Face ``Trainer`` (TRL's trainers included) by
wrapping `flipsync.trainer.Publisher`, single-process, DDP or FSDP2. See docs/integrations/hf.md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from flipsync.errors import ConfigError, FlipsyncError
from flipsync.stores import Store
from flipsync.trainer import Publisher, PublisherConfig
from flipsync.trainer.rounds import Published

log = logging.getLogger(__name__)

# Hugging Face wrappers that hold the trained model as ``.module`` (DDP, DataParallel, DeepSpeed's engine).
_MODULE_WRAPPERS = ("DistributedDataParallel", "DataParallel", "DeepSpeedEngine")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model a checkpoint would hold: DDP / DataParallel / DeepSpeed engines and ``torch.compile``
    wrappers removed (their ``state_dict()`` keys carry ``module.`` / ``_orig_mod.`` prefixes)."""
    for _ in range(16):  # wrappers nest (compile inside DDP); a cycle would be a bug elsewhere
        if type(model).__name__ in _MODULE_WRAPPERS and isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model
    return model


def check_shardable(model: torch.nn.Module, args: TrainingArguments | None = None) -> None:
    """Refuse the sharded setups the publisher cannot read from a callback (FSDP1, DeepSpeed ZeRO-3).

    FSDP1 comes from the Trainer's arguments, accelerate's environment or the model's modules; transformers
    and accelerate default to FSDP2 when no version is given."""
    version: int | None = None
    if args is not None and getattr(args, "fsdp", None):
        config = getattr(args, "fsdp_config", None) or {}
        version = int(config.get("version", config.get("fsdp_version", 2)))
    elif os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes"):
        version = int(os.environ.get("FSDP_VERSION", "2") or 2)
    if version == 1 or any(type(sub).__name__ == "FullyShardedDataParallel" for sub in model.modules()):
        raise ConfigError(
            "FlipsyncCallback cannot publish an FSDP1 model (fsdp_config version 1, or FullyShardedDataParallel "
            "modules): its state_dict() is a collective whose result depends on the trainer's state-dict type. "
            "Train with FSDP2 (fsdp_config version 2, accelerate fsdp_version: 2), whose DTensor parameters the "
            "publisher shards natively, or publish the trainer's checkpoints with "
            "`flipsync watch CKPT_DIR BOARD_URL`"
        )
    if any(hasattr(p, "ds_id") or hasattr(p, "ds_tensor") for p in model.parameters()):
        raise ConfigError(
            "FlipsyncCallback cannot publish a DeepSpeed ZeRO-3 model: its parameters are partitioned "
            "between ranks and gathered only inside DeepSpeed. Use ZeRO stage 1 or 2, FSDP2, or publish the "
            "trainer's checkpoints with `flipsync watch CKPT_DIR BOARD_URL`"
        )


class FlipsyncCallback(TrainerCallback):
    """Publishes the model's served view to a board after every optimizer step of a ``Trainer``.

    ``board``: a URL, path or ``Store``; ``format``: the served format; ``run``: the run's name (default: a
    new one, the same on every rank); ``resume``: continue an existing run; ``step_meta``: record
    ``meta.hf_global_step``. ``config`` is the `PublisherConfig`; other keywords set its fields
    (``background=False``: publish inside ``on_step_end``, exactly one version per optimizer step).
    ``published`` holds the last version. If training raises, Hugging Face does not call ``on_train_end``:
    call ``close()``. A board that refuses writes for good stops the publisher, and ``train()`` raises its
    ``PermanentStoreError`` from the next event (docs/integrations/hf.md).
    """

    def __init__(
        self,
        board: str | os.PathLike[str] | Store,
        *,
        format: str = "bf16",
        run: str | None = None,
        resume: bool = False,
        step_meta: bool = True,
        config: PublisherConfig | None = None,
        **options: Any,
    ) -> None:
        for reserved in ("model", "optimizer"):
            if reserved in options:
                raise ConfigError(
                    f"FlipsyncCallback sets the publisher's {reserved!r} itself (the Trainer's model, one "
                    "version per on_step_end); do not pass it"
                )
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(PublisherConfig)})
        if unknown:
            raise ConfigError(f"FlipsyncCallback: unknown option(s) {', '.join(unknown)}: see PublisherConfig")
        self.board = board
        self.format = format
        self.run = run
        self.resume = resume
        self.step_meta = step_meta
        self.config = dataclasses.replace(config or PublisherConfig(), **options)
        self.publisher: Publisher | None = None
        self.published: Published | None = None

    # -- Trainer events ------------------------------------------------------------------------------

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if self.publisher is not None:
            return
        if model is None:
            raise ConfigError("FlipsyncCallback needs the Trainer's model (the Trainer passes it to callbacks)")
        model = unwrap_model(model)
        check_shardable(model, args)
        self.publisher = Publisher(
            model, self.board, format=self.format, run=self.run, resume=self.resume, config=self.config
        )
        if self.run is None:
            self.run = self.publisher.run
        self.resume = True  # a later train() continues this run
        log.info("flipsync: publishing run %s to %s (%s)", self.publisher.run, self.publisher.store.url, self.format)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.publisher is None:
            return  # on_train_begin refused or was not called: nothing to publish to
        meta: Mapping[str, str | int] = {"hf_global_step": int(state.global_step)} if self.step_meta else {}
        try:
            self.publisher.step(meta=meta)
        except FlipsyncError:
            if self.publisher.error is not None:  # stopped for good (e.g. a board that refuses writes): free it
                pub, self.publisher = self.publisher, None
                self.published = pub.rounds.last
                try:
                    pub.close()  # it does not raise the error it stopped with again
                except FlipsyncError as e:  # a second failure while closing: the first one is what the user sees
                    log.warning("closing the stopped flipsync publisher: %s", e)
            raise

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close()

    # -- lifecycle -----------------------------------------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> Published | None:
        """Wait until every step so far is on the board; the last `Published` (None before any)."""
        if self.publisher is not None:
            self.published = self.publisher.flush(timeout_s)
        return self.published

    def close(self, timeout_s: float | None = None) -> None:
        """Publish what is pending and stop the publisher (idempotent). Raises the publisher's error."""
        pub, self.publisher = self.publisher, None
        if pub is None:
            return
        try:
            self.published = pub.flush(timeout_s)
        finally:
            pub.close(timeout_s)
