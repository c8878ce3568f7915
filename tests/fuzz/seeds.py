"""Seed inputs for the fuzz targets, built in process from real patches, manifests, keyframes and keys.

Nothing binary is committed: every seed is generated from a fixed RNG seed (keys excepted, which are fresh
per run; their bytes do not matter, only their structure), so corpora stay small and follow the formats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa, x25519

from flipsync.board.keyframes import INDEX_NAME, iter_keyframe_files
from flipsync.board.signing import Signer
from flipsync.codec import Patch, diff_views, squash
from flipsync.codec.bits import dtype_named
from flipsync.codec.class_index import BaseBits
from flipsync.codec.context import ContextCoder
from flipsync.domain.manifest import Kind, Manifest, Part
from tests.strategies import PART_HASH, edit, patch_manifest

SEPARATOR = b"\x00"  # splits a two-part fuzz input (JSON cannot hold a raw NUL byte)


@dataclass(frozen=True)
class PatchCase:
    """A real patch and the views at both of its ends."""

    old: dict[str, torch.Tensor]
    new: dict[str, torch.Tensor]
    data: bytes  # the patch file (binary fixed fields, compact rows, grouped streams)


def _case(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], **kw: object) -> PatchCase:
    patch, _ = diff_views(old, new, **kw)  # type: ignore[arg-type]
    return PatchCase(old, new, patch.to_bytes())


def patch_cases() -> list[PatchCase]:
    """Patches that between them use every codec, mode and container layout the decoder knows."""
    rng = np.random.default_rng(8)
    g = torch.Generator().manual_seed(8)
    small = {
        "a.weight": torch.randn(600, generator=g).to(torch.bfloat16),
        "b.weight": torch.randn(40, 8, generator=g),
        "c.bias": torch.randint(0, 255, (300,), generator=g, dtype=torch.uint8),
        "d.weight": torch.randn(200, generator=g).to(torch.float8_e4m3fn),
    }
    small_new = {k: edit(rng, v, 0.05, style="ulp" if k != "c.bias" else "bits") for k, v in small.items()}
    big = {
        "e.weight": torch.randn(60000, generator=g).to(torch.bfloat16),
        "f.weight": torch.randn(3000, generator=g).to(torch.float16),
    }
    big_new = {
        "e.weight": edit(rng, big["e.weight"], 0.1, style="ulp"),
        "f.weight": edit(rng, big["f.weight"], 0.3, style="bits"),
    }
    runs = {
        "g.weight": torch.randn(5000, generator=g).to(torch.bfloat16),
        "h.weight": torch.randint(-9, 9, (400,), generator=g, dtype=torch.int32),
    }
    runs_new = {k: edit(rng, v, 0.2, style="runs") for k, v in runs.items()}
    cases = [
        _case(small, small_new, base_version=3, target_version=4, served_format="bf16"),
        _case(big, big_new),
        _case(runs, runs_new, mode="raw"),
    ]
    # A step patch followed by an overwrite of the same tensors squashes into mixed sections.
    third = {k: edit(rng, v, 0.05, style="bits") for k, v in small_new.items()}
    first, _ = diff_views(small, small_new)
    second, _ = diff_views(small_new, third, mode="raw")
    squashed = squash([first, second])
    cases.append(PatchCase(small, third, squashed.to_bytes()))
    # Small values change more often than large ones, so positions are coded against the base (ctx).
    mags = torch.randn(20000, generator=g) * torch.rand(20000, generator=g).pow(4)
    ctx_old = {"i.weight": mags.to(torch.bfloat16), "j.weight": mags[:4000].to(torch.float8_e4m3fn)}
    ctx_new = {}
    for k, v in ctx_old.items():
        bits = v.view(torch.int16 if v.dtype == torch.bfloat16 else torch.uint8).clone()
        moved = torch.from_numpy(rng.random(v.numel()) < 0.3) & (mags[: v.numel()].abs() < 0.01)
        bits[moved] += 1
        ctx_new[k] = bits.view(v.dtype)
    cases.append(_case(ctx_old, ctx_new, base_version=5, target_version=6))
    # Many small step sections, whose value steps and positions go into grouped streams.
    g_old, g_new, grouped = grouped_case(seed=9)
    cases.append(PatchCase(g_old, g_new, grouped.to_bytes()))
    return cases


def _steps(rng: np.random.Generator, t: torch.Tensor, frac: float) -> torch.Tensor:
    """A copy with a fraction of elements moved by small steps, mostly one ulp, a few larger (as Adam does)."""
    out = t.clone()
    flat = out.view(torch.int16).reshape(-1)
    idx = torch.from_numpy(rng.choice(t.numel(), size=max(1, int(t.numel() * frac)), replace=False))
    steps = rng.choice([1, -1, 2, -2, 3, -5, 17], size=idx.numel(), p=[0.4, 0.4, 0.06, 0.06, 0.04, 0.02, 0.02])
    flat[idx] += torch.from_numpy(steps).to(torch.int16)
    return out


def grouped_case(seed: int = 5, tensors: int = 24) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Patch]:
    """Many small tensors with a few steps each: their value steps are grouped into one stream."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    old = {f"layers.{i}.weight": torch.randn(3000, generator=g).to(torch.bfloat16) for i in range(tensors)}
    new = {k: _steps(rng, v, 0.01) for k, v in old.items()}
    old["norm.weight"] = torch.randn(64, generator=g)  # arbitrary new bits: large steps, grouped all the same
    new["norm.weight"] = edit(rng, old["norm.weight"], 0.1, style="bits")
    patch, _ = diff_views(old, new, context=False)
    return old, new, patch


def spliced_patches(cases: list[PatchCase]) -> list[bytes]:
    """Files that continue past their container (refused): two uploads joined, a stray chunk, padding."""
    return [cases[0].data + cases[-1].data, cases[1].data + cases[1].data[-4096:], cases[-1].data + bytes(8)]


def split_sections(data: bytes) -> bytes:
    """A patch as the sections target reads it: its header's rows as JSON with its fixed fields as hex under
    ``refs``, NUL, every section's streams in order."""
    patch = Patch.from_bytes(data)
    blobs = [bytes(patch.section_blob(s.name)) for s in patch.sections]
    doc = {"refs": patch.header.refs_bytes().hex(), **json.loads(patch.header.to_packed())}
    return json.dumps(doc, separators=(",", ":")).encode() + SEPARATOR + b"".join(blobs)


def ctx_seeds() -> tuple[list[BaseBits], list[tuple[int, int, dict, bytes]]]:
    """A few bases (BF16 weight-like, FP8, packed FP4 bytes, F16 with edge patterns) and ctx streams coded
    against them: (base index, n, params, blob) each."""
    rng = np.random.default_rng(7)
    w = torch.from_numpy(rng.standard_normal(3000).astype(np.float32) * 0.02)
    f16 = rng.integers(0, 1 << 16, 2000, dtype=np.uint64).astype(np.uint16)
    f16[::7] = 0x7C00  # +inf; NaN and -0 below
    f16[::11] = 0x7E01
    f16[::13] = 0x8000
    bases = [
        BaseBits(w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), dtype_named("BF16")),
        BaseBits(w.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), dtype_named("F8_E4M3")),
        BaseBits(rng.integers(0, 256, 2500, dtype=np.uint64).astype(np.uint8), dtype_named("U8")),
        BaseBits(f16, dtype_named("F16")),
    ]
    inputs = []
    coder = ContextCoder()
    for i, base in enumerate(bases):
        for density in (0.002, 0.05, 0.5):
            pos = np.flatnonzero(rng.random(base.bits.size) < density)
            if pos.size:
                params, blob = coder.encode(pos, base)
                inputs.append((i, int(pos.size), params, blob))
    return bases, inputs


def manifests() -> list[Manifest]:
    signer = Signer(ed25519.Ed25519PrivateKey.generate())
    patch = patch_manifest(meta={"origin": 0, "step": 700, "loss": 0.5, "squashed": True})
    keyframe = patch_manifest(
        version=8,
        kind=Kind.KEYFRAME,
        base_version=None,
        target_version=8,
        base_view_fp=None,
        target_view_fp="2d" * 16,
        parts=(Part("c3/model-00001-of-00001.safetensors", 4096, PART_HASH), Part(f"c3/{INDEX_NAME}", 90, "cd" * 32)),
        meta={},
    )
    span = patch_manifest(
        version=9,
        kind=Kind.SPAN,
        base_version=2,
        target_version=9,
        base_view_fp="0a",
        target_view_fp="0b",
        parts=(Part("x/patch-00000.safetensors", 1, PART_HASH), Part("x/patch-00001.safetensors", 2, PART_HASH)),
        meta={},
    )
    return [patch, keyframe, span, signer.sign(patch), signer.sign(keyframe)]


def manifest_seeds() -> list[bytes]:
    out = [m.to_json().encode() for m in manifests()]
    out.append(json.dumps(manifests()[0].to_dict(), indent=1).encode())  # not canonical, still valid
    return out


def keyframe_seeds() -> list[bytes]:
    """Index JSON, NUL, one shard; the target names them as a one-shard keyframe's files."""
    g = torch.Generator().manual_seed(1)
    views = [
        {"w": torch.randn(4, 4, generator=g).to(torch.bfloat16), "b": torch.zeros(3, dtype=torch.uint8)},
        {"x": torch.randn(8, generator=g), "s": torch.ones(2, dtype=torch.float8_e8m0fnu)},
    ]
    out = []
    for view in views:
        files = dict(iter_keyframe_files(view))
        (shard,) = (v for k, v in files.items() if k != INDEX_NAME)
        out.append(files[INDEX_NAME] + SEPARATOR + shard)
    return out


def key_seeds() -> list[bytes]:
    """PEM keys of every kind a user might hand over by mistake, and the right one."""
    ed = ed25519.Ed25519PrivateKey.generate()
    others = [
        ed448.Ed448PrivateKey.generate(),
        ec.generate_private_key(ec.SECP256R1()),
        rsa.generate_private_key(public_exponent=65537, key_size=1024),
        x25519.X25519PrivateKey.generate(),
    ]
    pkcs8 = serialization.PrivateFormat.PKCS8
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    pem, none = serialization.Encoding.PEM, serialization.NoEncryption()
    out = [ed.private_bytes(pem, pkcs8, none), ed.public_key().public_bytes(pem, spki)]
    for key in others:
        out.append(key.private_bytes(pem, pkcs8, none))
        out.append(key.public_key().public_bytes(pem, spki))
    out.append(ed.private_bytes(pem, pkcs8, serialization.BestAvailableEncryption(b"secret")))
    return out
