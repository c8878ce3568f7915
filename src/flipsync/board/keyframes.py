"""Keyframes: a full served view as a plain HF-style sharded safetensors checkpoint an engine can load (shards of
at most ``max_shard_bytes``, a larger tensor alone); every file is a part. See docs/board.md#layout."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping

import torch
from safetensors import SafetensorError, deserialize
from safetensors.torch import save as st_save

from flipsync.checkpoint import INDEX_NAME, plan_shards, shard_name
from flipsync.codec.bits import dtype_named
from flipsync.errors import ConfigError, IntegrityError, PatchError

DEFAULT_MAX_SHARD_BYTES = 2 << 30


def iter_keyframe_files(
    tensors: Mapping[str, torch.Tensor], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> Iterator[tuple[str, bytes]]:
    """Yield (file name, bytes) for every shard, then the index; one shard in memory at a time."""
    if not tensors:
        raise ConfigError("a keyframe needs at least one tensor")
    groups = plan_shards(tensors, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(groups, start=1):
        name = shard_name(i, len(groups))
        shard: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for key in names:
            t = tensors[key].detach().to("cpu").contiguous()
            # safetensors refuses tensors that share storage; give aliases their own copy.
            ptr = t.untyped_storage().data_ptr()
            if ptr in storages and t.numel() > 0:
                t = t.clone()
            storages.add(ptr)
            shard[key] = t
            weight_map[key] = name
            total += t.numel() * t.element_size()
        yield name, st_save(shard, metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    yield INDEX_NAME, json.dumps(index, indent=2).encode("utf-8")


def parse_index(data: bytes) -> dict[str, str]:
    """The weight map of an index file, validated."""
    try:
        index = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # the last: nesting deeper than Python's stack
        raise IntegrityError(f"keyframe index is not valid JSON ({e})") from None
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise IntegrityError("keyframe index has no valid weight_map {tensor name: shard file}")
    return wm


def tensors_from_files(files: Mapping[str, bytes]) -> dict[str, torch.Tensor]:
    """Rebuild the view from a keyframe's files (already hash-verified), in index order."""
    if INDEX_NAME not in files:
        raise IntegrityError(f"keyframe has no {INDEX_NAME}")
    weight_map = parse_index(files[INDEX_NAME])
    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if shard not in files:
            raise IntegrityError(f"keyframe index names shard {shard!r}, which is not among its parts")
        for name, t in _load_shard(shard, files[shard]).items():
            if weight_map.get(name) != shard:
                raise IntegrityError(f"tensor {name!r} in {shard!r} is not listed there by the index")
            loaded[name] = t
    missing = [n for n in weight_map if n not in loaded]
    if missing:
        raise IntegrityError(f"keyframe index lists tensors missing from the shards: {missing[:5]}")
    return {n: loaded[n] for n in weight_map}


def _load_shard(shard: str, data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of one shard. Not ``safetensors.torch.load``: it raises a bare KeyError on dtypes it
    lacks (F8_E8M0, which the codec serves), and accepts dtypes the codec cannot fingerprint (C64, U16)."""
    try:
        entries = deserialize(data)
    except (SafetensorError, ValueError) as e:
        raise IntegrityError(f"keyframe shard {shard!r} is not a valid safetensors file: {e}") from None
    out: dict[str, torch.Tensor] = {}
    for name, info in entries:
        try:
            dtype = dtype_named(info["dtype"]).torch_dtype
        except PatchError:
            raise IntegrityError(
                f"tensor {name!r} in keyframe shard {shard!r} has dtype {info['dtype']}, which flipsync does not serve"
            ) from None
        raw = info["data"]
        t = torch.frombuffer(raw, dtype=dtype) if len(raw) else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(info["shape"])
    return out
