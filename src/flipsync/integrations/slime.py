"""slime / miles: `SlimePublisher`, a post-write hook that publishes every disk weight sync (delta or full) to
a board, checking slime's checksums before anything is applied. See docs/integrations/slime.md."""

from __future__ import annotations

import json
import logging
import os
import re
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import safetensors
import safetensors.numpy
import torch
import xxhash
import zstandard

from flipsync.errors import ConfigError, IntegrityError
from flipsync.integrations.named import StepPublisher
from flipsync.stores import Store
from flipsync.trainer import PublisherConfig
from flipsync.trainer.rounds import Published

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
_VERSION_DIR = re.compile(r"weight_v(\d+)$")


def slime_checksum(algorithm: str, data: np.ndarray) -> str:
    """The per-tensor checksum slime records for a tensor's new bytes (``checksum_format``)."""
    buf = memoryview(np.ascontiguousarray(data)).cast("B")
    if algorithm == "xxh3-128":
        return xxhash.xxh3_128(buf).hexdigest()
    if algorithm == "blake3":
        return blake3.blake3(buf).hexdigest()
    if algorithm == "adler32":
        return f"{zlib.adler32(buf):08x}"
    raise ConfigError(f"unknown slime checksum_format {algorithm!r} (xxh3-128, blake3 or adler32)")


def load_hf_dir(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face safetensors checkpoint (a directory, with or without an index)."""
    root = Path(path)
    index = root / INDEX
    if root.is_file():
        files = [root]
    elif index.exists():
        files = [root / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{root} holds no safetensors checkpoint")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safetensors.safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118  (safe_open has no __iter__)
                out[name] = st.get_tensor(name).clone()
    return out


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a writable uint8 array sharing its memory."""
    return t.view(-1).view(torch.uint8).numpy()


def decode_delta(version_dir: Path, held: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The new bytes of every tensor a slime delta version changes, each checked against its checksum (nothing
    in ``held`` is modified)."""
    index = json.loads((version_dir / INDEX).read_text())
    meta = index.get("metadata", {})
    encoding = meta.get("delta_encoding")
    if encoding not in ("xor", "overwrite"):
        raise ConfigError(f"{version_dir}: unknown delta_encoding {encoding!r} (xor or overwrite)")
    if meta.get("compression_format", "zstd") != "zstd":
        raise ConfigError(f"{version_dir}: unknown compression_format {meta.get('compression_format')!r}")
    algorithm = meta.get("checksum_format", "xxh3-128")
    weight_map: dict[str, str] = index.get("weight_map", {})
    new: dict[str, np.ndarray] = {}
    dctx = zstandard.ZstdDecompressor()
    for file in sorted(set(weight_map.values())):
        path = version_dir / file
        with safetensors.safe_open(str(path), framework="np") as st:
            checksums = st.metadata() or {}
        for name, blob in safetensors.numpy.load_file(str(path)).items():
            if weight_map.get(name) != file:
                continue
            if name not in held:
                raise IntegrityError(f"{version_dir.name}: {name!r} is not a tensor of the weights it applies to")
            old = _bytes_of(held[name])
            diff = np.frombuffer(dctx.decompress(blob.tobytes()), dtype=np.uint8)
            if encoding == "xor":
                if diff.size != old.size:
                    raise IntegrityError(f"{version_dir.name}: {name!r} diff has {diff.size} bytes, not {old.size}")
                out = old ^ diff
            else:
                out = old.copy()
                count = int(diff[:4].view("<u4")[0]) if diff.size >= 4 else -1
                if count < 0 or diff.size != 4 + 5 * count:
                    raise IntegrityError(f"{version_dir.name}: {name!r} is not an overwrite delta")
                pos = diff[4 : 4 + 4 * count].view("<u4").astype(np.int64)
                if count and int(pos.max()) >= old.size:
                    raise IntegrityError(f"{version_dir.name}: {name!r} writes past its {old.size} bytes")
                out[pos] = diff[4 + 4 * count :]
            want = checksums.get(name)
            if want is None or slime_checksum(algorithm, out) != want:
                raise IntegrityError(
                    f"{version_dir.name}: {name!r} does not match its {algorithm} checksum after decoding (a wrong "
                    "base or a damaged file); nothing was published"
                )
            new[name] = out
    missing = sorted(set(weight_map) - set(new))
    if missing:
        raise IntegrityError(f"{version_dir.name}: the index names {missing[:3]} but no file holds them")
    return new


class SlimePublisher:
    """A slime / miles ``--custom-update-weight-post-write-path`` hook that publishes each sync: make one in a
    module of your own and name it on slime's command line (docs/integrations/slime.md).

    ``base``: the checkpoint the delta stream starts from (default: slime's ``args.hf_checkpoint``).
    Other arguments as `flipsync.trainer.Publisher`. Only rank 0 reads and publishes (slime calls the hook
    on every rank); ``published`` is the last version.
    """

    def __init__(
        self,
        board: str | os.PathLike[str] | Store,
        *,
        run: str,
        format: str = "bf16",
        base: str | os.PathLike[str] | None = None,
        resume: bool = False,
        new_weights: bool = False,
        config: PublisherConfig | None = None,
    ) -> None:
        self.publisher = StepPublisher(
            board, run=run, format=format, resume=resume, new_weights=new_weights, step_key="slime_version",
            config=config,
        )  # fmt: skip
        self.base = base
        self.held: dict[str, torch.Tensor] | None = None
        self.version: int | None = None  # slime's weight version the held weights are
        self.published: Published | None = None

    def __call__(self, args: Any, version_dir: str, rollout_engines: Sequence[Any] = ()) -> None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        self.publish_dir(Path(version_dir), getattr(args, "hf_checkpoint", None))

    def publish_dir(self, version_dir: Path, hf_checkpoint: str | None = None) -> Published | None:
        """Publish what slime just wrote at ``version_dir`` (rank 0's work of the hook)."""
        index = version_dir / INDEX
        if not index.exists() and not any(version_dir.glob("*.safetensors")):
            # slime's delta mode calls the hook on the (emptied) delta directory before its first version
            base = self.base or hf_checkpoint
            if base is None:
                raise ConfigError(
                    "the slime delta stream starts from its --hf-checkpoint: pass SlimePublisher(base=...) or let "
                    "slime pass args.hf_checkpoint"
                )
            self.held, self.version = load_hf_dir(base), 0
            log.info("flipsync: the slime delta stream starts from %s", base)
            return self._publish(0, {"source": Path(base).name})
        meta = json.loads(index.read_text()).get("metadata", {}) if index.exists() else {}
        m = _VERSION_DIR.search(version_dir.name)
        version = int(meta["version"]) if "version" in meta else int(m.group(1)) if m else None
        if "delta_encoding" in meta:
            if self.held is None:
                raise ConfigError(
                    f"{version_dir.name} is a delta, but this hook has not seen the stream's start (slime calls it "
                    "on the delta directory first); restart the run, or publish full syncs"
                )
            base_version = int(meta.get("base_version", -1))
            if base_version != self.version:
                raise IntegrityError(
                    f"{version_dir.name} applies to weight version {base_version}, the hook holds {self.version}: "
                    "out of order, nothing published"
                )
            for name, data in decode_delta(version_dir, self.held).items():  # every tensor checked: now apply them all
                _bytes_of(self.held[name])[:] = data
        else:
            self.held = load_hf_dir(version_dir)
        self.version = version
        return self._publish(version, {"source": version_dir.name})

    def _publish(self, version: int | None, meta: Mapping[str, str | int]) -> Published:
        assert self.held is not None
        self.published = self.publisher.publish(self.held, version, meta)
        return self.published

    def close(self) -> None:
        self.publisher.close()
