"""Read and write checkpoints: one safetensors file, or an HF-style directory of shards with an index."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from flipsync.errors import ConfigError

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 << 30


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def plan_shards(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Group tensor names into shards in mapping order, filling each up to ``max_shard_bytes``."""
    if max_shard_bytes <= 0:
        raise ConfigError("max_shard_bytes must be positive")
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards if shards[-1] else []


class Checkpoint(Mapping[str, torch.Tensor]):
    """A lazy, read-only mapping of tensor name to tensor over one or more safetensors files: tensors are read
    when asked for, so diffing two large checkpoints holds about one tensor at a time."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._where: dict[str, Path] = {}
        for file in safetensors_files(self.path):
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                        if name in self._where:
                            raise ConfigError(f"tensor {name!r} appears in both {self._where[name]} and {file}")
                        self._where[name] = file
            except (SafetensorError, OSError) as e:
                raise ConfigError(f"cannot read {file}: {e}") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        file = self._where[name]
        with safe_open(file, framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def safetensors_files(path: Path) -> list[Path]:
    """A checkpoint's .safetensors files: the file itself, or a directory's (by its index when it has one)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} does not exist (expected a .safetensors file or a directory)")
    index = path / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} is not a valid safetensors index: {e}") from None
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"directory {path} holds no .safetensors files")
    return files


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, in memory."""
    return dict(Checkpoint(path))


def save_checkpoint(
    tensors: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` to ``path``: a single file if it ends in .safetensors, else a sharded directory; each
    file under a temporary name, then renamed, so a crash never leaves a half-written file."""
    out = Path(path)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = dict(metadata or {})
    if out.suffix == ".safetensors":
        out.parent.mkdir(parents=True, exist_ok=True)
        _atomic_save(tensors, out, meta)
        return
    out.mkdir(parents=True, exist_ok=True)
    shards = plan_shards({n: tensors[n] for n in sorted(tensors)}, max_shard_bytes)
    if len(shards) <= 1:
        _atomic_save(tensors, out / "model.safetensors", meta)
        return
    weight_map = {}
    for i, names in enumerate(shards, 1):
        fname = shard_name(i, len(shards))
        _atomic_save({n: tensors[n] for n in names}, out / fname, meta)
        weight_map.update(dict.fromkeys(names, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total, **meta}, "weight_map": weight_map}
    tmp = out / (INDEX_NAME + ".tmp")
    tmp.write_text(json.dumps(index, indent=2, sort_keys=True))
    tmp.replace(out / INDEX_NAME)


def _atomic_save(tensors: Mapping[str, torch.Tensor], file: Path, meta: Mapping[str, str]) -> None:
    tmp = file.with_name(file.name + ".tmp")
    save_file(dict(tensors), str(tmp), metadata=dict(meta) or None)
    tmp.replace(file)
