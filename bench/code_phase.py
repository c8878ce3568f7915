"""The trainer's "code" phase, old against new, side by side in one process.

old: every candidate coder encodes each stream and the smallest is kept, with the rANS and Rice encoders of
``--old`` (a git revision; default main) loaded from git; new: this tree (estimate-pruned registry, reciprocal
rANS). Runs alternate, best of ``--repeat``. Workload: an Adam-stepped llm-like served view (~39M elements in
BF16; lr 1e-6 changes ~2.3% of it), coded whole by ``diff_views(..., context=False)``, and a few of its sections.

    PYTHONPATH=src python bench/code_phase.py [--old main] [--repeat 5] [--format bf16|fp8-block|mxfp4|nvfp4]
"""

from __future__ import annotations

import argparse
import subprocess
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from flipsync.codec import coders, rans, rice, streams
from flipsync.codec.bits import zigzag
from flipsync.codec.encode import diff_views
from flipsync.formats import served_view
from flipsync.synthetic import AdamSteps, Shape, llm_like_masters

ROOT = Path(__file__).resolve().parent.parent


def load_old(rev: str, module: str) -> types.ModuleType:
    """``src/flipsync/codec/<module>.py`` as of ``rev``, as a module of its own (its imports are this tree's)."""
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:src/flipsync/codec/{module}.py"], check=True, capture_output=True
    ).stdout.decode()
    src = src.replace("cache=True", "cache=False")  # numba caches only functions with a file on disk
    mod = types.ModuleType(f"old_{module}")
    exec(compile(src, f"{rev}:{module}.py", "exec"), mod.__dict__)
    return mod


def encode_every(self: coders.CoderRegistry, data: np.ndarray, base: object = None) -> tuple[dict, bytes]:
    """The old registry: every accepting candidate encodes, the smallest is kept (ties to the first)."""
    found = [(c.codec_id, *c.encode(data, base)) for c in self._by_id.values() if c.accepts(data, base)]
    codec_id, params, blob = min(found, key=lambda c: len(c[2]))
    return {"codec": codec_id, **params}, blob


@contextmanager
def old_coders(old_rans: types.ModuleType, old_rice: types.ModuleType) -> Iterator[None]:
    saved = (coders.CoderRegistry.encode, rans.RansCoder.encode, rice.RiceCoder.encode)
    coders.CoderRegistry.encode = encode_every  # type: ignore[method-assign]
    rans.RansCoder.encode = lambda self, s, base=None: old_rans.ans_encode(s)  # type: ignore[method-assign]
    rice.RiceCoder.encode = lambda self, p, base=None: old_rice.rice_encode_positions(p)  # type: ignore[method-assign]
    try:
        yield
    finally:
        coders.CoderRegistry.encode, rans.RansCoder.encode, rice.RiceCoder.encode = saved  # type: ignore[method-assign]


@contextmanager
def coding_clock(spent: list[float]) -> Iterator[None]:
    """Adds the time spent in the section coders (positions, values, kind flags) to ``spent[0]``."""
    saved = (streams.encode_positions, streams.encode_symbols)

    def timed(f: Callable) -> Callable:
        def run(*args: object) -> object:
            t = time.perf_counter()
            try:
                return f(*args)
            finally:
                spent[0] += time.perf_counter() - t

        return run

    streams.encode_positions, streams.encode_symbols = timed(saved[0]), timed(saved[1])  # type: ignore[assignment]
    try:
        yield
    finally:
        streams.encode_positions, streams.encode_symbols = saved


def side_by_side(name: str, changed: int, run: Callable[[], int], old: Callable, repeat: int) -> None:
    """Best of ``repeat`` alternating runs of ``run`` (returns bytes) under the old and new coders."""
    best = {"old": float("inf"), "new": float("inf")}
    size = {}
    for _ in range(repeat):
        for which in ("old", "new"):
            spent = [0.0]
            with coding_clock(spent), old() if which == "old" else _nothing():
                size[which] = run()
            best[which] = min(best[which], spent[0])
    o, n = (best[w] / changed * 1e9 for w in ("old", "new"))
    print(
        f"{name:44s} {changed:>9,d} changed  code ns/changed: old {o:6.1f}  new {n:6.1f}  new/old {n / o:.3f}"
        f"   bytes new/old {size['new'] / size['old']:.6f}"
    )


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="main", help="git revision of the old rANS and Rice encoders")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--format", default="bf16", help="served format: bf16, fp8-block, mxfp4, nvfp4")
    args = ap.parse_args()
    old_rans, old_rice = load_old(args.old, "rans"), load_old(args.old, "rice")

    masters = llm_like_masters(Shape(hidden=1024, intermediate=2816, layers=2, vocab=8192))
    steps = AdamSteps(masters, args.lr)
    steps.step()
    before, after = steps.step(), steps.step()
    old_view, new_view = served_view(before, args.format), served_view(after, args.format)
    numel = sum(t.numel() for t in new_view.values())

    def old() -> object:
        return old_coders(old_rans, old_rice)

    # warm both (numba compiles), and count the changes
    with old():
        diff_views(old_view, new_view, context=False, digests=False)
    patch, _ = diff_views(old_view, new_view, context=False, digests=False)
    changed = sum(s.n for s in patch.header.sections)
    print(f"{args.format} view: {numel:,d} elements, {changed:,d} changed ({changed / numel:.2%}), lr {args.lr:g}")

    def whole() -> int:
        p, _ = diff_views(old_view, new_view, context=False, digests=False)
        return len(p.to_bytes())

    side_by_side("whole view, diff_views(context=False)", changed, whole, old, args.repeat)

    by_size = sorted(patch.header.sections, key=lambda s: -s.n)
    for s in (by_size[0], by_size[len(by_size) // 4], by_size[len(by_size) // 2]):
        change = patch.change(s.name)
        if change.raw is not None:
            continue  # sections of steps only
        pos, vals = change.positions, zigzag(change.values)

        def section(pos: np.ndarray = pos, vals: np.ndarray = vals) -> int:
            return len(streams.encode_positions(pos)[1]) + len(streams.encode_symbols(vals)[1])

        side_by_side(f"section {s.name} ({new_view[s.name].numel():,d})", pos.size, section, old, args.repeat)


if __name__ == "__main__":
    main()
