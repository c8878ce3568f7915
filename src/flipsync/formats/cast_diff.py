"""One fused pass for the served formats: cast (or quantize) an FP32 master and diff it against the previous
view (docs/formats.md, "The one-pass cast"). The numba kernels run on chunks on a thread pool, GIL released;
other devices and master dtypes take the torch path (same bits). Masters the kernel flags (non-finite, out of
range) go through `cast_master` or the format's recipe, which raises its error word for word.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from flipsync.codec import Changes
from flipsync.errors import FormatError
from flipsync.formats.base import cast_master, fits_out
from flipsync.formats.cast_kernels import BF16, FP16, GROUP, cast_diff_bits, cast_diff_f16
from flipsync.formats.quantize_kernels import (
    E4M3_VALUES,
    FP8_CHANNEL,
    FP8_TENSOR,
    INT8_CHANNEL,
    MX,
    NV,
    TILE,
    fp8_tile_rows,
    mx_rows,
    nv_rows,
    rows8,
    tensor_amax,
)
from flipsync.formats.registry import get_format

logger = logging.getLogger(__name__)

CHUNK_ELEMENTS = 1 << 21  # per task: 8 MiB of masters, enough to amortise the hand-over to the pool
MIN_CHUNK_ELEMENTS = 1 << 18

# |x| bit patterns (sign cleared) from which the cast gives inf or NaN: refused by `cast_master`.
_BF16_LIMIT = 0x7F7F8000  # rounds to bf16 inf (and every inf / NaN)
_FP16_LIMIT = 0x477FF000  # 65520: rounds beyond fp16's 65504

_FP4 = ("mxfp4", "nvfp4")  # two e2m1 codes per payload byte
_QUANTIZED = ("fp8-tensor", "fp8-channel", "fp8-block", "mxfp8", "mxfp4", "nvfp4", "int8-channel")


@functools.cache
def _hw_fp16() -> bool:
    """Whether `cast_diff_f16` compiles here and gives `round16`'s bits on every fp16 value, every tie
    between neighbours and one fp32 step either side (a platform without a native conversion may lack the
    runtime routine LLVM calls instead, or round otherwise): else fp16 takes the integer recipe."""
    every = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float32)
    mid = ((every[:-1].astype(np.float64) + every[1:]) / 2).astype(np.float32)
    x = np.concatenate([every, mid, np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))])
    x = np.concatenate([x, -x, np.array([1e-40, -1e-45, 2.0**-25, 65519.0], np.float32)]).view(np.uint32)
    want = np.empty(x.size, np.uint16)
    got = np.empty(x.size, np.uint16)
    scratch = (np.empty(x.size + 2, np.int64), np.empty(x.size + 2, np.uint16), np.empty(x.size + 2, np.uint16))
    try:
        cast_diff_bits(x, got, want, FP16, *scratch)
        cast_diff_f16(x, want, got, *scratch)
    except Exception:  # numba's lowering and linking errors have no common base
        logger.info("no native fp16 conversion for the one-pass cast: fp16 takes the integer recipe")
        return False
    return bool(np.array_equal(got, want))


@dataclass
class _Spill:
    """A worker's change buffers for one call: its chunks append there (``fill``: the next free slot) until the
    caller copies them all, in order, into the result (one copy, not a copy per chunk and a concatenation)."""

    pos: np.ndarray  # int64, chunk-relative
    old: np.ndarray
    new: np.ndarray
    fill: int = 0

    @property
    def room(self) -> int:
        return int(self.pos.shape[0]) - self.fill


class _OutOfRange(Exception):
    """A chunk held a master the kernel does not cast (non-finite, or out of the format's range)."""


class CastDiffer:
    """`cast_diff` with a thread pool for the CPU kernel's chunks (one per served view's computation)."""

    def __init__(self, threads: int | None = None, *, chunk_elements: int = CHUNK_ELEMENTS) -> None:
        self.threads = max(1, threads or os.cpu_count() or 1)
        self.chunk_elements = max(GROUP, chunk_elements)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="flipsync-fused")
        # spills between calls, per element type: at most `threads` each (calls on several threads take
        # their own), so they hold at most threads x 2 x the largest chunk's slots
        self._spares: dict[type, list[_Spill]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> CastDiffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def kernel_covers(master: torch.Tensor, dtype: torch.dtype, ref: torch.Tensor) -> bool:
        """True when the CPU kernel runs (else `cast_diff` takes the torch path, with the same result)."""
        return (
            dtype in (torch.bfloat16, torch.float16)
            and master.dtype == torch.float32
            and master.device.type == "cpu"
            and ref.device.type == "cpu"
            and master.is_contiguous()
            and ref.is_contiguous()
        )

    def cast_diff(
        self,
        name: str,
        master: torch.Tensor,
        dtype: torch.dtype,
        ref: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        torch_path: bool = False,
    ) -> tuple[torch.Tensor, Changes]:
        """``cast_master(name, master, dtype)`` and its changes against ``ref`` (the previous view of it).
        ``out``: where the view is written, if it fits and does not overlap ``ref``. ``torch_path`` forces the
        path CUDA tensors take. Raises what `cast_master` raises; `FormatError` for a ``ref`` of another layout."""
        if tuple(ref.shape) != tuple(master.shape) or ref.dtype != dtype:
            raise FormatError(
                f"the previous view of {name!r} is {tuple(ref.shape)} {ref.dtype}, not the "
                f"{tuple(master.shape)} {dtype} its master casts to"
            )
        if torch_path or not self.kernel_covers(master, dtype, ref):
            return _torch_cast_diff(name, master, dtype, ref, out)
        if out is None or not fits_out(out, master, dtype) or _overlap(out, ref):
            out = torch.empty(master.shape, dtype=dtype)
        try:
            changes = self._kernel(master, dtype, ref, out)
        except _OutOfRange:
            cast_master(name, master, dtype)  # raises the formats module's error for this master
            raise AssertionError(f"the fused cast refused {name!r}, but cast_master accepted it") from None
        return out, changes

    def quantize_diff(
        self,
        fmt: str,
        name: str,
        x: torch.Tensor,
        ref: torch.Tensor,
        group_amax: torch.Tensor | None,
        *,
        from_fp32: bool,
    ) -> tuple[dict[str, torch.Tensor], Changes] | None:
        """A quantized format's components of ``x`` and the payload's changes against ``ref`` (its previous
        payload), or None where this pass does not cover the tensor (not a contiguous 2-D fp32 CPU master, a
        ``ref`` of another layout, a master the recipe refuses: its own path then raises its error). ``x``: the
        master, or the recipe's prepared input (rounding bf16(master) again is exact)."""
        if (
            fmt not in _QUANTIZED
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or ref.device.type != "cpu"
            or x.dim() != 2
            or x.numel() == 0
            or not x.is_contiguous()
            or tuple(ref.shape) != (x.shape[0], x.shape[1] // 2 if fmt in _FP4 else x.shape[1])
            or ref.dtype != get_format(fmt).payload_dtype
            or not ref.is_contiguous()
            or (fmt in _FP4 and x.shape[1] % 2 != 0)  # the recipe refuses it
        ):
            return None
        rows, k = x.shape
        width = ref.shape[1]
        payload = torch.empty((rows, width), dtype=ref.dtype)
        step = max(1, min(rows, -(-CHUNK_ELEMENTS // k)))
        extra: tuple[object, ...] = ()  # the kernel's arguments between its per-row output and round_bf16
        if fmt in ("fp8-tensor", "fp8-channel", "int8-channel"):
            scales = np.empty(rows, np.float32)  # per row; fp8-tensor's kernel leaves it alone
            per_rows, parts = scales, {name: payload, name + "_scale": torch.from_numpy(scales).reshape(rows, 1)}
            kernel, extra = rows8, (INT8_CHANNEL if fmt == "int8-channel" else FP8_CHANNEL, np.float32(0.0))
            if fmt == "fp8-tensor":
                amax = tensor_amax(x, group_amax, from_fp32=from_fp32)
                if amax is None:
                    return None
                scale = amax / 448.0
                parts[name + "_scale"] = scale.reshape(1)
                extra = (FP8_TENSOR, np.float32((1.0 / scale).item()))
        elif fmt == "fp8-block":  # one row of 128x128 tiles per task (their amax needs all 128 rows first)
            per_rows = np.empty((-(-rows // TILE), -(-k // TILE)), np.float32)
            kernel, step, parts = fp8_tile_rows, TILE, {name: payload, name + "_scale_inv": torch.from_numpy(per_rows)}
        elif fmt == "nvfp4":
            amax = tensor_amax(x, group_amax, from_fp32=from_fp32)
            if amax is None:
                return None
            s2 = amax / (6.0 * 448.0)
            s2 = torch.where(amax == 0, torch.ones_like(s2), s2)
            if not bool(s2 > 0):  # a subnormal amax whose global scale underflows: the recipe's own path decides
                return None
            scale = torch.empty((rows, -(-k // NV)), dtype=torch.uint8)
            per_rows, kernel = scale.numpy(), nv_rows
            extra = (np.float32(s2.item()), np.float32((6.0 * s2).item()), E4M3_VALUES)
            parts = {name: payload, name + "_scale": scale.view(torch.float8_e4m3fn), name + "_scale_2": s2.reshape(1)}
        else:  # mxfp8 / mxfp4 (torchao FLOOR): blocks of 32 never span rows
            scale = torch.empty((rows, -(-k // MX)), dtype=torch.uint8)
            per_rows, kernel, parts = scale.numpy(), mx_rows, {name: payload, name + "_scale": scale}
            extra = (2, True) if fmt == "mxfp4" else (8, False)
        src = x.detach().view(torch.int32).numpy().view(np.uint32)
        was = ref.detach().view(torch.uint8).numpy()
        dst = payload.view(torch.uint8).numpy()
        tiles = fmt == "fp8-block"

        def run(r0: int, r1: int, *buf: np.ndarray) -> tuple[int, int]:
            out = per_rows[r0 // TILE] if tiles else per_rows[r0:r1]
            return kernel(src[r0:r1], was[r0:r1], dst[r0:r1], out, *extra, not from_fp32, *buf)  # type: ignore[no-any-return]

        tasks = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]
        try:
            changes = self._gather(
                [(r0 * width, (r1 - r0) * width + 2) for r0, r1 in tasks],  # `emit_lanes`'s two spare slots
                np.uint8,
                0x7F800000 if from_fp32 else _BF16_LIMIT,
                lambda i, *buf: run(*tasks[i], *buf),
            )
        except _OutOfRange:
            return None
        return parts, changes

    def _gather(
        self,
        tasks: list[tuple[int, int]],
        bits: type,
        limit: int,
        kernel: Callable[..., tuple[int, int]],
    ) -> Changes:
        """Runs ``kernel(i, pos, old, new) -> (changes, top master bits)`` for each task ``(first position, slots)``
        on the pool and copies their changes, in task order, into the result. `_OutOfRange` when a task's top is
        ``limit`` or more, raised once every task has finished (none still writes into a spill)."""
        held: dict[int, _Spill] = {}  # this call's spill per worker thread
        taken: list[_Spill] = []

        def run(i: int) -> tuple[_Spill, int, int, int]:
            me = threading.get_ident()
            sp = held.get(me)
            if sp is None or sp.room < tasks[i][1]:
                sp = held[me] = self._take(tasks[i][1], bits)
                taken.append(sp)
            f = sp.fill
            n, top = kernel(i, sp.pos[f:], sp.old[f:], sp.new[f:])
            sp.fill = f + n
            return sp, f, n, top

        try:
            if self.threads == 1 or len(tasks) == 1:  # no hand-over to the pool
                found = []
                for i in range(len(tasks)):
                    found.append(run(i))
                    if found[-1][3] >= limit:
                        raise _OutOfRange
            else:
                futures = [self._pool.submit(run, i) for i in range(len(tasks))]
                wait(futures)
                found = [f.result() for f in futures]
                if any(top >= limit for *_, top in found):
                    raise _OutOfRange
            total = sum(n for _, _, n, _ in found)
            pos, old, new = np.empty(total, np.int64), np.empty(total, bits), np.empty(total, bits)
            at = 0
            for (sp, f, n, _), (first, _) in zip(found, tasks, strict=True):
                np.add(sp.pos[f : f + n], first, out=pos[at : at + n])
                old[at : at + n] = sp.old[f : f + n]
                new[at : at + n] = sp.new[f : f + n]
                at += n
            return Changes(pos, old, new)
        finally:
            self._give(bits, taken)

    def _take(self, slots: int, bits: type) -> _Spill:
        """A spill with room for ``slots``: a spare one, else a new one of twice that (for the call's later chunks)."""
        with self._lock:
            spares = self._spares.get(bits, [])
            for k, sp in enumerate(spares):
                if sp.room >= slots:
                    return spares.pop(k)
        count = 2 * slots
        return _Spill(np.empty(count, np.int64), np.empty(count, bits), np.empty(count, bits))

    def _give(self, bits: type, spills: list[_Spill]) -> None:
        """Keeps the ``threads`` largest spills for the next calls (emptied); drops the others."""
        for sp in spills:
            sp.fill = 0
        with self._lock:
            spares = self._spares.setdefault(bits, [])
            spares.extend(spills)
            spares.sort(key=lambda sp: sp.room, reverse=True)
            del spares[self.threads :]

    def _kernel(self, master: torch.Tensor, dtype: torch.dtype, ref: torch.Tensor, out: torch.Tensor) -> Changes:
        numel = master.numel()
        kind, limit = (BF16, _BF16_LIMIT) if dtype == torch.bfloat16 else (FP16, _FP16_LIMIT)
        hw = kind == FP16 and _hw_fp16()
        src = master.detach().reshape(-1).view(torch.int32).numpy().view(np.uint32)
        was = ref.detach().reshape(-1).view(torch.int16).numpy().view(np.uint16)
        dst = out.reshape(-1).view(torch.int16).numpy().view(np.uint16)
        chunk = min(self.chunk_elements, max(MIN_CHUNK_ELEMENTS, -(-numel // self.threads)))
        chunk += -chunk % GROUP  # whole groups: every chunk but the last starts on one
        if numel == 0:
            empty = np.empty(0, np.uint16)
            return Changes(np.empty(0, np.int64), empty, empty)
        starts = range(0, numel, chunk)

        def run(i: int, *buf: np.ndarray) -> tuple[int, int]:
            s = starts[i]
            e = min(s + chunk, numel)
            if hw:
                return cast_diff_f16(src[s:e], was[s:e], dst[s:e], *buf)  # type: ignore[no-any-return]
            return cast_diff_bits(src[s:e], was[s:e], dst[s:e], kind, *buf)  # type: ignore[no-any-return]

        # `emit_lanes`'s two spare slots
        return self._gather([(s, min(chunk, numel - s) + 2) for s in starts], np.uint16, limit, run)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _torch_cast_diff(
    name: str, master: torch.Tensor, dtype: torch.dtype, ref: torch.Tensor, out: torch.Tensor | None
) -> tuple[torch.Tensor, Changes]:
    """The device path: `cast_master` and a compare of integer views where the tensors live."""
    if out is not None and (_overlap(out, ref) or out.device != master.device):
        out = None  # the compare below reads ref after the cast: never write the cast over it
    new = cast_master(name, master, dtype, out)
    if new is master:  # an FP32 master served as FP32: the view must not alias it
        new = new.clone()
    other = ref.detach().to(new.device).reshape(-1)
    width = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.uint16), 4: (torch.int32, np.uint32)}
    signed, ubits = width[other.element_size()]
    a = other.view(signed)
    b = new.detach().reshape(-1).view(a.dtype)
    idx = torch.nonzero(a != b).reshape(-1)
    return new, Changes(
        idx.cpu().numpy().astype(np.int64),
        a[idx].cpu().numpy().view(ubits),
        b[idx].cpu().numpy().view(ubits),
    )
