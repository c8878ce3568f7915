"""Taking patch files apart and putting them back together, for tests that damage or craft them."""

from __future__ import annotations

import json
import struct

import pytest
import torch
import zstandard

from flipsync.codec import Patch, apply_patch
from flipsync.codec.container import HEADER_TENSOR, split_tail
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.domain.headers import ROW, varint
from flipsync.errors import CorruptPatchError
from tests.strategies import same_bits


def header_tensor(data: bytes) -> bytes:
    hlen = struct.unpack_from("<Q", data)[0]
    a, b = json.loads(data[8 : 8 + hlen])[HEADER_TENSOR]["data_offsets"]
    return data[8 + hlen + a : 8 + hlen + b]


def tail_parts(data: bytes) -> list[bytes]:
    """[fixed fields, compressed rows, grouped values, grouped positions, small sections] of a patch file."""
    return [bytes(p or b"") for p in split_tail(header_tensor(data))]


def relayout(data: bytes, replace: dict[str, bytes]) -> bytes:
    """The safetensors file ``data`` with some tensors' bytes replaced, every offset moved to match."""
    hlen = struct.unpack_from("<Q", data)[0]
    outer = json.loads(data[8 : 8 + hlen])
    body, cursor = [], 0
    for name, e in sorted(
        ((k, v) for k, v in outer.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"]
    ):
        a, b = e["data_offsets"]
        blob = replace.get(name, data[8 + hlen + a : 8 + hlen + b])
        e.update(shape=[len(blob)], data_offsets=[cursor, cursor + len(blob)])
        body.append(blob)
        cursor += len(blob)
    head = json.dumps(outer).encode()
    return struct.pack("<Q", len(head)) + head + b"".join(body)


def rebuild(data: bytes, parts: list[bytes]) -> bytes:
    """``data`` with its header tensor made of ``parts`` (see ``tail_parts``)."""
    refs, packed, values, positions, small = parts
    tail = b"".join(varint(len(p)) + p for p in (refs, packed, values, positions)) + small
    return relayout(data, {HEADER_TENSOR: tail})


def rows(data: bytes) -> dict:
    """The header's rows document (``PatchHeader.to_packed``) of a patch file."""
    return json.loads(zstandard.ZstdDecompressor().decompress(tail_parts(data)[1]))


def with_rows(data: bytes, mutate: object, *, as_dicts: bool = False) -> bytes:
    """``data`` with its header's rows changed by ``mutate(doc)``; ``as_dicts``: each section row handed to it
    as a dict of the fields of ``ROW`` (bare codec ids as ``{"codec": id}``), and written back as a row."""
    doc = rows(data)
    if as_dicts:
        doc["sections"] = [
            {
                k: ({"codec": v} if k in ("pos", "val", "tag") and isinstance(v, str) else v)
                for k, v in zip(ROW, r, strict=False)
            }
            for r in doc["sections"]
        ]
    mutate(doc)  # type: ignore[operator]
    if as_dicts and isinstance(doc["sections"], list):
        doc["sections"] = [[s.get(k) for k in ROW if k in s] if isinstance(s, dict) else s for s in doc["sections"]]
    parts = tail_parts(data)
    parts[1] = zstandard.ZstdCompressor().compress(json.dumps(doc, separators=(",", ":")).encode())
    return rebuild(data, parts)


def with_part(data: bytes, i: int, blob: bytes) -> bytes:
    parts = tail_parts(data)
    parts[i] = blob
    return rebuild(data, parts)


def refused_leaving_base(data: bytes, old: dict[str, torch.Tensor]) -> None:
    """``data`` is refused as corrupt, by reading, decoding or applying it, and an apply that started leaves
    ``old`` as it was (all or nothing)."""
    with pytest.raises(CorruptPatchError):
        patch = Patch.from_bytes(data)
        list(patch.changes(old))
        work = {k: v.clone() for k, v in old.items()}
        try:
            apply_patch(work, patch, FingerprintTable.of(work), verify="digest")
        except CorruptPatchError:
            assert all(same_bits(work[k], old[k]) for k in old)
            raise
