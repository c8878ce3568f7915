"""Weight-sync directories laid out exactly as slime / miles write them (see test_slime.py's docstring)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch
import xxhash
import zstandard


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(-1).view(torch.uint8).numpy().copy()


def slime_checksum_ref(algorithm: str, data: np.ndarray) -> str:
    if algorithm == "xxh3-128":
        h = xxhash.xxh3_128()
        h.update(data)
        return h.hexdigest()
    if algorithm == "adler32":
        return f"{zlib.adler32(data, 1):08x}"
    import blake3

    return blake3.blake3(data).hexdigest()


def slime_version_dir(
    root: Path,
    version: int,
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    *,
    encoding: str = "xor",
    checksum: str = "xxh3-128",
    ranks: int = 2,
) -> Path:
    """One ``weight_vNNNNNN/`` as slime's disk delta writes it (see the module doc)."""
    vdir = root / f"weight_v{version:06d}"
    vdir.mkdir(parents=True)
    names = sorted(new)
    per_rank: list[dict[str, np.ndarray]] = [{} for _ in range(ranks)]
    sums: list[dict[str, str]] = [{} for _ in range(ranks)]
    for i, name in enumerate(names):  # each "PP source rank" owns some tensors
        a, b = as_bytes(old[name]), as_bytes(new[name])
        if encoding == "xor":
            diff = b ^ a
            if not np.count_nonzero(diff):
                continue
        else:
            mask = a != b
            if not mask.any():
                continue
            pos = np.flatnonzero(mask).astype("<u4")
            diff = np.concatenate([np.array([pos.size], "<u4").view(np.uint8), pos.view(np.uint8), b[mask]])
        r = i % ranks
        per_rank[r][name] = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(diff), dtype=np.uint8)
        sums[r][name] = slime_checksum_ref(checksum, b)
    counts = [int(bool(d)) for d in per_rank]
    weight_map = {}
    for r, delta in enumerate(per_rank):
        if not delta:
            continue
        fname = f"model-{sum(counts[:r]):05d}-of-{sum(counts):05d}.safetensors"
        (vdir / fname).write_bytes(safetensors.numpy.save(delta, metadata=sums[r]))
        weight_map.update({n: fname for n in delta})
    index = {
        "metadata": {
            "version": f"{version:06d}",
            "base_version": f"{version - 1:06d}",
            "delta_encoding": encoding,
            "compression_format": "zstd",
            "checksum_format": checksum,
        },
        "weight_map": weight_map,
    }
    (vdir / "model.safetensors.index.json").write_text(json.dumps(index))
    return vdir


def weights_after(model: torch.nn.Module, steps: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The bf16 HF weights of ``model`` (the tensors slime gathers) after 0..steps Adam steps."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    out = []
    for i in range(steps + 1):
        if i:
            x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed + i))
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        out.append({k: v.detach().to(torch.bfloat16).clone() for k, v in model.state_dict().items()})
    return out


def hf_checkpoint(path: Path, tensors: dict[str, torch.Tensor], *, shards: int = 1) -> Path:
    """A Hugging Face checkpoint; with ``shards`` as slime's full disk sync writes it (shards + index)."""
    path.mkdir(parents=True)
    if shards == 1 and path.name == "hf":
        safetensors.torch.save_file(tensors, str(path / "model.safetensors"))
        return path
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        safetensors.torch.save_file(part, str(path / fname))
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path
