"""Contexts for the changed positions beyond the base value's exponent class, measured (a prototype, no coder).

The `ctx` coder splits a tensor's elements into classes by the exponent of the value the receiver holds:
a step changes a served value with probability ~ |step| / spacing, and the spacing is the exponent's. The
rest of that probability is |step|, which no exponent predicts. Under Muon a matrix's step is an
orthogonalized update whose size varies by row and column, so the question is whether something the receiver
also knows predicts |step|. Measured here, per BF16 tensor, as the conditional bound of each context (sum over
classes of log2 C(U_c, n_c), plus log2(U_c + 1) bits per class present for its count, so that a finer split is
not free):

- `exponent`: the class `ctx` codes with today;
- `x row, last step` / `x column, last step`: the exponent class times the quartile of the row's (column's)
  count of changes in the previous step's patch, which the receiver applied;
- `x element, last step`: times whether the element itself changed in the previous step;
- `x |step| (oracle)`: times the quartile of the element's true FP32 step, which the receiver does not know:
  what a perfect model of the step size would give (the headroom);
- `x row RMS of step (oracle)`: times the quartile of the true step's RMS over the element's row.

A context "would pay" where its bound is a few percent below the exponent's: the coder would also pay for
keeping per-row state, and the previous patch must be at hand when the next one is decoded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from flipsync.codec.bits import bits_numpy

CONTEXTS = (
    "exponent",
    "x row, last step",
    "x column, last step",
    "x element, last step",
    "x |step| (oracle)",
    "x row RMS of step (oracle)",
)
QUARTILES = 4


def _log2_binom(u: int, n: int) -> float:
    return (math.lgamma(u + 1) - math.lgamma(n + 1) - math.lgamma(u - n + 1)) / math.log(2)


def class_bits(cls: np.ndarray, changed: np.ndarray) -> float:
    """sum over classes present of log2 C(U_c, n_c) + log2(U_c + 1) (the class's count)."""
    total = np.bincount(cls)
    k = np.bincount(cls[changed], minlength=total.size)
    present = np.flatnonzero(total)
    return sum(_log2_binom(int(total[c]), int(k[c])) + math.log2(int(total[c]) + 1) for c in present)


def _quartile(x: np.ndarray) -> np.ndarray:
    """Each value's quartile among `x` (ties share a bucket)."""
    if x.size == 0:
        return np.zeros(0, np.int64)
    edges = np.quantile(x, [0.25, 0.5, 0.75])
    return np.searchsorted(edges, x, side="right").astype(np.int64)


def _bf16_exponent(bits: np.ndarray) -> np.ndarray:
    return ((bits >> 7) & 0xFF).astype(np.int64)


def tensor_bits(
    prev: torch.Tensor, old: torch.Tensor, new: torch.Tensor, old_master: torch.Tensor, new_master: torch.Tensor
) -> dict[str, float]:
    """Bits for one BF16 tensor's changed positions (old -> new) under every context; prev -> old is the step before."""
    a, b, p = (bits_numpy(t.contiguous()) for t in (old, new, prev))
    changed = a != b
    exp = _bf16_exponent(a)
    step = (new_master.double() - old_master.double()).abs().reshape(-1).numpy()
    last = (p != a).astype(np.int64)
    if old.ndim == 2:
        rows, cols = old.shape
        grid = last.reshape(rows, cols)
        row_q = np.repeat(_quartile(grid.sum(1)), cols)
        col_q = np.tile(_quartile(grid.sum(0)), rows)
        rms = np.sqrt((step.reshape(rows, cols) ** 2).mean(1))
        rms_q = np.repeat(_quartile(rms), cols)
    else:
        row_q = col_q = rms_q = np.zeros(a.size, np.int64)
    side = {
        "exponent": np.zeros(a.size, np.int64),
        "x row, last step": row_q,
        "x column, last step": col_q,
        "x element, last step": last,
        "x |step| (oracle)": _quartile(step),
        "x row RMS of step (oracle)": rms_q,
    }
    return {name: class_bits(exp * QUARTILES + s, changed) for name, s in side.items()}


def view_bits(
    prev: Mapping[str, torch.Tensor],
    old: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    old_masters: Mapping[str, torch.Tensor],
    new_masters: Mapping[str, torch.Tensor],
) -> tuple[dict[str, float], int]:
    """Position bits of a whole BF16 view per context (changed tensors only), and its changed values."""
    total = dict.fromkeys(CONTEXTS, 0.0)
    changed = 0
    for name, t in new.items():
        if t.dtype != torch.bfloat16 or name not in old_masters:
            continue
        n = int(np.count_nonzero(bits_numpy(old[name].contiguous()) != bits_numpy(t.contiguous())))
        if not n:
            continue
        changed += n
        for k, v in tensor_bits(prev[name], old[name], t, old_masters[name], new_masters[name]).items():
            total[k] += v
    return total, changed
