"""Stage cost of a ``ctx`` patch against the same change coded with version 1 coders, side by side.

``python -m flipsync.bench.ctx_stage [ELEMENTS] [REPEATS]``: one weight-like BF16 tensor (N(0, 0.02)) moved by
Adam-like steps of three sizes; ``codec.stage`` of both patches, interleaved, best of the repeats; per changed
value and per byte of the base. A focused check of the issue's "stage no worse than 2x" target, which the
``bench codec --quick`` table (one repeat, many small tensors) measures too noisily on a busy machine. Each
line gives the best wall time and the best CPU time of the process (all its threads): on a machine whose
cores other jobs share the CPU time is the steadier figure; where the pass runs in chunks on a pool it is the
work, and the wall time the latency.
"""

from __future__ import annotations

import sys
import time

import torch

from flipsync.codec import FingerprintTable, diff_views, stage


def main(numel: int = 1 << 24, repeats: int = 7) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(numel, generator=g) * 0.02
    for scale in (0.15, 1.0, 4.0):
        step = scale * (2e-6 * torch.randn(numel, generator=g).sign() + 1e-6 * torch.randn(numel, generator=g))
        old, new = {"w": w.to(torch.bfloat16)}, {"w": (w + step).to(torch.bfloat16)}
        ctx, _ = diff_views(old, new)
        v1, _ = diff_views(old, new, context=False)
        n = ctx.header.n_changed
        table = FingerprintTable.of(old)
        patches = {"v1": v1, ctx.sections[0].pos["codec"]: ctx}
        best = dict.fromkeys(patches, float("inf"))
        cpu = dict.fromkeys(patches, float("inf"))
        for _ in range(repeats):
            for k, patch in patches.items():
                t, c = time.perf_counter(), time.process_time()
                stage(old, patch, table.copy())
                best[k] = min(best[k], time.perf_counter() - t)
                cpu[k] = min(cpu[k], time.process_time() - c)
        print(f"{numel:,} BF16 elements, {100 * n / numel:.2f}% changed")
        for k, t in best.items():
            c = cpu[k]
            print(
                f"  stage, {k:4} coders {t * 1e9 / n:7.1f} ns/change {t * 1e9 / (2 * numel):6.3f} ns/base byte"
                f"  (CPU {c * 1e9 / n:7.1f} ns/change {c * 1e9 / (2 * numel):6.3f} ns/base byte)"
            )
        ratio, cpu_ratio = best.get("ctx", float("nan")) / best["v1"], cpu.get("ctx", float("nan")) / cpu["v1"]
        print(f"  ctx / v1 = {ratio:.2f} (CPU {cpu_ratio:.2f})")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
