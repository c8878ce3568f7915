"""Where a BF16 patch's bytes go, against the bounds and two richer models (an analysis, not a coder).

``python -m flipsync_apps.bench.ctx_breakdown [WORKLOAD_PREFIX]`` (default ``SmolLM2``; ``all-MiniLM`` for the other
installed real weights): the codec bench's Adam steps at lr 1e-6 (2 warm-up steps, then one), BF16 view. Per
changed value: positions under the independent bound, the conditional bound by exponent class, the same with
2 more mantissa bits and with the whole BF16 value as the class (tables not counted), and what the patch
spends; value steps as coded, their empirical entropy (tables not counted), and the cost of a model learned
while decoding (no table: each step's Exp-Golomb bucket and sign coded adaptively, KT estimator, alone or
per base exponent class, the bucket's raw bits as they are).
"""

from __future__ import annotations

import math
import sys

import numpy as np

from flipsync.codec import diff_views
from flipsync.codec.bits import bits_numpy
from flipsync.formats import served_view
from flipsync_apps.bench.workload import real_masters
from flipsync_apps.synthetic import AdamSteps


def _log2_binom(u: int, n: int) -> float:
    return (math.lgamma(u + 1) - math.lgamma(n + 1) - math.lgamma(u - n + 1)) / math.log(2)


def _class_bits(cls: np.ndarray, changed: np.ndarray) -> float:
    total = np.bincount(cls)
    k = np.bincount(cls[changed], minlength=total.size)
    return sum(_log2_binom(int(total[c]), int(k[c])) for c in np.flatnonzero(k))


def _entropy_bits(x: np.ndarray) -> float:
    _, c = np.unique(x, return_counts=True)
    return float(-(c * np.log2(c / c.sum())).sum())


def _adaptive_bits(ctx: np.ndarray, sym: np.ndarray, alphabet: int) -> float:
    counts: dict[int, np.ndarray] = {}
    bits = 0.0
    for c, s in zip(ctx.tolist(), sym.tolist(), strict=True):
        row = counts.setdefault(c, np.zeros(alphabet))
        bits -= math.log2((row[s] + 0.5) / (row.sum() + 0.5 * alphabet))
        row[s] += 1
    return bits


def _key(bits: np.ndarray) -> np.ndarray:
    return np.where(bits >= 0x8000, -(bits & 0x7FFF), bits)


def main(which: str = "SmolLM2") -> None:
    found = [(n, m) for n, m in real_masters() if n.startswith(which)]
    if not found:
        sys.exit(f"no installed real weights named {which}* (see flipsync_apps.bench.workload.REAL_WEIGHTS)")
    name, masters = found[0]
    steps = AdamSteps(masters, 1e-6)
    before = steps.step()
    before = steps.step()
    after = steps.step()
    old, new = served_view(before, "bf16"), served_view(after, "bf16")
    patch, _ = diff_views(old, new)
    t = dict.fromkeys(("independent", "exponent", "exponent+2", "value", "pos", "val", "entropy", "adaptive",
                       "adaptive per class"), 0.0)  # fmt: skip
    n = 0
    for s in patch.sections:
        a, b = bits_numpy(old[s.name]).astype(np.int64), bits_numpy(new[s.name]).astype(np.int64)
        changed = a != b
        n += s.n
        t["independent"] += _log2_binom(a.size, s.n)
        t["exponent"] += _class_bits((a >> 7) & 0xFF, changed)
        t["exponent+2"] += _class_bits((a >> 5) & 0x3FF, changed)
        t["value"] += _class_bits(a, changed)
        t["pos"] += 8 * s.pos["bytes"]
        t["val"] += 8 * s.val["bytes"]
        step = (_key(b) - _key(a))[changed]
        e = ((a >> 7) & 0xFF)[changed]
        bucket = np.floor(np.log2(np.abs(step))).astype(np.int64)
        sign = (step < 0).astype(np.int64)
        t["entropy"] += _entropy_bits(step)
        none = np.zeros_like(e)
        t["adaptive"] += _adaptive_bits(none, bucket, 16) + _adaptive_bits(none, sign, 2) + bucket.sum()
        t["adaptive per class"] += _adaptive_bits(e, bucket, 16) + _adaptive_bits(e, sign, 2) + bucket.sum()
    total = len(patch.to_bytes())
    print(f"{name}: {n} of {sum(v.numel() for v in old.values())} BF16 values changed; bytes per changed value:")
    print("  positions: " + ", ".join(f"{k} {t[k] / 8 / n:.3f}" for k in ("independent", "exponent", "exponent+2")))
    print(f"             whole BF16 value as class {t['value'] / 8 / n:.3f}; the patch {t['pos'] / 8 / n:.3f}")
    per = {k: t[k] / 8 / n for k in t}
    print(f"  values: the patch {per['val']:.3f}, empirical entropy {per['entropy']:.3f}, adaptive "
          f"{per['adaptive']:.3f}, adaptive per exponent class {per['adaptive per class']:.3f}")  # fmt: skip
    bound = (t["independent"] + t["entropy"]) / 8
    print(f"  patch {total / n:.3f} (header and container {(total - patch.nbytes) / n:.3f}); independent bound "
          f"{bound / n:.3f}; patch / independent bound {total / bound:.3f}")  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:2])
