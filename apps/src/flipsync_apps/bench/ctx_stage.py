"""Stage cost of a ``ctx`` patch against the same change coded without the base (plain), side by side.

``python -m flipsync_apps.bench.ctx_stage [ELEMENTS] [REPEATS]``: one weight-like BF16 tensor (N(0, 0.02)) moved by
Adam-like steps of four sizes; ``codec.stage`` of both patches, the ``ctx`` one also with the receiver's class
index (built once before, as after a full load), interleaved, best of the repeats; per changed value and per
byte of the base. A focused check of the issue's "stage no worse than 2x" target, which the
``bench codec --quick`` table (one repeat, many small tensors) measures too noisily on a busy machine. Each
line gives the best wall time and the best CPU time of the process (all its threads): on a machine whose
cores other jobs share the CPU time is the steadier figure; where the pass runs in chunks on a pool it is the
work, and the wall time the latency.
"""

from __future__ import annotations

import sys
import time

import torch

from flipsync.codec import ClassIndex, diff_views, stage
from flipsync.codec.bits import bits_numpy, dtype_of
from flipsync.codec.fingerprint import FingerprintTable


def main(numel: int = 1 << 24, repeats: int = 7) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(numel, generator=g) * 0.02
    for scale in (0.01, 0.15, 1.0, 4.0):
        step = scale * (2e-6 * torch.randn(numel, generator=g).sign() + 1e-6 * torch.randn(numel, generator=g))
        old, new = {"w": w.to(torch.bfloat16)}, {"w": (w + step).to(torch.bfloat16)}
        ctx, _ = diff_views(old, new)
        plain, _ = diff_views(old, new, context=False)
        n = ctx.header.n_changed
        table = FingerprintTable.of(old)
        codec = ctx.sections[0].pos["codec"]
        t = time.perf_counter()
        index = ClassIndex()
        index.tree("w", bits_numpy(old["w"]), dtype_of(old["w"]), table["w"].fp)  # once after a full load
        build = time.perf_counter() - t
        patches = {"plain": (plain, None), codec: (ctx, None), f"{codec}+index": (ctx, index)}
        best = dict.fromkeys(patches, float("inf"))
        cpu = dict.fromkeys(patches, float("inf"))
        for _ in range(repeats):
            for k, (patch, held) in patches.items():
                t, c = time.perf_counter(), time.process_time()
                stage(old, patch, table.copy(), index=held)
                best[k] = min(best[k], time.perf_counter() - t)
                cpu[k] = min(cpu[k], time.process_time() - c)
        print(f"{numel:,} BF16 elements, {100 * n / numel:.3f}% changed; class index built in {build * 1e3:.1f} ms")
        for k, t in best.items():
            c = cpu[k]
            print(
                f"  stage, {k:9} {t * 1e9 / n:7.1f} ns/change {t * 1e9 / (2 * numel):6.3f} ns/base byte"
                f"  (CPU {c * 1e9 / n:7.1f} ns/change {c * 1e9 / (2 * numel):6.3f} ns/base byte)"
            )
        for k in (codec, f"{codec}+index"):
            print(f"  {k} / plain = {best[k] / best['plain']:.2f} (CPU {cpu[k] / cpu['plain']:.2f})")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
