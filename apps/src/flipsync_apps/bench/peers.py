"""The encodings other weight-sync systems ship, re-implemented byte for byte, each with its decoder.

Each encoder below writes the byte layout its system writes (read from that system's source; our code): the
benchmark runs them on the same pair of served views as flipsync's patch, counts every byte that crosses to
the rollout side, decodes the result back and checks it bit for bit against the new view.

- **slime 0.4.0 / miles disk delta** (``slime/backends/megatron_utils/update_weight/update_weight_from_disk_delta.py``
  and ``slime/utils/disk_delta.py``): per changed tensor, over its raw bytes as ``uint8``, either ``xor`` (the
  XOR of old and new bytes, the default) or ``overwrite`` (a little-endian u4 count of changed *bytes*, their
  u4 positions, then the new bytes there), each compressed by zstd level 1; the compressed blobs are ``uint8``
  tensors of one safetensors file (``safetensors.numpy.save``) whose metadata maps each tensor to the
  xxh3-128 hex digest of its new bytes, next to a ``model.safetensors.index.json`` (version, base version,
  encoding, compression, checksum format, weight map). Unchanged tensors are left out.
- **slime PR #1806 ``deltas_zstd``** (``update_weight_from_distributed_delta.py``): changed *elements* (integer
  views compared), their positions gap-coded per tensor as ``idx[k] - idx[k-1] - 1`` (``idx[-1] = -1``) in
  uint16, uint32 where a gap does not fit; one safetensors file of ``__positions__`` (all gaps as a uint8
  blob) and ``__values__`` (the new elements, concatenated: one dtype), metadata ``encoding``, ``params`` (a
  JSON list of name, dtype, shape, byte and element offsets, width per tensor), ``prev_version``,
  ``current_version``; the whole file compressed by zstd level 1 (multi-threaded, as it writes it). A view of
  several element dtypes cannot be concatenated: not applicable.
- **TRL delta sync** (PR #5937, ``trl/experimental/async_grpo/delta_engine.py`` and ``delta_codec.py``): one
  safetensors file holding, for *every* parameter, ``{name}.val`` (the changed values cast to bf16) and
  ``{name}.idx``: ``gap_delta`` (the default: gaps as above, uint16 or uint32 per parameter) or ``raw``
  (int32 positions); metadata is its ``PatchMetadata`` as strings. The bf16 cast makes it lossless for BF16
  views only.
- **vLLM 0.32.0 ``sparse_nccl``** (``vllm/distributed/weight_transfer/sparse_nccl_engine.py``): per changed
  tensor an int32 index tensor and a value tensor in its own dtype, broadcast over NCCL; the update info
  (names, dtype names, shapes, counts) goes as JSON to the engine's ``update_weights`` call.
- **verl ``delta_sharded``** (``verl/checkpoint_engine/delta_checkpoint_engine.py``): one flush: a pickled
  manifest (sent with pyzmq's ``send_pyobj``; its topic frame, a few bytes, is not counted) with a
  ``DeltaParam`` per changed tensor and a checksum, then the int32 positions and the concatenated values
  (one dtype) over NCCL. The sharded gather that precedes it happens inside the trainer and is not counted.

Every peer here is given the exact changed set (bitwise), as their byte-diff paths compute it.
"""

from __future__ import annotations

import json
import pickle
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch
import xxhash
import zstandard

from flipsync.codec.bits import bits_numpy, int_view
from flipsync.errors import FlipsyncError

View = Mapping[str, torch.Tensor]


class PeerMismatch(FlipsyncError):
    """A peer encoding did not decode back to the new view bit for bit (a bug in its re-implementation)."""


@dataclass(frozen=True)
class Peer:
    """One system's encoding: ``encode(old, new)`` returns what crosses to the rollout side (``None`` where it
    does not apply to this view), ``decode(old, wire)`` rebuilds the new view from it."""

    key: str  # the JSON field and column id
    label: str  # the column header: system, version, encoding
    encode: Callable[[View, View], Any | None]
    decode: Callable[[View, Any], dict[str, torch.Tensor]]
    size: Callable[[Any], int]


@dataclass
class PeerResult:
    key: str
    bytes: int | None  # None: the encoding does not apply to this view (see the module doc)
    encode_s: float
    verified: bool | None


# -- shared helpers ---------------------------------------------------------------------------------------


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """A tensor's raw bytes, flat ``uint8`` (what slime's disk delta diffs)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()


def _from_bytes(raw: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw).copy()).view(like.dtype).reshape(like.shape)


def _changed(old: torch.Tensor, new: torch.Tensor) -> np.ndarray:
    """Flat indices of the elements whose bit patterns differ (the integer-view compare every peer does)."""
    return np.flatnonzero(bits_numpy(old.contiguous()) != bits_numpy(new.contiguous()))


def _gather(t: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
    """The elements at ``idx``, flat, in ``t``'s dtype (gathered through the integer view: bit for bit)."""
    return int_view(t.detach().contiguous())[torch.from_numpy(idx.astype(np.int64))].view(t.dtype)


def _scatter(old: torch.Tensor, idx: np.ndarray, values: torch.Tensor) -> torch.Tensor:
    """``old`` with the elements at ``idx`` replaced, bit for bit, by ``values`` (same dtype)."""
    out = old.detach().clone().contiguous()
    if idx.size:
        if values.dtype != old.dtype:
            values = values.to(old.dtype)  # TRL's bf16 values into a bf16 view: the same bits
        int_view(out)[torch.from_numpy(idx.astype(np.int64))] = int_view(values.contiguous())
    return out


def _gaps(idx: np.ndarray) -> np.ndarray:
    """Sorted positions as ``idx[k] - idx[k-1] - 1`` (``idx[-1] = -1``): uint16 if every gap fits, else uint32."""
    if idx.size == 0:
        return np.zeros(0, np.uint16)
    g = np.diff(idx.astype(np.int64), prepend=-1) - 1
    return g.astype(np.uint16 if int(g.max()) <= 0xFFFF else np.uint32)


def _ungap(g: np.ndarray) -> np.ndarray:
    return np.cumsum(g.astype(np.int64) + 1) - 1


def _st_metadata(blob: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file in memory."""
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]).get("__metadata__", {})


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# -- slime / miles disk delta (xor, overwrite) ------------------------------------------------------------

SLIME_SHARD = "model-00000-of-00001.safetensors"  # one PP-source rank writes one file


def _slime_encode(old: View, new: View, encoding: str) -> tuple[bytes, bytes] | None:
    delta: dict[str, np.ndarray] = {}
    digests: dict[str, str] = {}
    zc = zstandard.ZstdCompressor(level=1)
    for name, t in new.items():
        a, b = _bytes_of(old[name]), _bytes_of(t)
        if encoding == "xor":
            payload = b ^ a
            if not np.count_nonzero(payload):
                continue
        else:
            mask = b != a
            if not mask.any():
                continue
            pos = np.flatnonzero(mask).astype("<u4")
            payload = np.concatenate([np.array([pos.size], "<u4").view(np.uint8), pos.view(np.uint8), b[mask]])
        delta[name] = np.frombuffer(zc.compress(payload.tobytes()), dtype=np.uint8)
        digests[name] = xxhash.xxh3_128(b.tobytes()).hexdigest()
    if not delta:
        return None
    blob = safetensors.numpy.save(delta, metadata=digests)
    index = {
        "metadata": {
            "version": "000001",
            "base_version": "000000",
            "delta_encoding": encoding,
            "compression_format": "zstd",
            "checksum_format": "xxh3-128",
        },
        "weight_map": dict.fromkeys(delta, SLIME_SHARD),
    }
    return blob, json.dumps(index).encode()


def _slime_decode(old: View, wire: tuple[bytes, bytes] | None) -> dict[str, torch.Tensor]:
    out = dict(old)
    if wire is None:
        return out
    blob, index = wire
    meta = json.loads(index)["metadata"]
    digests = _st_metadata(blob)
    zd = zstandard.ZstdDecompressor()
    for name, comp in safetensors.numpy.load(blob).items():
        a = _bytes_of(old[name])
        raw = np.frombuffer(zd.decompress(comp.tobytes(), max_output_size=max(1, 9 * a.size + 4)), np.uint8)
        if meta["delta_encoding"] == "xor":
            b = a ^ raw
        else:
            (n,) = struct.unpack("<I", raw[:4].tobytes())
            pos = raw[4 : 4 + 4 * n].view("<u4")
            b = a.copy()
            b[pos] = raw[4 + 4 * n :]
        if xxhash.xxh3_128(b.tobytes()).hexdigest() != digests[name]:
            raise PeerMismatch(f"slime {meta['delta_encoding']}: checksum of {name} differs after apply")
        out[name] = _from_bytes(b, old[name])
    return out


def _pair_size(wire: tuple[bytes, bytes]) -> int:
    return len(wire[0]) + len(wire[1])


# -- slime PR #1806 deltas_zstd ---------------------------------------------------------------------------


_NO_SAFETENSORS = {torch.float8_e8m0fnu}  # safetensors 0.8 cannot read these back


def _one_dtype(new: View, names: list[str]) -> torch.dtype | None:
    """The one element dtype of the named tensors (what ``torch.cat`` of their values needs), else None."""
    dtypes = {new[n].dtype for n in names}
    return dtypes.pop() if len(dtypes) == 1 else None


def _deltas_zstd_encode(old: View, new: View) -> bytes | None:
    pieces: list[bytes] = []
    values: list[torch.Tensor] = []
    params: list[dict[str, Any]] = []
    pos_off = val_off = 0
    changed = {name: _changed(old[name], t) for name, t in new.items()}
    names = [n for n, idx in changed.items() if idx.size]
    dtype = _one_dtype(new, names) if names else None
    if dtype is None or dtype in _NO_SAFETENSORS:
        return None  # nothing to send, or values that one safetensors tensor cannot hold
    for name in names:
        idx = changed[name]
        g = _gaps(idx)
        raw = g.tobytes()
        params.append(
            {
                "name": name,
                "dtype": _dtype_name(new[name].dtype),
                "shape": list(new[name].shape),
                "pos_start": pos_off,
                "pos_end": pos_off + len(raw),
                "pos_width": g.itemsize,
                "val_start": val_off,
                "val_end": val_off + idx.size,
            }
        )
        pieces.append(raw)
        values.append(_gather(new[name], idx))
        pos_off += len(raw)
        val_off += idx.size
    tensors = {
        "__positions__": torch.frombuffer(bytearray(b"".join(pieces)), dtype=torch.uint8),
        "__values__": torch.cat(values),
    }
    metadata = {
        "encoding": "deltas_zstd",
        "params": json.dumps(params),
        "prev_version": "default",
        "current_version": "1",
    }
    blob = safetensors.torch.save(tensors, metadata=metadata)
    return zstandard.ZstdCompressor(level=1, threads=-1).compress(blob)


def _deltas_zstd_decode(old: View, wire: bytes | None) -> dict[str, torch.Tensor]:
    out = dict(old)
    if wire is None:
        return out
    blob = zstandard.ZstdDecompressor().decompress(wire)
    tensors = safetensors.torch.load(blob)
    pos = tensors["__positions__"].numpy()
    values = tensors["__values__"]
    for p in json.loads(_st_metadata(blob)["params"]):
        g = pos[p["pos_start"] : p["pos_end"]].view(np.uint16 if p["pos_width"] == 2 else np.uint32)
        out[p["name"]] = _scatter(old[p["name"]], _ungap(g), values[p["val_start"] : p["val_end"]])
    return out


# -- TRL delta sync (gap_delta, raw) ----------------------------------------------------------------------


def _trl_encode(old: View, new: View, encoding: str) -> bytes | None:
    floats = [t for t in new.values() if t.is_floating_point()]
    if any(t.dtype != torch.bfloat16 for t in floats) or len(floats) != len(new):
        return None  # it casts every value to bf16: lossless only where the view is bf16
    tensors: dict[str, torch.Tensor] = {}
    total_changed = total = 0
    for name, t in new.items():  # every parameter gets its two entries, changed or not
        idx = _changed(old[name], t)
        total_changed += idx.size
        total += t.numel()
        tensors[f"{name}.val"] = _gather(t, idx).to(torch.bfloat16)
        if encoding == "gap_delta":
            g = _gaps(idx)
            tensors[f"{name}.idx"] = torch.from_numpy(g.view(np.int16 if g.itemsize == 2 else np.int32)).view(
                torch.uint16 if g.itemsize == 2 else torch.uint32
            )
        else:
            tensors[f"{name}.idx"] = torch.from_numpy(idx.astype(np.int32))
    if not total_changed:
        return None
    metadata = {  # TRL's PatchMetadata, every field as the string it writes
        "format": "sparse_weight_patch",
        "version": "1",
        "sparse": "True",
        "model_version": "1",
        "num_changed_params": str(len(new)),
        "total_changed_elements": str(total_changed),
        "total_elements": str(total),
        "sparsity": str(1.0 - total_changed / max(total, 1)),
        "encoding": encoding,
    }
    return safetensors.torch.save(tensors, metadata=metadata)


def _trl_decode(old: View, wire: bytes | None) -> dict[str, torch.Tensor]:
    out = dict(old)
    if wire is None:
        return out
    encoding = _st_metadata(wire)["encoding"]
    tensors = safetensors.torch.load(wire)
    for key in tensors:
        if not key.endswith(".val"):
            continue
        name = key[: -len(".val")]
        raw = tensors[f"{name}.idx"]
        if encoding == "gap_delta":
            g = raw.view(torch.int16 if raw.dtype == torch.uint16 else torch.int32).numpy()
            idx = _ungap(g.view(np.uint16 if raw.dtype == torch.uint16 else np.uint32))
        else:
            idx = raw.numpy().astype(np.int64)
        out[name] = _scatter(old[name], idx, tensors[key])
    return out


# -- vLLM sparse_nccl -------------------------------------------------------------------------------------


@dataclass
class _Broadcast:
    """What vLLM's sparse NCCL path sends: the update info (JSON) and, per tensor, indices then values."""

    info: bytes
    buffers: list[tuple[bytes, bytes]]


def _vllm_encode(old: View, new: View) -> _Broadcast | None:
    names, dtypes, shapes, counts, buffers = [], [], [], [], []
    for name, t in new.items():
        idx = _changed(old[name], t)
        if not idx.size:
            continue
        names.append(name)
        dtypes.append(str(t.dtype).split(".")[-1])
        shapes.append(list(t.shape))
        counts.append(int(idx.size))
        values = _gather(t, idx)
        buffers.append((idx.astype(np.int32).tobytes(), _bytes_of(values).tobytes()))
    if not names:
        return None
    info = {"names": names, "dtype_names": dtypes, "shapes": shapes, "num_updates_list": counts}
    return _Broadcast(json.dumps(info).encode(), buffers)


def _vllm_decode(old: View, wire: _Broadcast | None) -> dict[str, torch.Tensor]:
    out = dict(old)
    if wire is None:
        return out
    info = json.loads(wire.info)
    for name, dtype_name, n, (ib, vb) in zip(
        info["names"], info["dtype_names"], info["num_updates_list"], wire.buffers, strict=True
    ):
        idx = np.frombuffer(ib, np.int32).astype(np.int64)
        values = torch.frombuffer(bytearray(vb), dtype=getattr(torch, dtype_name)) if n else torch.empty(0)
        out[name] = _scatter(old[name], idx, values)
    return out


def _broadcast_size(wire: _Broadcast) -> int:
    return len(wire.info) + sum(len(i) + len(v) for i, v in wire.buffers)


# -- verl delta_sharded -----------------------------------------------------------------------------------


@dataclass
class _Flush:
    meta: bytes  # pickled manifest
    positions: bytes
    values: bytes


def _hash(t: torch.Tensor) -> int:
    """verl's wire checksum: ``torch.hash_tensor`` (an XOR of the elements upcast to 64 bits); over the integer
    view where torch has no CPU kernel for the dtype (float8): another value, the same size in the manifest."""
    if not t.numel():
        return 0
    try:
        return int(torch.hash_tensor(t).item())
    except (NotImplementedError, RuntimeError):
        return int(torch.hash_tensor(torch.from_numpy(bits_numpy(t.contiguous()).astype(np.int64))).item())


def _verl_encode(old: View, new: View) -> _Flush | None:
    changed = {name: _changed(old[name], t) for name, t in new.items()}
    names = [n for n, idx in changed.items() if idx.size]
    dtype = _one_dtype(new, names) if names else None
    if dtype is None:
        return None  # nothing changed, or values of several dtypes that one flush tensor cannot hold
    params, pos, vals = [], [], []
    pos_off = val_off = 0
    for name in names:
        idx = changed[name]
        params.append(
            {
                "name": name,
                "dtype": _dtype_name(new[name].dtype),
                "shape": list(new[name].shape),
                "pos_start": pos_off,
                "pos_end": pos_off + 4 * idx.size,
                "pos_width": 4,
                "val_start": val_off,
                "val_end": val_off + idx.size,
            }
        )
        pos.append(torch.from_numpy(idx.astype(np.int32)))
        vals.append(_gather(new[name], idx))
        pos_off += 4 * idx.size
        val_off += idx.size
    positions = torch.cat(pos).view(torch.uint8)
    values = torch.cat(vals)
    p_hash = _hash(positions)
    v_hash = _hash(values)
    meta = {
        "is_full": False,
        "encoding": "indices",
        "is_last": True,
        "terminal_empty": False,
        "pos_numel": int(positions.numel()),
        "val_numel": int(values.numel()),
        "val_dtype": _dtype_name(values.dtype),
        "spec": {"encoding": "indices", "params": params, "checksum": p_hash ^ (v_hash << 1)},
    }
    return _Flush(
        pickle.dumps(meta, protocol=pickle.DEFAULT_PROTOCOL), positions.numpy().tobytes(), _bytes_of(values).tobytes()
    )


def _verl_decode(old: View, wire: _Flush | None) -> dict[str, torch.Tensor]:
    out = dict(old)
    if wire is None:
        return out
    meta = pickle.loads(wire.meta)  # our own bytes, made above
    values = torch.frombuffer(bytearray(wire.values), dtype=getattr(torch, meta["val_dtype"]))
    pos = np.frombuffer(wire.positions, np.int32)
    for p in meta["spec"]["params"]:
        idx = pos[p["pos_start"] // 4 : p["pos_end"] // 4].astype(np.int64)
        out[p["name"]] = _scatter(old[p["name"]], idx, values[p["val_start"] : p["val_end"]])
    return out


def _flush_size(wire: _Flush) -> int:
    return len(wire.meta) + len(wire.positions) + len(wire.values)


PEERS: tuple[Peer, ...] = (
    Peer(
        "slime_xor",
        "slime 0.4.0 xor+zstd-1",
        lambda o, n: _slime_encode(o, n, "xor"),
        _slime_decode,
        _pair_size,
    ),
    Peer(
        "slime_overwrite",
        "slime 0.4.0 overwrite",
        lambda o, n: _slime_encode(o, n, "overwrite"),
        _slime_decode,
        _pair_size,
    ),
    Peer("slime_deltas_zstd", "slime #1806 deltas_zstd", _deltas_zstd_encode, _deltas_zstd_decode, len),
    Peer("trl_gap_delta", "TRL #5937 gap_delta", lambda o, n: _trl_encode(o, n, "gap_delta"), _trl_decode, len),
    Peer("trl_raw", "TRL #5937 raw", lambda o, n: _trl_encode(o, n, "raw"), _trl_decode, len),
    Peer("vllm_sparse", "vLLM 0.32.0 sparse_nccl", _vllm_encode, _vllm_decode, _broadcast_size),
    Peer("verl_delta_sharded", "verl 0.9 delta_sharded", _verl_encode, _verl_decode, _flush_size),
)
PEER_KEYS = tuple(p.key for p in PEERS)


def same_bits(a: View, b: View) -> bool:
    """Same names, dtypes, shapes and bit patterns."""
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype
        and a[k].shape == b[k].shape
        and np.array_equal(bits_numpy(a[k].contiguous()), bits_numpy(b[k].contiguous()))
        for k in a
    )


def measure(old: View, new: View, *, verify: bool = True) -> dict[str, PeerResult]:
    """Every peer's bytes on (old -> new), its encode time (one pass), and whether it decoded back bitwise.

    Raises `PeerMismatch` if a peer's output does not decode to ``new``: a wrong figure is worse than none."""
    out = {}
    for peer in PEERS:
        t = time.perf_counter()
        wire = peer.encode(old, new)
        encode_s = time.perf_counter() - t
        if wire is None:
            out[peer.key] = PeerResult(peer.key, None, encode_s, None)
            continue
        ok = None
        if verify:
            ok = same_bits(peer.decode(old, wire), new)
            if not ok:
                raise PeerMismatch(f"{peer.label} did not decode back to the new view bit for bit")
        out[peer.key] = PeerResult(peer.key, peer.size(wire), encode_s, ok)
    return out


def as_dict(results: Mapping[str, PeerResult]) -> dict[str, Any]:
    return {k: asdict(r) for k, r in results.items()}
