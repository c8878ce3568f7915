"""Builders shared by the tests: served views, the edits a training step makes, chains of patches between them
(hypothesis strategies among them), and a valid patch manifest."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from flipsync.codec import Patch, diff_views
from flipsync.domain.manifest import Kind, Manifest, Part

CODEC_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e8m0fnu,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float64,
    torch.bool,
]
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_of(t: torch.Tensor) -> np.ndarray:
    """Raw bit patterns, for bitwise comparisons (never compare floats)."""
    v = t.view(torch.uint8) if t.dtype == torch.bool else t.view(_INT_VIEW[t.element_size()])
    return v.reshape(-1).numpy().copy()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits_of(a), bits_of(b))


def random_tensor(rng: np.random.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs, infinities, subnormals and -0 included) of the given dtype."""
    n = int(np.prod(shape))
    size = torch.empty(0, dtype=dtype).element_size()
    raw = rng.integers(0, 256, size=n * size, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    t = torch.from_numpy(raw).view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)
    return t.clone()


def edit(rng: np.random.Generator, t: torch.Tensor, frac: float, *, style: str) -> torch.Tensor:
    """A copy with a fraction of elements changed: one-ulp steps, arbitrary new bits, or runs."""
    out = t.clone()
    n = t.numel()
    if n == 0:
        return out
    k = int(rng.binomial(n, frac))
    if style == "runs" and k:
        start = int(rng.integers(0, n))
        idx = np.arange(start, min(n, start + k))
    else:
        idx = rng.choice(n, size=k, replace=False)
    flat = (
        out.reshape(-1).view(torch.uint8)
        if t.dtype == torch.bool
        else out.reshape(-1).view(_INT_VIEW[t.element_size()])
    )
    if style == "ulp" and t.dtype != torch.bool:
        flat[torch.from_numpy(idx)] += torch.from_numpy(rng.choice([-1, 1], size=idx.size)).to(flat.dtype)
    else:
        fresh = random_tensor(rng, t.dtype, (idx.size,)).reshape(-1)
        fresh = fresh.view(torch.uint8) if t.dtype == torch.bool else fresh.view(flat.dtype)
        flat[torch.from_numpy(idx)] = fresh
    return out


@st.composite
def view_pairs(draw: st.DrawFn, max_tensors: int = 4, max_numel: int = 3000) -> tuple[dict, dict]:
    """(old, new): views of a few tensors of any dtype and shape, with new an edit of old."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    names = draw(
        st.lists(st.sampled_from([f"t{i}.weight" for i in range(8)]), min_size=1, max_size=max_tensors, unique=True)
    )
    old, new = {}, {}
    for name in names:
        dtype = draw(st.sampled_from(CODEC_DTYPES))
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0 if ndim else 1, 24), min_size=ndim, max_size=ndim)))
        if int(np.prod(shape)) > max_numel:
            shape = (max_numel,)
        old[name] = random_tensor(rng, dtype, shape)
        frac = draw(st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5, 1.0]))
        style = draw(st.sampled_from(["ulp", "bits", "runs"]))
        new[name] = edit(rng, old[name], frac, style=style)
    return old, new


@st.composite
def patch_chains(draw: st.DrawFn, max_steps: int) -> tuple[list[dict[str, torch.Tensor]], list[Patch]]:
    """2 to ``max_steps`` edits of a drawn view (ulp, bits and runs in turn, 20% of the values each) and the
    patches between consecutive views, each coded as steps or, three times in ten, as raw values; every patch
    read back from its bytes. Draws the ``steps + 1`` views and the ``steps`` patches."""
    start = draw(view_pairs(max_tensors=3, max_numel=2000))[0]
    steps = draw(st.integers(2, max_steps))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    views = [start]
    for i in range(steps):
        views.append({k: edit(rng, v, 0.2, style=["ulp", "bits", "runs"][i % 3]) for k, v in views[-1].items()})
    patches, table = [], None
    for i in range(steps):
        mode = "raw" if rng.random() < 0.3 else "step"
        p, table = diff_views(views[i], views[i + 1], mode=mode, old_table=table)  # type: ignore[arg-type]
        patches.append(Patch.from_bytes(p.to_bytes()))
    return views, patches


PART_HASH = "ab" * 32


def patch_manifest(**over: Any) -> Manifest:
    """A valid manifest of patch v6 -> v7 of run ``run-1``; keyword arguments replace its fields."""
    fields: dict[str, Any] = dict(
        run="run-1",
        version=7,
        kind=Kind.PATCH,
        base_version=6,
        target_version=7,
        base_view_fp="0f" * 8,
        target_view_fp="1e" * 8,
        served_format="bf16",
        parts=(Part("a1b2/patch-00000.safetensors", 123, PART_HASH),),
        created="2026-01-02T03:04:05.000006Z",
        publisher="trainer-0",
        meta={"origin": 0, "step": 700},
    )
    fields.update(over)
    return Manifest(**fields)
