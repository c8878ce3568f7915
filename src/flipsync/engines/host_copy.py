"""A sidecar's host copy of the view an engine serves, for engines whose weights it cannot read (SGLang's, vLLM's
workers'), so that ``ctx``-coded patches decode. See docs/engines.md#patches-coded-against-their-base-the-host-copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flipsync.codec.bits import dtype_named, dtype_of
from flipsync.errors import ConfigError

__all__ = ["HostCopy", "flush", "write_safetensors"]

_ALIGN = 8


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Write a safetensors file one tensor at a time (memory O(largest tensor)); atomic via rename."""
    path = Path(path)
    # a lazy mapping reads each tensor here and once more below
    meta = {name: (dtype_of(t), tuple(t.shape), t.numel()) for name, t in tensors.items()}
    names = sorted(meta, key=lambda n: (-meta[n][0].bits, n))
    header: dict[str, Any] = {}
    offset = 0
    for name in names:
        d, shape, numel = meta[name]
        nbytes = numel * d.bits // 8
        header[name] = {"dtype": d.name, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in names:
            t = tensors[name].detach().contiguous().cpu()
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class HostCopy(MutableMapping[str, torch.Tensor]):
    """Tensors of one safetensors file, memory-mapped writable: writes go to the file's pages in place."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                (hlen,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(hlen))
        except (OSError, ValueError, struct.error) as e:
            raise ConfigError(f"cannot open the host copy {self.path}: {e}") from None
        header.pop("__metadata__", None)
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r+", offset=8 + hlen)
        self._tensors: dict[str, torch.Tensor] = {}
        for name, entry in header.items():
            d = dtype_named(entry["dtype"])
            start, end = entry["data_offsets"]
            raw = torch.from_numpy(self._mm[start:end])
            self._tensors[name] = raw.view(d.torch_dtype).reshape(entry["shape"])

    @classmethod
    def create(cls, path: str | os.PathLike[str], view: Mapping[str, torch.Tensor]) -> HostCopy:
        """Write ``view`` (e.g. a lazy ``Checkpoint``: one tensor in memory at a time) and map it."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_safetensors(view, path)
        return cls(path)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        t = self._tensors[name]
        if value.shape != t.shape or value.dtype != t.dtype:
            raise ConfigError(f"host_copy tensor {name!r} is {tuple(t.shape)} {t.dtype}; cannot store {value.dtype}")
        t.copy_(value)

    def __delitem__(self, name: str) -> None:
        raise ConfigError("the host copy's tensors are fixed by its file")

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def flush(self) -> None:
        self._mm.flush()


def flush(view: Mapping[str, torch.Tensor]) -> None:
    """Write a `HostCopy`'s pages to its file (any other mapping of CPU tensors has nothing to flush)."""
    if isinstance(view, HostCopy):
        view.flush()


def default_host_copy(model_dir: str) -> Path:
    """Where a vLLM sidecar keeps its host copy unless told: the user's cache directory, one file per model
    directory (reused across restarts; the engine uses it only while it holds what the workers serve)."""
    resolved = Path(model_dir).resolve()
    digest = hashlib.blake2b(str(resolved).encode(), digest_size=8).hexdigest()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flipsync"
    return cache / f"host-copy-{resolved.name}-{digest}.safetensors"


def open_host_copy(path: str | os.PathLike[str], model_dir: str | None) -> HostCopy:
    """The host copy at ``path``, created from the checkpoint at ``model_dir`` when it does not exist yet."""
    path = Path(path)
    if path.exists():
        return HostCopy(path)
    if model_dir is None:
        raise ConfigError(f"the host copy {path} does not exist: pass model_dir=PATH to create it")
    from flipsync.checkpoint import Checkpoint

    return HostCopy.create(path, Checkpoint(model_dir))
