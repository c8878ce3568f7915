"""The bit patterns of tensor elements at flat positions, read and written in place (CPU or device).

The worker reads and writes parameters only through these: in the tensor's own dtype, or through the exact
conversion of a checkpoint dtype into a wider parameter dtype (BF16 or FP16 loaded into FP32).
"""

from __future__ import annotations

import numpy as np
import torch

from flipsync.codec.bits import DType, dtype_of, int_view
from flipsync.engines.vllm.wire import WorkerOpError


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
    signed = np.ascontiguousarray(bits.astype(d.uint_numpy, copy=False)).view(_np_int(d.bits))
    if flat.device.type == "cpu":
        flat.numpy()[positions] = signed
    else:
        flat.index_copy_(0, torch.from_numpy(positions).to(flat.device), torch.from_numpy(signed).to(flat.device))


def _np_int(bits: int) -> np.dtype:
    return np.dtype(np.uint8) if bits == 8 else np.dtype(f"<i{bits // 8}")


def widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` converts exactly into ``dst`` and back (BF16 or FP16 loaded into FP32)."""
    return src in (torch.bfloat16, torch.float16) and dst == torch.float32


def read_as(t: torch.Tensor, positions: np.ndarray, ck: DType) -> np.ndarray:
    """The checkpoint-dtype bits of elements ``positions`` of ``t`` (which may hold them widened)."""
    if t.dtype == ck.torch_dtype:
        return read_bits(t, positions)
    flat = t.detach().reshape(-1)
    vals = flat[torch.from_numpy(positions).to(flat.device)]
    back = vals.to(ck.torch_dtype)
    if not torch.equal(int_view(back.to(t.dtype)), int_view(vals)):
        raise WorkerOpError(
            f"a {t.dtype} parameter holds values that are not {ck.name} values; it no longer holds what the "
            "checkpoint loaded into it"
        )
    return int_view(back).cpu().numpy().view(ck.uint_numpy)


def write_as(t: torch.Tensor, positions: np.ndarray, bits: np.ndarray, ck: DType) -> None:
    """Write checkpoint-dtype ``bits`` at ``positions`` of ``t``, converted exactly into its dtype."""
    if t.dtype == ck.torch_dtype:
        write_bits(t, positions, bits)
        return
    raw = np.ascontiguousarray(bits.astype(ck.uint_numpy, copy=False)).view(_np_int(ck.bits))
    flat = t.detach().reshape(-1)
    vals = torch.from_numpy(raw).view(ck.torch_dtype).to(t.dtype).to(flat.device)
    flat.index_copy_(0, torch.from_numpy(positions).to(flat.device), vals)
