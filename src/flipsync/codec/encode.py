"""Build a patch from two served views: diff each tensor's bits, code the changes, carry the digests."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import numpy as np
import torch

from flipsync.codec.bits import bits_numpy, dtype_of, int_view, key_steps, to_key
from flipsync.codec.diff import Changes, DiffEngine
from flipsync.codec.fingerprint import FingerprintTable, Hasher, TensorId, fingerprint_delta
from flipsync.codec.patch import Patch, PatchBuilder, TensorChange
from flipsync.domain.headers import ViewRef
from flipsync.errors import PatchError

Progress = Callable[[str, int], None]  # (tensor name, bytes processed)
BATCH_BYTES = 256 << 20


def gather_bits(t: torch.Tensor, positions: np.ndarray) -> np.ndarray:
    """The unsigned bit patterns at ``positions`` of a tensor on any device; O(len(positions))."""
    d = dtype_of(t)
    if t.device.type == "cpu":
        return bits_numpy(t)[positions]
    idx = torch.from_numpy(positions).to(t.device)
    return int_view(t)[idx].cpu().numpy().view(d.uint_numpy)


def check_same_layout(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor]) -> None:
    """A patch changes values, never layout; a layout change needs a keyframe."""
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


def _change(
    name: str,
    a: torch.Tensor,
    b: torch.Tensor,
    found: Changes,
    base_fp: int,
    mode: str,
    hasher: Hasher | None,
) -> TensorChange:
    """The coded-to-be change of one tensor: the diff's changed positions and patterns, fingerprints."""
    d = dtype_of(a)
    positions, old_bits, new_bits = found.positions, found.old, found.new
    target_fp = (base_fp + fingerprint_delta(positions, old_bits, new_bits)) & ((1 << 64) - 1)
    return TensorChange(
        name=name,
        dtype=d,
        shape=tuple(a.shape),
        positions=positions,
        values=to_key(new_bits, d) if mode == "raw" else key_steps(old_bits, new_bits, d),
        raw=np.ones(positions.size, dtype=bool) if mode == "raw" else None,
        base_fp=base_fp,
        target_fp=target_fp,
        target_digest=hasher.digest(b) if hasher is not None else None,
    )


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
    """The patch that turns ``old`` into ``new`` bit for bit, and the fingerprint table of ``new``.

    ``mode="step"`` stores order-key steps (smallest); ``"raw"`` stores new bit patterns (idempotent
    overwrite). Pass the previous call's table as ``old_table`` to keep the whole diff O(size) + O(changed):
    the new fingerprints are then updated from the changes instead of rehashed. ``context``: also try coding
    each tensor's positions against its old values (the ``ctx`` coder, CPU tensors; kept where smaller), which
    makes the patch decodable only with its base at hand (apply, stage, ``squash(..., base=...)``).
    """
    check_same_layout(old, new)
    own_engine, own_hasher = engine is None, hasher is None
    engine = engine or DiffEngine()
    hasher = hasher or Hasher()
    try:
        table = old_table if old_table is not None else FingerprintTable.of(old, hasher)
        if set(table) != set(old):
            raise PatchError("old_table does not describe the old view (different tensor names)")
        new_table = table.copy()
        builder = PatchBuilder()

        def flush(batch: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
            found = engine.changes_many([(a, b) for _, a, b in batch])
            for (name, a, b), changes in zip(batch, found, strict=True):
                if changes.size:
                    change = _change(name, a, b, changes, table[name].fp, mode, hasher if digests else None)
                    builder.add(change, a if context and a.device.type == "cpu" else None)
                    new_table[name] = TensorId(change.dtype.name, change.shape, change.target_fp)
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
        patch = builder.build(
            base=ViewRef(table.view_fp(), base_version),
            target=ViewRef(new_table.view_fp(), target_version),
            served_format=served_format,
        )
        return patch, new_table
    finally:
        if own_engine:
            engine.close()
        if own_hasher:
            hasher.close()
