"""Build a patch from changes: ``PatchEncoder`` (whole tensors, or the row pieces a sharded trainer rank
holds: the fingerprint is a sum over elements, so ranks exchange only deltas) and ``diff_views``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future
from contextlib import ExitStack
from typing import Literal

import numpy as np
import torch

from flipsync.codec.bits import dtype_named, dtype_of, key_steps, to_key
from flipsync.codec.container import PatchFileWriter
from flipsync.codec.diff import Changes, DiffEngine
from flipsync.codec.fingerprint import FingerprintTable, Hasher, combine_digests, fingerprint_delta
from flipsync.codec.patch import Patch
from flipsync.codec.section import TensorChange, encode_change
from flipsync.domain.headers import PatchHeader, SectionHeader, ViewRef
from flipsync.errors import PatchError

Progress = Callable[[str, int], None]  # (tensor name, bytes processed)
Stream = Callable[[bytes | memoryview], None]  # the patch file's data area, in file order
Digest = str | Callable[[], str] | None  # a content digest, or a call that waits for one (Hasher.digest_soon)
BATCH_BYTES = 256 << 20


class PatchEncoder:
    """Codes one patch's sections as their changes arrive (on ``pool``, else inline), then builds the patch.
    ``stream``: handed the patch file's data area in order, as soon as each section and every earlier one is
    coded; after ``finish``, ``file_ends`` gives the bytes that go before and after it."""

    def __init__(self, *, pool: Executor | None = None, stream: Stream | None = None) -> None:
        self._pool = pool
        self._stream = stream
        self._writer = PatchFileWriter()
        self._patch: Patch | None = None
        self._names: list[str] = []
        self._coded: list[Future[tuple[SectionHeader, bytes]]] = []
        self._digests: list[Digest] = []
        self._emitted = 0
        self._lock = threading.Lock()  # streaming runs on whichever pool thread finishes a section
        self.deltas: dict[str, int] = {}  # each added tensor's fingerprint delta (mod 2**64)

    def add(
        self,
        name: str,
        shape: tuple[int, ...],
        changes: Changes,
        *,
        dtype: str,
        offset: int = 0,
        mode: Literal["step", "raw"] = "step",
        base: torch.Tensor | np.ndarray | None = None,
        digest: Digest = None,
    ) -> int:
        """Code the changes of one tensor (or of its piece from flat element ``offset``); returns its fingerprint
        delta. ``base``: the whole tensor on the host (to try ``ctx``). ``digest``: None for a piece."""
        if name in self.deltas:
            raise PatchError(f"tensor {name!r} is added to the patch twice")
        d = dtype_named(dtype)
        positions = changes.positions + offset if offset else changes.positions
        delta = fingerprint_delta(positions, changes.old, changes.new)
        values = to_key(changes.new, d) if mode == "raw" else key_steps(changes.old, changes.new, d)
        raw = np.ones(positions.size, dtype=bool) if mode == "raw" else None
        change = TensorChange(name, d, tuple(shape), positions, values, raw)
        coded: Future[tuple[SectionHeader, bytes]]
        if self._pool is None:
            coded = Future()
            coded.set_result(encode_change(change, base))
        else:
            coded = self._pool.submit(encode_change, change, base)
        self.deltas[name] = delta
        self._names.append(name)
        self._digests.append(digest)
        self._coded.append(coded)
        if self._stream is not None:
            coded.add_done_callback(lambda _: self._lay_out())
        return delta

    def _lay_out(self) -> None:
        """Place every coded section whose predecessors are placed; stream what goes into the data area now."""
        assert self._stream is not None
        with self._lock:
            while self._emitted < len(self._coded) and self._coded[self._emitted].done():
                work = self._coded[self._emitted]
                if work.exception() is None:
                    data = self._writer.add(self._names[self._emitted], work.result()[1])
                    if data is not None:
                        self._stream(data)
                self._emitted += 1

    def finish(
        self,
        *,
        base: ViewRef,
        target: ViewRef,
        served_format: str | None = None,
        meta: Mapping[str, str] | None = None,
    ) -> Patch:
        """The patch of every added section (waits for their coding; raises the first coding error)."""
        sections, blobs = [], {}
        for work in self._coded:
            section, blobs[section.name] = work.result()
            sections.append(section)
        digests = [d() if callable(d) else d for d in self._digests]
        whole = all(d is not None for d in digests)  # a piece, or a diff without digests, has none
        digest = combine_digests(zip(self._names, digests, strict=True)) if whole else None  # type: ignore[arg-type]
        header = PatchHeader(base, target, tuple(sections), served_format, dict(meta or {}), digest)
        if self._stream is not None:
            self._lay_out()  # a pool thread may still be running its callback: everything is placed after this
        self._patch = Patch(header, blobs)
        return self._patch

    def file_ends(self) -> tuple[bytes, bytes]:
        """(head, tail) of the patch file whose data area was streamed: the file is head + streamed + tail."""
        if self._patch is None or self._stream is None:
            raise PatchError("file_ends needs a streaming encoder that has finished")
        return self._writer.finish(self._patch.header)


def diff_views(
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    mode: Literal["step", "raw"] = "step",
    old_table: FingerprintTable | None = None,
    digests: bool = True,
    base_version: int | None = None,
    target_version: int | None = None,
    served_format: str | None = None,
    engine: DiffEngine | None = None,
    hasher: Hasher | None = None,
    progress: Progress | None = None,
    context: bool = True,
) -> tuple[Patch, FingerprintTable]:
    """The patch that turns ``old`` into ``new`` bit for bit, and the fingerprint table of ``new``. ``mode``:
    order-key steps, or new bit patterns (``"raw"``: idempotent overwrite). ``old_table``: the previous call's
    table (the new one is then updated, not rehashed). ``context``: also try ``ctx`` on CPU tensors."""
    # A patch changes values, never layout; a layout change needs a keyframe.
    missing, added = sorted(set(old) - set(new)), sorted(set(new) - set(old))
    if missing or added:
        raise PatchError(
            f"the two views hold different tensors (only in old: {missing[:5]}, only in new: {added[:5]}); "
            "a patch cannot add or remove tensors: publish a keyframe instead"
        )
    for name in old:
        a, b = old[name], new[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise PatchError(
                f"tensor {name!r} changed layout from {tuple(a.shape)} {a.dtype} to {tuple(b.shape)} {b.dtype}; "
                "a patch cannot change shapes or dtypes: publish a keyframe instead"
            )
    with ExitStack() as own:
        engine = engine or own.enter_context(DiffEngine())
        hasher = hasher or own.enter_context(Hasher())
        table = old_table if old_table is not None else FingerprintTable.of(old, hasher)
        if set(table) != set(old):
            raise PatchError("old_table does not describe the old view (different tensor names)")
        encoder = PatchEncoder()

        def flush(batch: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
            found = engine.changes_many([(a, b) for _, a, b in batch])
            for (name, a, b), changes in zip(batch, found, strict=True):
                if changes.size:
                    encoder.add(
                        name,
                        tuple(a.shape),
                        changes,
                        dtype=dtype_of(a).name,
                        mode=mode,
                        base=a if context and a.device.type == "cpu" else None,
                        digest=hasher.digest(b) if digests else None,
                    )
                if progress is not None:
                    progress(name, a.numel() * a.element_size())
            batch.clear()

        # Tensors are diffed in batches of about BATCH_BYTES: small tensors then share the cores, and
        # with lazily loaded checkpoints no more than one batch is in memory.
        batch: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        held = 0
        for name in sorted(old):
            a, b = old[name].detach().contiguous(), new[name].detach().contiguous()
            batch.append((name, a, b))
            held += a.numel() * a.element_size()
            if held >= BATCH_BYTES:
                flush(batch)
                held = 0
        flush(batch)
        new_table = table.advanced(encoder.deltas)
        patch = encoder.finish(
            base=ViewRef(table.view_fp(), base_version),
            target=ViewRef(new_table.view_fp(), target_version),
            served_format=served_format,
        )
        return patch, new_table
