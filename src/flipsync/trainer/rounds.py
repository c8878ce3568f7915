"""Publishing one version, on every rank together: agree, diff, encode, upload, result; rank 0 creates the
manifest only after every rank's part is durable, so readers never see a half-published version.
See docs/trainer.md ("Sharded training").
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from flipsync.board import BoardWriter
from flipsync.board.layout import RunLayout, new_attempt_id
from flipsync.board.part_stream import PartStream, remove_unpublished
from flipsync.codec import Changes, DiffEngine, Patch, PatchEncoder
from flipsync.codec.bits import dtype_named, int_view
from flipsync.codec.fingerprint import FingerprintTable, Hasher
from flipsync.domain.headers import ViewRef
from flipsync.errors import BoardError, ConfigError, ConflictError, FlipsyncError, PermanentStoreError, StoreError
from flipsync.stores import Store
from flipsync.trainer.config import PublisherConfig
from flipsync.trainer.pieces import LocalView, PieceSpec, view_bytes
from flipsync.trainer.rank_group import RankGroup
from flipsync.trainer.slot import Item
from flipsync.trainer.spans import SpanMaker

log = logging.getLogger(__name__)


class RoundSkipped(Exception):
    """A version was not published, but the publisher can go on (internal; never escapes the worker)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # "retry" (ranks held different steps), "step" (a view failed), "store"


@dataclass(frozen=True)
class Published:
    """What one version put on the board (as this rank saw it)."""

    version: int
    step: int
    steps: int  # trainer steps this version covers (> 1 when squashed)
    kind: str  # "snapshot" or "patch"
    part_bytes: int  # bytes this rank uploaded
    changed: int  # values this rank's part changes
    # Seconds this rank spent on the version, by phase: "view" (served view, off the training thread), then
    # for patches "diff" (diff, fingerprints, digests), "code" (waiting for the coded sections, assembling the
    # part) and "publish" (upload, the collectives, the manifest).
    timings: Mapping[str, float] = field(default_factory=dict)


def merge_deltas(deltas: list[dict[str, int]]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for d in deltas:
        out.update(d)  # update adds, keeping zero and negative sums (``+`` would drop them)
    return out


def table_of_pieces(layout: Mapping[str, PieceSpec], partials: list[dict[str, int]]) -> FingerprintTable:
    """The view's fingerprint table from every rank's piece fingerprints (summed per tensor)."""
    return FingerprintTable.of_sums({n: (s.dtype, s.shape) for n, s in layout.items()}, merge_deltas(partials))


def check_tiling(specs: list[Mapping[str, PieceSpec]]) -> dict[str, PieceSpec]:
    """Every tensor's pieces must cover it exactly once; returns one spec per tensor, in first-seen order."""
    by_name: dict[str, list[PieceSpec]] = {}
    for rank_specs in specs:
        for name, s in rank_specs.items():
            by_name.setdefault(name, []).append(s)
    layout: dict[str, PieceSpec] = {}
    for name, pieces in by_name.items():
        first = pieces[0]
        numel = math.prod(first.shape)
        at = 0
        for p in sorted(pieces, key=lambda p: (p.offset, p.rank)):
            if (p.dtype, p.shape) != (first.dtype, first.shape):
                raise ConfigError(
                    f"tensor {name!r} is {first.shape} {first.dtype} on rank {first.rank} but {p.shape} {p.dtype} "
                    f"on rank {p.rank}; every rank must serve the same model"
                )
            if p.offset != at:
                raise ConfigError(
                    f"the pieces of tensor {name!r} do not tile it: rank {p.rank} starts at element {p.offset}, "
                    f"expected {at} (overlapping or missing shards; the publisher needs every shard of the "
                    "model on exactly one of its ranks)"
                )
            at += p.numel
        if at != numel:
            raise ConfigError(f"the pieces of tensor {name!r} cover {at} of its {numel} elements")
        layout[name] = first
    return layout


def assemble(
    layout: Mapping[str, PieceSpec], gathered: list[dict[str, tuple[int, torch.Tensor]]]
) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's pieces (rank 0, for snapshots and keyframes)."""
    out: dict[str, torch.Tensor] = {}
    for name, spec in layout.items():
        parts = [g[name] for g in gathered if name in g]
        if len(parts) == 1 and parts[0][0] == 0 and parts[0][1].numel() == spec.numel:
            out[name] = parts[0][1].reshape(spec.shape)
            continue
        flat = torch.empty(sum(t.numel() for _, t in parts), dtype=dtype_named(spec.dtype).torch_dtype)
        for offset, t in parts:
            flat[offset : offset + t.numel()] = t.reshape(-1)
        out[name] = flat.reshape(spec.shape)
    return out


class VersionRounds:
    """Publishes versions of one run; holds the view of the last published version (this rank's pieces)."""

    def __init__(
        self,
        *,
        group: RankGroup,
        run: str,
        store: Store,
        board: BoardWriter | None,
        served_format: str,
        release: Callable[[LocalView | None], None],
        drop: Callable[[Item], None],
        meta: Mapping[str, str | int],
        config: PublisherConfig,
    ) -> None:
        self.group = group
        self.paths = RunLayout(run)
        self.store = store
        self.board = board
        self.fmt = served_format
        self.threads = config.pool_threads
        self.chunk_bytes = config.chunk_bytes
        self.context = config.context  # code whole host pieces' positions against the previous view (ctx)
        self._release = release  # a view no longer needed
        self.drop = drop  # an item that will not be published
        self.meta = dict(meta)
        self.want_spans = config.spans  # every rank sends its part's bytes to rank 0, which squashes the spans
        self.spans = SpanMaker(board.spans_due) if config.spans and board is not None else None
        self.base: LocalView | None = None
        self.base_token: object | None = None  # the token of the item whose view is the base (`FusedDiff`)
        self.base_step = 0
        self.specs: dict[str, PieceSpec] = {}
        self.table: FingerprintTable | None = None
        self.head: int | None = None
        self.head_fp: str | None = None
        self.last: Published | None = None
        self.orphans: list[str] = []  # objects of this rank's failed attempts, removed after the next success
        self.uploader: Executor | None = None  # uploads a part's chunks while it is coded (inline: None)
        self.open_pools()

    def open_pools(self, uploads: int = 0) -> None:
        """The rounds' pools, made on the thread that publishes (inline, or the worker: they inherit its
        priority). The code pool codes sections while the next pieces are diffed; ``uploads``: a part's chunks
        in flight at once (0: uploaded inline)."""
        self.differ, self.hasher = DiffEngine(self.threads), Hasher(self.threads)
        self.code_pool: Executor | None = ThreadPoolExecutor(self.threads, thread_name_prefix="flipsync-code")
        if uploads:
            self.uploader = ThreadPoolExecutor(uploads, thread_name_prefix="flipsync-upload")

    def close_pools(self) -> None:
        self.differ.close()
        self.hasher.close()
        for pool in (self.code_pool, self.uploader):
            if pool is not None:
                pool.shutdown()
        self.code_pool = self.uploader = None

    # -- start ------------------------------------------------------------------------------------------

    def survey(self, view: LocalView) -> tuple[dict[str, PieceSpec], FingerprintTable]:
        """Every rank's piece layout and fingerprints -> the whole view's layout and table (collective)."""
        rank = self.group.rank
        specs = {name: p.spec(name, rank) for name, p in view.items()}
        partials = {name: self.hasher.fingerprint(p.tensor, p.offset) for name, p in view.items()}
        gathered = self.group.all_gather((specs, partials), "the served view's layout")
        layout = check_tiling([s for s, _ in gathered])
        return layout, table_of_pieces(layout, [p for _, p in gathered])

    def adopt(
        self, view: LocalView, step: int, layout: dict[str, PieceSpec], table: FingerprintTable, head: int
    ) -> None:
        """Continue a run whose HEAD already holds exactly this view."""
        self.base, self.base_step, self.specs, self.table = view, step, layout, table
        self.head, self.head_fp = head, table.view_fp()

    # -- one round --------------------------------------------------------------------------------------

    def run(self, item: Item, target: int) -> Published:
        """Publish ``item`` (every rank's item for step ``target``) as the next version."""
        if item.view is not None:
            item.wait()
        # Rank 0 names the version and its attempt folder up front, so every rank can upload while it diffs.
        proposal = (0 if self.head is None else self.head + 1, new_attempt_id()) if self.board is not None else None
        hello = (item.step == target, item.snapshot, item.error, proposal)
        said = self.group.all_gather(hello, f"which step to publish (step {target})")
        if not all(ok for ok, _, _, _ in said):
            raise RoundSkipped("retry", f"the ranks held different steps around step {target}; trying again")
        failed = [(r, e) for r, (_, _, e, _) in enumerate(said) if e]
        if failed:
            self.drop(item)
            who = "; ".join(f"rank {r}: {e}" for r, e in failed)
            raise RoundSkipped("step", f"step {target} was not published because a rank could not serve it ({who})")
        if any(snap for _, snap, _, _ in said) or self.base is None:
            return self._snapshot(item)
        version, attempt = said[0][3]
        stream = PartStream(
            self.store,
            self.paths.version_dir(version),
            attempt,
            self.group.rank,
            chunk_bytes=self.chunk_bytes,
            uploader=self.uploader,
        )
        try:
            return self._patch(item, version, stream)
        except BaseException:
            stream.abort()
            raise

    def _patch(self, item: Item, version: int, stream: PartStream) -> Published:
        assert item.view is not None and self.base is not None and self.table is not None
        rank = self.group.rank
        t0 = time.perf_counter()
        encoder = PatchEncoder(pool=self.code_pool, stream=stream.add)
        try:
            fused = item.fused
            changed = self._diff(encoder, item.view, fused.changes if fused and fused.base is self.base_token else None)
            failure = None
        except FlipsyncError as e:  # reported to every rank, so none waits for this one
            changed, failure = 0, f"rank {rank}: {type(e).__name__}: {e}"
        deltas = dict(encoder.deltas) if failure is None else {}
        said = self.group.all_gather((deltas, failure), "fingerprint deltas")
        t1 = time.perf_counter()
        failures = [f for _, f in said if f]
        if failures:
            self.drop(item)
            raise BoardError(f"v{version} was not published: diffing failed ({'; '.join(failures)})")
        everyone = [d for d, _ in said]
        before = self.table.advanced(merge_deltas(everyone[:rank]))
        target_table = self.table.advanced(merge_deltas(everyone))
        target_fp = target_table.view_fp()
        assert self.head_fp is not None
        with_parts = [r for r, d in enumerate(everyone) if d]
        patch: Patch | None = None
        if deltas:
            first, last = with_parts[0] == rank, with_parts[-1] == rank
            patch = encoder.finish(
                base=ViewRef(before.view_fp(), version - 1 if first else None),
                target=ViewRef(before.advanced(deltas).view_fp(), version if last else None),
                served_format=self.fmt,
            )
        elif rank == 0 and not with_parts:  # nothing changed anywhere: one empty patch keeps versions per step
            patch = encoder.finish(
                base=ViewRef(self.head_fp, version - 1), target=ViewRef(target_fp, version), served_format=self.fmt
            )
        steps = item.step - self.base_step
        meta = {**self.meta, **item.meta, "step": item.step, "steps": steps, "ranks": self.group.size}
        t2 = time.perf_counter()
        result, spans_input, part_bytes = self._publish(stream, encoder, patch, version, target_fp, meta)
        timings = {"view": item.view_s, "diff": t1 - t0, "code": t2 - t1, "publish": time.perf_counter() - t2}
        published = Published(version, item.step, steps, "patch", part_bytes, changed, timings)
        published = self._finish(result, item, target_table, self.specs, published)
        if self.spans is not None:
            self._publish_spans(version, spans_input)
        if result[1]:  # the board's cadence asks for a keyframe of the new HEAD
            self._keyframe()
        return published

    def _diff(self, encoder: PatchEncoder, view: LocalView, known: Mapping[str, Changes] | None) -> int:
        """Diff this rank's pieces against the base view into ``encoder``; the number of changed values.

        ``known``: changes found while the view was computed (`FusedDiff`), used instead of a diff. A changed
        whole tensor's content digest is hashed on the hasher's pool while the next piece is diffed."""
        assert self.base is not None
        n = 0
        for name in sorted(view):
            a, b = self.base[name], view[name]
            ta, tb = a.tensor.detach().contiguous(), b.tensor.detach().contiguous()
            if (changes := (known or {}).get(name)) is None:
                changes = self.differ.changes(ta, tb)
            if not changes.size:
                continue
            # ctx ranks are counted over the whole tensor: a row shard cannot count the rows it does not hold
            held = ta if self.context and a.whole and ta.device.type == "cpu" else None
            digest = self.hasher.digest_soon(tb) if b.whole else None
            encoder.add(name, b.shape, changes, dtype=b.dtype_name, offset=b.offset, base=held, digest=digest)
            n += changes.size
        return n

    @staticmethod
    def _failure(e: FlipsyncError) -> tuple[str, Any]:
        if isinstance(e, PermanentStoreError):
            return "refused", str(e)
        if isinstance(e, StoreError):
            return "store", f"{type(e).__name__}: {e}"
        if isinstance(e, ConflictError):
            return "conflict", str(e)
        return "fatal", f"{type(e).__name__}: {e}"

    def _publish(
        self,
        stream: PartStream,
        encoder: PatchEncoder,
        patch: Patch | None,
        version: int,
        target_fp: str,
        meta: dict[str, Any],
    ) -> tuple[tuple[str, Any], list[Patch], int]:
        """Finish uploading this rank's part; rank 0 publishes the version once every rank reported.
        (result, the parts for spans on rank 0, this rank's part size)."""
        info, data = None, None
        err: tuple[str, bool] | None = None  # (what failed, whether the store refused it for good)
        if patch is not None:
            try:
                info = stream.finish(*encoder.file_ends())
            except FlipsyncError as e:  # as rank 0 reports it (alone, a store's refusal as it is)
                permanent = isinstance(e, PermanentStoreError)
                as_is = permanent and self.group.size == 1
                text = str(e) if as_is else f"rank {self.group.rank}: {type(e).__name__}: {e}"
                err = (text, permanent)
            if self.want_spans and info is not None:  # alone, rank 0 squashes the patch it holds
                data = patch if self.group.size == 1 else stream.file_bytes()
                if patch.needs_base:  # rank 0 squashes spans without the views in between: no ctx there
                    assert self.base is not None
                    alone = patch.decodable_alone({n: p.tensor for n, p in self.base.items() if p.whole})
                    data = alone if self.group.size == 1 else alone.to_bytes()
        reports = self.group.gather((err, info, data), f"the parts of v{version}")
        result: tuple[str, Any] = ("fatal", "no result")
        spans_input: list[Patch] = []
        if self.board is not None:
            assert reports is not None and self.head_fp is not None
            errors = [e for e, _, _ in reports if e]
            parts = [i for _, i, _ in reports if i is not None]
            refused = [text for text, permanent in errors if permanent]
            if refused:  # one rank's refusal stops every rank: the next version would be refused too
                result = ("refused", refused[0])
            elif errors:
                texts = "; ".join(text for text, _ in errors)
                result = ("store", f"v{version} was not published: uploading parts failed ({texts})")
            else:
                try:
                    self.board.publish_uploaded_patch(
                        parts,
                        base_version=version - 1,
                        target_version=version,
                        base_view_fp=self.head_fp,
                        target_view_fp=target_fp,
                        served_format=self.fmt,
                        meta=meta,
                    )
                    result = ("ok", self.board.keyframe_due())
                    spans_input = [
                        d if isinstance(d, Patch) else Patch.from_bytes(d) for _, _, d in reports if d is not None
                    ]
                except FlipsyncError as e:
                    result = self._failure(e)
                    if result[0] == "store":  # the manifest create may have failed after all: it may yet land
                        result = ("unsure", result[1])
        result = self.group.broadcast(result, f"whether v{version} was published")
        if result[0] == "ok":
            stream.keep()
            orphans, self.orphans = self.orphans, []
            if orphans:  # the store works again: remove what earlier failed attempts left
                remove_unpublished(self.store, orphans)
        elif result[0] == "store":
            # Unreferenced now; removed after the next version lands, not while the store is failing (a delete
            # now would most likely spend the store's retries failing too).
            self.orphans += stream.abort(delete=False)
        else:  # a manifest that lists the parts may still land late ("unsure"): left to retention
            stream.abort(delete=result[0] != "unsure")
        return result, spans_input, 0 if info is None else info.size

    def _finish(
        self,
        result: tuple[str, Any],
        item: Item,
        table: FingerprintTable,
        layout: dict[str, PieceSpec],
        published: Published,
    ) -> Published:
        status, detail = result
        if status in ("store", "unsure"):  # the item is kept: the worker publishes it again unless a newer step
            raise RoundSkipped("store", str(detail))  # covers it
        if status != "ok":
            self.drop(item)
            if status == "conflict":
                raise ConflictError(str(detail))
            if status == "refused":
                raise PermanentStoreError(
                    f"v{published.version} was not published and the publisher stopped: {detail}; then start it "
                    "again (resume=True continues the run)"
                )
            raise BoardError(f"publishing v{published.version} failed: {detail}")
        self._release(self.base)
        self.base, self.base_step, self.table, self.specs = item.view, item.step, table, layout
        self.base_token = item.token
        self.head, self.head_fp = published.version, table.view_fp()
        self.last = p = published
        what = "rank %d: v%d = step %d (%d steps, %d bytes, %d changed values)"
        log.info(what, self.group.rank, p.version, p.step, p.steps, p.part_bytes, p.changed)
        return published

    # -- full views -------------------------------------------------------------------------------------

    def _full_view(self, view: LocalView, layout: Mapping[str, PieceSpec], what: str) -> dict[str, torch.Tensor] | None:
        """The whole served view on rank 0 (None elsewhere)."""
        if self.group.size == 1:
            return assemble(layout, [{n: (p.offset, p.tensor) for n, p in view.items()}])
        # Pieces travel as (offset, integer bits): torch cannot pickle every dtype (fp8), numpy arrays always do.
        wire = {n: (p.offset, int_view(p.tensor.detach().contiguous()).cpu().numpy()) for n, p in view.items()}
        gathered = self.group.gather(wire, what)
        if gathered is None:
            return None
        torch_dtype = {n: dtype_named(s.dtype).torch_dtype for n, s in layout.items()}
        pieces = [
            {n: (off, torch.from_numpy(bits).view(torch_dtype[n])) for n, (off, bits) in g.items()} for g in gathered
        ]
        return assemble(layout, pieces)

    def _snapshot(self, item: Item) -> Published:
        assert item.view is not None
        layout, table = self.survey(item.view)
        full = self._full_view(item.view, layout, "the pieces of a snapshot")
        version = -1
        result: tuple[str, Any] = ("fatal", "no result")
        if self.board is not None:
            assert full is not None
            head = self.board.head
            version = 0 if head is None else head.version + 1
            meta = {**self.meta, **item.meta, "step": item.step}
            try:
                self.board.publish_snapshot(
                    full, version=version, view_fp=table.view_fp(), served_format=self.fmt, meta=meta
                )
                result = ("ok", False)
            except FlipsyncError as e:
                result = self._failure(e)
            del full
        result, version = self.group.broadcast((result, version), "whether the snapshot was published")
        snapshot = Published(version, item.step, 1, "snapshot", view_bytes(item.view), 0)
        published = self._finish(result, item, table, layout, snapshot)
        if self.spans is not None and self.board is not None:
            self.spans = SpanMaker(self.board.spans_due)  # a snapshot starts a new lineage
        return published

    def _keyframe(self) -> None:
        """An extra keyframe of HEAD; failures only cost catch-up bandwidth, so they are logged, not raised."""
        assert self.base is not None and self.head is not None and self.head_fp is not None
        full = self._full_view(self.base, self.specs, f"the pieces of v{self.head}'s keyframe")
        if self.board is None or full is None:
            return
        try:
            self.board.publish_keyframe(full, version=self.head, view_fp=self.head_fp, served_format=self.fmt)
        except FlipsyncError as e:
            log.warning("keyframe of v%d not published (replicas catch up over patches instead): %s", self.head, e)

    def _publish_spans(self, version: int, patches: list[Patch]) -> None:
        assert self.spans is not None and self.board is not None
        if not patches:
            return
        try:
            for a, b, span in self.spans.add(version, patches):
                self.board.publish_span(
                    [span.to_bytes()],
                    base_version=a,
                    target_version=b,
                    base_view_fp=span.header.base.view,
                    target_view_fp=span.header.target.view,
                    served_format=self.fmt,
                )
        except FlipsyncError as e:
            log.warning("spans after v%d not published (catch-up takes the longer way): %s", version, e)

    def close(self) -> None:
        self._release(self.base)
        self.base = None
