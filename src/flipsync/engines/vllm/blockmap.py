"""The block map: where each checkpoint element lives among an engine's fused, sharded or padded parameters, and
reading/writing those elements' bits in place. No vLLM, so it is tested on its own. See docs/engines.md ("The
map: learned through vLLM's own loaders").
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from flipsync.codec.bits import DType, dtype_of, int_view
from flipsync.engines.vllm.wire import WorkerOpError

# A block maps checkpoint flat index c0 + i*cs + j to parameter flat index p0 + i*ps + j, 0 <= i < count,
# 0 <= j < length, with cs >= length so that (i, j) is unique for each c. Columns: c0 p0 length count cs ps.
BLOCK_COLS = 6


def compress_map(ckpt_idx: np.ndarray, param_idx: np.ndarray) -> np.ndarray:
    """Compress (checkpoint index, parameter index) pairs into affine 2-D blocks, shape (n, 6) int64."""
    ckpt_idx = np.asarray(ckpt_idx, dtype=np.int64)
    param_idx = np.asarray(param_idx, dtype=np.int64)
    if ckpt_idx.size == 0:
        return np.zeros((0, BLOCK_COLS), dtype=np.int64)
    order = np.lexsort((param_idx, ckpt_idx))
    c, p = ckpt_idx[order], param_idx[order]
    brk = np.flatnonzero((np.diff(c) != 1) | (np.diff(p) != 1)) + 1
    starts = np.concatenate([[0], brk])
    lengths = np.diff(np.concatenate([starts, [c.size]]))
    rc, rp = c[starts], p[starts]
    blocks: list[tuple[int, int, int, int, int, int]] = []
    i, n = 0, int(rc.size)
    while i < n:
        length = int(lengths[i])
        j = i + 1
        cs = ps = length
        if j < n and lengths[j] == length and rc[j] - rc[i] >= length:
            cs, ps = int(rc[j] - rc[i]), int(rp[j] - rp[i])
            while j < n and lengths[j] == length and rc[j] - rc[j - 1] == cs and rp[j] - rp[j - 1] == ps:
                j += 1
        if j - i == 1:
            cs = ps = length
        blocks.append((int(rc[i]), int(rp[i]), length, j - i, cs, ps))
        i = j
    return np.array(blocks, dtype=np.int64).reshape(-1, BLOCK_COLS)


def expand_block(block: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    c0, p0, length, count, cs, ps = (int(x) for x in block)
    i = np.arange(count, dtype=np.int64)[:, None]
    j = np.arange(length, dtype=np.int64)[None, :]
    return (c0 + i * cs + j).reshape(-1), (p0 + i * ps + j).reshape(-1)


CHUNK_ELEMS = 1 << 22


def iter_chunks(blocks: np.ndarray, max_elems: int = CHUNK_ELEMS) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The (checkpoint, parameter) index pairs of ``blocks``, a few million at a time (bounded memory)."""
    for c0, p0, length, count, cs, ps in (tuple(int(x) for x in b) for b in blocks):
        rows = max(1, max_elems // max(1, length))
        for i0 in range(0, count, rows):
            n = min(rows, count - i0)
            yield expand_block((c0 + i0 * cs, p0 + i0 * ps, length, n, cs, ps))


def expand_blocks(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if len(blocks) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    parts = [expand_block(b) for b in blocks]
    return np.concatenate([a for a, _ in parts]), np.concatenate([b for _, b in parts])


def lookup_blocks(blocks: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For sorted checkpoint ``positions``: (indices into positions that the blocks hold, parameter indices).

    O(len(blocks) * log(len(positions)) + hits); a position held by several blocks appears once per block.
    """
    hits: list[np.ndarray] = []
    params: list[np.ndarray] = []
    for c0, p0, length, count, cs, ps in (tuple(int(x) for x in b) for b in blocks):
        lo = int(np.searchsorted(positions, c0, "left"))
        hi = int(np.searchsorted(positions, c0 + (count - 1) * cs + length, "left"))
        if lo >= hi:
            continue
        d = positions[lo:hi] - c0
        i, j = np.divmod(d, cs)
        m = j < length
        idx = np.flatnonzero(m)
        hits.append(idx + lo)
        params.append(p0 + i[m] * ps + j[m])
    if not hits:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(hits), np.concatenate(params)


def block_runs(blocks: np.ndarray) -> np.ndarray:
    """The 1-D runs (start, length) in checkpoint coordinates that the blocks cover, shape (n, 2)."""
    if len(blocks) == 0:
        return np.zeros((0, 2), np.int64)
    starts = [b[0] + np.arange(b[3], dtype=np.int64) * b[4] for b in blocks]
    lengths = [np.full(int(b[3]), b[2], dtype=np.int64) for b in blocks]
    return np.stack([np.concatenate(starts), np.concatenate(lengths)], axis=1)


# -------------------------------------------------------------------------------------------- probes
def exact_int_base(dtype: torch.dtype) -> int:
    """The largest power of two B such that the integers 1..B are exactly representable in ``dtype``."""
    if dtype == torch.bool:
        return 1
    if dtype.is_floating_point:  # the mantissa's bits and the implicit one
        return 1 << min(round(-math.log2(torch.finfo(dtype).eps)) + 1, 30)
    return 1 << min(int(math.log2(torch.iinfo(dtype).max)), 30)


def probe_passes(numel: int, base: int) -> int:
    passes, span = 1, base
    while span < numel:
        span *= base
        passes += 1
    return passes


def digit_probe(numel: int, shape: Sequence[int], dtype: torch.dtype, base: int, k: int) -> torch.Tensor:
    """Element i holds digit k of i in base ``base``, plus one (so an untouched zero means 'not loaded')."""
    idx = torch.arange(numel, dtype=torch.int64)
    return ((idx // (base**k)) % base + 1).to(dtype).reshape(tuple(shape))


def group_key(name: str) -> str:
    """The module prefix a checkpoint tensor belongs to: its numbered layer (``model.layers.3``) if any."""
    if m := re.match(r"^(.*?\.\d+)\.", name):
        return m.group(1)
    return name.rpartition(".")[0] or name


# ----------------------------------------------------------------------------------------- element bits
def read_bits(t: torch.Tensor, positions: np.ndarray) -> np.ndarray:
    d = dtype_of(t)
    flat = int_view(t.detach())
    if flat.device.type == "cpu":
        return flat.numpy()[positions].view(d.uint_numpy)
    idx = torch.from_numpy(positions).to(flat.device)
    return flat[idx].cpu().numpy().view(d.uint_numpy)


def write_bits(t: torch.Tensor, positions: np.ndarray, bits: np.ndarray) -> None:
    d = dtype_of(t)
    flat = int_view(t.detach())
    signed = np.ascontiguousarray(bits.astype(d.uint_numpy, copy=False)).view(d.int_numpy)
    if flat.device.type == "cpu":
        flat.numpy()[positions] = signed
    else:
        flat.index_copy_(0, torch.from_numpy(positions).to(flat.device), torch.from_numpy(signed).to(flat.device))


def widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` converts exactly into ``dst`` and back (BF16 or FP16 loaded into FP32)."""
    return src in (torch.bfloat16, torch.float16) and dst == torch.float32


def narrowed(vals: torch.Tensor, ck: DType) -> torch.Tensor:
    """``vals`` (a widened parameter's elements, any strides) in checkpoint dtype ``ck``, refused unless every one
    converts back to the same bits: a parameter that no longer holds what the checkpoint loaded into it."""
    back = vals.to(ck.torch_dtype)
    wide = int_view(vals.new_empty(0)).dtype  # the same-width integer dtype, compared bit for bit
    if not torch.equal(back.to(vals.dtype).view(wide), vals.view(wide)):
        raise WorkerOpError(
            f"a {vals.dtype} parameter holds values that are not {ck.name} values; it no longer holds what the "
            "checkpoint loaded into it"
        )
    return back


def read_as(t: torch.Tensor, positions: np.ndarray, ck: DType) -> np.ndarray:
    """The checkpoint-dtype bits of elements ``positions`` of ``t`` (which may hold them widened)."""
    if t.dtype == ck.torch_dtype:
        return read_bits(t, positions)
    flat = t.detach().reshape(-1)
    back = narrowed(flat[torch.from_numpy(positions).to(flat.device)], ck)
    return int_view(back).cpu().numpy().view(ck.uint_numpy)


def copy_blocks(dst: torch.Tensor, src: torch.Tensor, blocks: np.ndarray, ck: DType) -> None:
    """Copy the elements ``blocks`` map from parameter ``src`` (holding them in checkpoint dtype ``ck``, or
    widened) into the contiguous checkpoint tensor ``dst`` (dtype ``ck``), bit for bit. The same as
    `read_as` and `write_bits` over `iter_chunks`, in one strided copy per block instead of two index arrays
    per element: rebuilding the touched layers' checkpoint tensors was half of a version's apply on vLLM."""
    if dst.dtype != ck.torch_dtype:
        raise WorkerOpError(f"a {ck.name} checkpoint tensor cannot be rebuilt into {dst.dtype}")
    out = int_view(dst)
    same = src.dtype == ck.torch_dtype
    held = src.detach() if src.is_contiguous() else src.detach().contiguous()
    flat = int_view(held) if same else held.reshape(-1)
    for c0, p0, length, count, cs, ps in blocks.tolist():
        if count <= 0 or length <= 0:
            continue
        p_lo = p0 + min(0, (count - 1) * ps)  # a permuted map's rows may run backwards on the parameter side
        if (
            min(c0, p_lo) < 0
            or (count > 1 and cs < length)  # the block format's own rule: each checkpoint element once
            or c0 + (count - 1) * cs + length > out.numel()
            or p0 + max(0, (count - 1) * ps) + length > flat.numel()
        ):
            raise WorkerOpError(
                f"a block of the map ({c0}, {p0}, {length}, {count}, {cs}, {ps}) lies outside its tensors "
                f"({out.numel()} checkpoint, {flat.numel()} parameter elements) or breaks the block format: the "
                "map does not fit this engine"
            )
        # as_strided's offset counts from the storage's start, not the view's; it takes no negative stride
        got = flat.as_strided((count, length), (abs(ps), 1), flat.storage_offset() + p_lo)
        if ps < 0:
            got = got.flip(0)
        into = out.as_strided((count, length), (cs, 1), out.storage_offset() + c0)
        into.copy_(got if same else narrowed(got, ck).view(out.dtype))


def write_as(t: torch.Tensor, positions: np.ndarray, bits: np.ndarray, ck: DType) -> None:
    """Write checkpoint-dtype ``bits`` at ``positions`` of ``t``, converted exactly into its dtype."""
    if t.dtype == ck.torch_dtype:
        write_bits(t, positions, bits)
        return
    raw = np.ascontiguousarray(bits.astype(ck.uint_numpy, copy=False)).view(ck.int_numpy)
    flat = t.detach().reshape(-1)
    vals = torch.from_numpy(raw).view(ck.torch_dtype).to(t.dtype).to(flat.device)
    flat.index_copy_(0, torch.from_numpy(positions).to(flat.device), vals)
