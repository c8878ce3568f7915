"""`flipsync.trainer.Publisher`: publish a torch model's served view to a board after every optimizer step.

```python
pub = Publisher(model, "s3://bucket/board", format="bf16", run="grpo-7b-0412", optimizer=opt)
for batch in data:
    loss(model, batch).backward(); opt.step(); opt.zero_grad()   # the post-step hook calls pub.step()
pub.close()                                                       # waits for the last upload
```

Attached to an optimizer, the post-step hook only collects references to the masters; a background
thread computes the served view (torch ops on the parameters' devices: a cast or a quantization recipe,
plus a copy to pinned host memory) while the next forward and backward run, and a pre-step hook holds the
next ``optimizer.step()`` until that view is read. Another background thread diffs, encodes and uploads.
See docs/trainer.md for the threads, the back-pressure policy, sharded training and error handling.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import torch

from flipsync.board import Publisher as BoardPublisher
from flipsync.board.cadence import KeyframePolicy, SpanPolicy
from flipsync.board.signing import Signer
from flipsync.board.store import Store, StoreOptions, open_store
from flipsync.codec import DiffEngine, FingerprintTable, Hasher
from flipsync.codec.bits import dtype_named
from flipsync.domain.manifest import check_name
from flipsync.errors import BoardError, ConfigError, ConflictError, FlipsyncError
from flipsync.formats import get_format
from flipsync.trainer.commit import DEFAULT_CHUNK_BYTES, check_chunk_bytes
from flipsync.trainer.engine import Engine, Published
from flipsync.trainer.group import Group, make_group
from flipsync.trainer.slot import Item, MemoryAccount, Slot
from flipsync.trainer.staging import KeepOn, Stager, StreamFence, cuda_devices, on_devices
from flipsync.trainer.view import (
    Inputs,
    KeepFn,
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
from flipsync.trainer.viewer import ViewThread
from flipsync.trainer.worker import Worker

log = logging.getLogger(__name__)

RETRY_DELAY_S = 0.05  # flush/close: the first wait before publishing a failed last step again (then doubled)
MAX_RETRY_DELAY_S = 2.0

FusedGroups = Literal["auto"] | Sequence[Sequence[str]] | None


def default_threads() -> int:
    """Threads for the background diff and hash pools: half of this rank's share of the cores, leaving the
    rest to training. Ranks on one node (torchrun's ``LOCAL_WORLD_SIZE``) share its cores."""
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local_ranks = 1
    return max(1, (os.cpu_count() or 2) // local_ranks // 2)


def new_run_name(prefix: str = "run") -> str:
    """A run name no earlier run has: UTC time plus random bits."""
    return f"{prefix}-{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


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


def layout_fingerprint(table: FingerprintTable) -> str:
    """The served view's tensor names, dtypes and shapes (not its values), as 16 hex digits."""
    h = hashlib.blake2b(digest_size=8)
    for name in sorted(table):
        t = table[name]
        h.update(f"{name}\t{t.dtype}\t{','.join(map(str, t.shape))}\n".encode())
    return h.hexdigest()


class Publisher:
    """Publishes a model's served view after every optimizer step (see the module doc).

    ``board``: a URL or path (``file://``, ``s3://``, ...) or a ``Store``. ``run``: the run's name on the
    board (default: a new unique name); an existing run is refused unless ``resume=True``, which continues
    it when HEAD holds this model's view and otherwise takes over with a snapshot at HEAD + 1, as long as
    the served view has HEAD's tensors (names, dtypes, shapes) and format: other weights of the same model.
    Another model is refused (ConfigError) unless ``new_weights=True`` says to replace the run's weights.
    ``keep_on``: where the previous view is kept, "host" (pinned CPU memory) or "device".
    ``defer_view``: when attached to an optimizer, compute each served view on a background thread while
    the next forward and backward run (see `attach`); ``False`` computes it inside the post-step hook.
    ``background=False`` publishes inside ``step()`` (simpler to debug; the step waits for the upload).
    Under torch.distributed every rank builds a Publisher (a collective) and calls ``step()`` for the same
    steps; each rank publishes its own shard of the view as one part of each version. ``group`` replaces
    torch.distributed by another implementation of the `Group` collectives (advanced; the tests use threads).
    ``chunk_bytes``: a part is uploaded while it is coded, in objects of about this size, so that readers
    watching the board (`flipsync.board.ahead`) download it while the trainer is still diffing.
    """

    def __init__(
        self,
        model: StateSource,
        board: str | os.PathLike[str] | Store,
        *,
        format: str = "bf16",
        fused_groups: FusedGroups = "auto",
        from_fp32: bool = False,
        keep: KeepFn | None = None,
        run: str | None = None,
        resume: bool = False,
        new_weights: bool = False,
        optimizer: torch.optim.Optimizer | None = None,
        background: bool = True,
        defer_view: bool = True,
        keep_on: KeepOn = "host",
        publisher_id: str | None = None,
        signer: Signer | None = None,
        keyframe_policy: KeyframePolicy | None = None,
        span_policy: SpanPolicy | None = None,
        spans: bool = True,
        max_store_failures: int = 3,
        manifest_retry_s: float = 30.0,
        timeout_s: float = 300.0,
        nice: int = 19,
        threads: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        store_options: StoreOptions | None = None,
        meta: Mapping[str, str | int] | None = None,
        group: Group | None = None,
    ) -> None:
        # ConfigError for an unknown name, before any collective; manifests carry the canonical name ('BF16' -> bf16)
        format = get_format(format).name
        threads = threads or default_threads()
        if max_store_failures < 1:
            raise ConfigError("max_store_failures must be at least 1")
        check_chunk_bytes(chunk_bytes)  # here, not at the first publication on the worker
        self.model = model
        self.format = format
        self.background = background
        self._fused_groups = fused_groups
        self._from_fp32 = from_fp32
        self._keep = keep
        self._closed = False
        self._reported: BaseException | None = None
        self._hooks: list[Any] = []
        self._viewer: ViewThread | None = None
        self._read: StreamFence | None = None  # GPU: the deferred view's reads of the masters
        self._nice, self._threads, self._defer_view = nice, threads, defer_view
        self.store = board if isinstance(board, Store) else open_store(board, store_options)
        self.group: Group = group or make_group(timeout_s)
        self.run = check_name(self.group.broadcast(run or new_run_name(), "the run name"), "run name")
        self.account = MemoryAccount()
        self.stager = Stager(keep_on)
        self.slot = Slot(self._release_item)
        self._step = 0

        self.plan = self._make_plan()
        view = self._serve()
        staged = self.stager.stage(view)
        staged.wait()
        view = staged.view
        self.account.add(view_bytes(view))
        self._expected: dict[str, PieceSpec] = {n: p.spec(n, self.group.rank) for n, p in view.items()}

        rank0 = self.group.rank == 0
        self.board: BoardPublisher | None = (
            BoardPublisher(
                self.store,
                self.run,
                publisher_id=publisher_id,
                signer=signer,
                keyframe_policy=keyframe_policy,
                span_policy=span_policy,
                manifest_retry_s=manifest_retry_s,
            )
            if rank0
            else None
        )
        run_meta: dict[str, str | int] = {"format": format}
        if self.plan.aliases:  # served once, under the name a checkpoint keeps
            run_meta["tied"] = ";".join(f"{a}={k}" for a, k in sorted(self.plan.aliases.items()))[:4096]
        self.engine = Engine(
            group=self.group,
            run=self.run,
            store=self.store,
            board=self.board,
            served_format=format,
            hasher=Hasher(threads),
            differ=DiffEngine(threads),
            release=self._release_view,
            spans=spans,
            meta=run_meta,
            chunk_bytes=chunk_bytes,
        )
        layout, table = self.engine.survey(view)
        # Every manifest names the view's layout, so that a resume can tell another model from other weights.
        layout_fp = layout_fingerprint(table)
        self.engine.meta["layout"] = layout_fp
        decision = self.group.broadcast(
            self._decide(table.view_fp(), layout_fp, resume, new_weights) if rank0 else None,
            "how to start",
        )
        kind, head, message = decision
        self.started: str = kind  # "new", "adopt" (HEAD held this view), "takeover" (snapshot on HEAD)
        if kind in ("refuse", "refuse_model"):
            self._release_view(view)
            self._shutdown_resources()
            raise ConflictError(message) if kind == "refuse" else ConfigError(message)
        self.worker = Worker(
            self.engine,
            self.slot,
            self.group,
            release=self._release_item,
            max_store_failures=max_store_failures,
            agree_timeout_s=timeout_s,
            nice=nice,
            threads=threads,
        )
        if kind == "adopt":
            self.engine.adopt(view, 0, layout, table, head)
            log.info("resumed run %s at v%d: HEAD holds this model's view", self.run, head)
        if background:
            # The worker builds its own (lower-priority) pools.
            self.engine.hasher.close()
            self.engine.differ.close()
            self.worker.start()
        if kind != "adopt":
            self._submit(Item(0, view, snapshot=True, meta=dict(meta or {})))
        if optimizer is not None:
            self.attach(optimizer)

    # -- setup ------------------------------------------------------------------------------------------

    def _make_plan(self) -> ViewPlan:
        drop_first = tied_targets(self.model)
        masters, aliases = dedupe_tied(state_of(self.model), drop_first)
        infos = self.group.all_gather(master_infos(masters, self.format, self._keep), "the model's tensors")
        return plan_view(
            rank=self.group.rank,
            infos=infos,
            order=list(masters),
            aliases=aliases,
            drop_first=drop_first,
            fmt=self.format,
            from_fp32=self._from_fp32,
            keep=self._keep,
            fused_groups=self._fused_groups,
        )

    def _serve(self) -> LocalView:
        return self.plan.serve(self.plan.masters(self.model))

    def _decide(self, view_fp: str, layout: str, resume: bool, new_weights: bool) -> tuple[str, int | None, str]:
        """Rank 0: start a run, continue it, take it over, or refuse (an existing run without resume, or
        another model's view without new_weights)."""
        assert self.board is not None
        head = self.board.resume()
        if head is None:
            return "new", None, ""
        if not resume:
            return (
                "refuse",
                head.version,
                f"run {self.run!r} already exists on {self.store.url} (HEAD v{head.version}, published by "
                f"{head.publisher} at {head.created}); a new run never mixes with an old one: choose another "
                "run name (or none, for a fresh one), or continue it with resume=True (CLI: --resume)",
            )
        if head.target_view_fp == view_fp and head.served_format == self.format:
            return "adopt", head.version, ""
        # Runs published before manifests named their layout: only the format can be compared.
        head_layout = head.meta.get("layout")
        other_format = head.served_format != self.format
        other_model = other_format or (head_layout is not None and head_layout != layout)
        if other_model and not new_weights:
            what = (
                f"served format {self.format}, HEAD's is {head.served_format}"
                if other_format
                else "tensors (names, dtypes or shapes) that differ from HEAD's"
            )
            return (
                "refuse_model",
                head.version,
                f"cannot resume run {self.run!r} on {self.store.url}: this model's served view has {what} "
                f"(HEAD v{head.version}); its replicas were built for that model. Publish to a new run (another "
                "--run name, or none for a fresh one), or replace the run's weights on purpose with "
                "new_weights=True (CLI: --resume --new-weights)",
            )
        log.warning(
            "run %s: HEAD v%d holds %s; taking over with a snapshot at v%d",
            self.run,
            head.version,
            "another model's view (new_weights)"
            if other_model
            else "other weights of this model"
            if head_layout is not None
            else "another view (its manifests predate layout checks)",
            head.version + 1,
        )
        return "takeover", head.version, ""

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Publish after every ``optimizer.step()`` (post-step hook).

        With ``background=True`` the hook only collects the masters; the served view is computed on a
        background thread while the next forward and backward run, and a pre-step hook makes the next
        ``optimizer.step()`` wait until it is done (see `flipsync.trainer.viewer`). Nothing else may change
        the parameters in place between two optimizer steps.
        """
        if self._hooks:
            raise ConfigError("this publisher is already attached to an optimizer")
        if self.background and self._defer_view and self._viewer is None:
            self._viewer = ViewThread(nice=self._nice, threads=self._threads)
        self._hooks = [
            optimizer.register_step_pre_hook(lambda _opt, _args, _kwargs: self._before_optimizer_step()),
            optimizer.register_step_post_hook(lambda _opt, _args, _kwargs: self._after_optimizer_step()),
        ]

    # -- per step ---------------------------------------------------------------------------------------

    def step(self, *, meta: Mapping[str, str | int] | None = None) -> None:
        """Publish the model's weights as they are now (call after ``optimizer.step()``).

        Computes the served view in the calling thread; the diff, encoding and upload run in the background
        (``background=True``). ``meta``: extra manifest metadata for this step's version.
        """
        self._check_open()
        self._settle_view()
        self._raise_pending()
        self._step += 1
        step = self._step
        self._compute(self._gather(step), step, dict(meta or {}))

    def _before_optimizer_step(self) -> None:
        self._settle_view()
        self._raise_pending()  # e.g. the last step's weights were not finite: stop before changing them

    def _after_optimizer_step(self) -> None:
        self._check_open()
        self._raise_pending()
        self._step += 1
        step = self._step
        inputs = self._gather(step)
        if self._viewer is None:
            self._compute(inputs, step, {})
            return
        devices = cuda_devices(inputs.tensors())
        # GPU: the view's kernels start after the optimizer's (issued on the training thread's stream) ...
        updated = StreamFence(devices).record()

        def job() -> None:
            with on_devices(devices):
                updated.wait()
                self._compute(inputs, step, {})
                # ... and the next optimizer step starts after the view's kernels read the masters.
                self._read = StreamFence(devices).record()

        self._viewer.submit(job)

    def _gather(self, step: int) -> Inputs:
        """References to this step's masters (the training thread: may run collectives)."""
        try:
            return self.plan.gather(self.plan.masters(self.model))
        except FlipsyncError as e:
            self._no_view(step, e)
            raise

    def _compute(self, inputs: Inputs, step: int, meta: dict[str, str | int]) -> None:
        """This step's served view, checked and handed to the worker (any thread)."""
        if self.background:
            self.slot.drop_pending_view()  # about to be superseded: free it before computing the next
        t0 = time.perf_counter()
        try:
            with self.stager.buffers() as alloc:
                view = self.plan.compute(inputs, alloc)
                check_layout(view, self._expected)
        except FlipsyncError as e:
            self._no_view(step, e)
            raise
        staged = self.stager.stage(view)
        self.account.add(view_bytes(staged.view))
        self._submit(Item(step, staged.view, staged.wait, meta=meta, view_s=time.perf_counter() - t0))

    def _no_view(self, step: int, e: FlipsyncError) -> None:
        if self.group.size > 1:  # the other ranks must learn that this step has no view here
            self._submit(Item(step, None, error=f"{type(e).__name__}: {e}"))

    def _settle_view(self) -> None:
        """Wait for a served view being computed in the background (the masters are about to change)."""
        if self._viewer is not None:
            self._viewer.wait_idle()
            read, self._read = self._read, None
            if read is not None:
                read.wait()

    def snapshot(self) -> None:
        """Publish the model's current weights as a full view at the next version.

        For a model whose tensors changed shape, dtype or names (a patch cannot express that): the replicas
        load the snapshot, and patches continue from it. Single-process only.
        """
        self._check_open()
        if self.group.size > 1:
            raise ConfigError(
                "snapshot() after a layout change is single-process only; restart the job with resume=True"
            )
        self.flush()
        self._step += 1
        self.plan = self._make_plan()
        view = self._serve()
        staged = self.stager.stage(view)
        self.account.add(view_bytes(staged.view))
        self._expected = {n: p.spec(n, 0) for n, p in staged.view.items()}
        self._submit(Item(self._step, staged.view, staged.wait, snapshot=True))

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
        self._settle_view()
        if self.background and not self.slot.wait_idle(timeout_s, lambda: self.worker.alive):
            raise TimeoutError(f"the publisher did not finish uploading within {timeout_s} s")
        self._publish_unpublished(timeout_s)
        self._raise_pending()
        return self.engine.last

    def _publish_unpublished(self, timeout_s: float | None) -> None:
        """Try again the newest step whose publication failed while no newer step came to cover it."""
        delay = RETRY_DELAY_S
        while self.worker.error is None and (item := self.worker.take_unpublished()) is not None:
            time.sleep(delay)
            delay = min(2 * delay, MAX_RETRY_DELAY_S)
            if not self.background:
                self._submit(item)
                continue
            self.slot.push(item)
            if not self.slot.wait_idle(timeout_s, lambda: self.worker.alive):
                raise TimeoutError(f"the publisher did not finish uploading within {timeout_s} s")

    def close(self, timeout_s: float | None = None) -> None:
        """Publish what is pending, stop the background thread and release the held views.

        Raises the publisher's fatal error if no earlier call raised it.
        """
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        try:
            if self._viewer is not None:
                self._viewer.close()
            if self.background:
                self.slot.wait_idle(timeout_s, lambda: self.worker.alive)
            self._publish_unpublished(timeout_s)
            if self.background:
                self.slot.close()
                self.worker.join(timeout_s)
            self._raise_pending(closing=True)
        finally:
            self._shutdown_resources()

    def _shutdown_resources(self) -> None:
        self.slot.close()
        self.slot.clear()
        if hasattr(self, "worker") and (held := self.worker.take_unpublished()) is not None:
            self._release_item(held)
        if hasattr(self, "engine"):
            self.engine.close()
            if not self.background:
                self.engine.hasher.close()
                self.engine.differ.close()
        self.stager.clear()
        self.group.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # already failing: do not hide the original error behind a publisher one
            self.close()
        except FlipsyncError as e:
            log.warning("closing the publisher after an error: %s", e)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this publisher is closed")

    def _raise_pending(self, *, closing: bool = False) -> None:
        """Raise what the worker hit: a one-off notice, or the fatal error (again on every call but close)."""
        if self._viewer is not None and (failed := self._viewer.take_error()) is not None:
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

    # -- memory -----------------------------------------------------------------------------------------

    def _release_view(self, view: LocalView | None) -> None:
        if view:
            self.stager.release(view)
            self.account.sub(view_bytes(view))

    def _release_item(self, item: Item) -> None:
        self._release_view(item.view)
        item.view = None

    # -- state ------------------------------------------------------------------------------------------

    @property
    def stats(self) -> PublisherStats:
        return PublisherStats(
            steps=self._step,
            versions=len(self.worker.published),
            squashed_steps=self.slot.squashed_steps,
            store_failures=self.worker.store_failures,
            view_bytes=sum(s.numel * dtype_named(s.dtype).bits // 8 for s in self._expected.values()),
            peak_view_bytes=self.account.peak,
            head=self.engine.head,
        )
