"""The peers' encodings as they ship (`flipsync_apps.bench.peers`): each decodes back bit for bit, on any view, and
writes the layout its system writes."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flipsync_apps.bench import peers
from tests.strategies import edit, random_tensor, same_bits, view_pairs

PEER = {p.key: p for p in peers.PEERS}


def _roundtrip(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, peers.PeerResult]:
    results = peers.measure(old, new)  # raises PeerMismatch if any applicable peer does not decode bitwise
    for key, r in results.items():
        if r.bytes is not None:
            assert r.verified is True and r.bytes > 0
            back = PEER[key].decode(old, PEER[key].encode(old, new))
            assert all(same_bits(back[k], new[k]) for k in new), key
    return results


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(view_pairs())
def test_every_peer_round_trips_any_view(pair: tuple[dict, dict]) -> None:
    old, new = pair
    results = _roundtrip(old, new)
    changed = any(not same_bits(old[k], new[k]) for k in old)
    # the byte-diff peers apply to every view that changed; TRL only where every tensor is bf16
    assert (results["slime_xor"].bytes is not None) == changed
    assert (results["vllm_sparse"].bytes is not None) == changed
    if changed and any(t.dtype != torch.bfloat16 for t in new.values()):
        assert results["trl_gap_delta"].bytes is None


@st.composite
def bf16_pairs(draw: st.DrawFn) -> tuple[dict, dict]:
    """BF16 views with every bit pattern possible (+-0, subnormals, inf, NaN payloads, max) and any edit."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    old, new = {}, {}
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=2)))
        t = random_tensor(rng, torch.bfloat16, shape)
        edges = torch.tensor([0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0x7F7F], dtype=torch.int32)
        flat = t.reshape(-1).view(torch.int16)
        k = min(flat.numel(), edges.numel())
        flat[:k] = edges[:k].to(torch.int16)
        old[f"l{i}.weight"] = t
        frac = draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
        new[f"l{i}.weight"] = edit(rng, t, frac, style=draw(st.sampled_from(["ulp", "bits", "runs"])))
    return old, new


@settings(max_examples=60, deadline=None)
@given(bf16_pairs())
def test_bf16_views_round_trip_through_every_peer(pair: tuple[dict, dict]) -> None:
    old, new = pair
    results = _roundtrip(old, new)
    if any(not same_bits(old[k], new[k]) for k in old):
        assert all(r.bytes is not None for r in results.values())  # every peer applies to a bf16 view


def test_gaps_fall_back_to_uint32_where_one_does_not_fit() -> None:
    old = {"w": torch.zeros(70_000, dtype=torch.bfloat16), "b": torch.zeros(8, dtype=torch.bfloat16)}
    new = {k: v.clone() for k, v in old.items()}
    new["w"][[0, 69_999]] = 1.0  # a gap of 69,998 > 65,535
    new["b"][3] = 2.0
    _roundtrip(old, new)
    trl = safetensors.torch.load(PEER["trl_gap_delta"].encode(old, new))
    assert trl["w.idx"].dtype == torch.uint32 and trl["b.idx"].dtype == torch.uint16
    blob = zstandard.ZstdDecompressor().decompress(PEER["slime_deltas_zstd"].encode(old, new))
    params = {p["name"]: p for p in json.loads(peers._st_metadata(blob)["params"])}
    assert params["w"]["pos_width"] == 4 and params["b"]["pos_width"] == 2
    assert params["w"]["pos_end"] - params["w"]["pos_start"] == 8  # two uint32 gaps


def test_slime_layouts() -> None:
    old = {"a": torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16), "same": torch.ones(4, dtype=torch.bfloat16)}
    new = {"a": old["a"].clone(), "same": old["same"].clone()}
    new["a"].view(torch.int16)[1] += 1  # one ulp: one byte of the tensor changes
    for encoding in ("xor", "overwrite"):
        blob, index = PEER[f"slime_{encoding}"].encode(old, new)
        meta = json.loads(index)
        assert meta["metadata"] == {
            "version": "000001",
            "base_version": "000000",
            "delta_encoding": encoding,
            "compression_format": "zstd",
            "checksum_format": "xxh3-128",
        }
        assert meta["weight_map"] == {"a": peers.SLIME_SHARD}  # unchanged tensors are left out
        digests = peers._st_metadata(blob)
        assert set(digests) == {"a"} and len(digests["a"]) == 32
        (comp,) = safetensors.numpy.load(blob).values()
        raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(comp.tobytes()), np.uint8)
        if encoding == "xor":
            assert raw.size == 6 and np.count_nonzero(raw) == 1  # the XOR of all 6 bytes
        else:  # u4 count, u4 positions of the changed bytes, the new bytes
            assert raw[:4].view("<u4")[0] == 1 and raw[4:8].view("<u4")[0] == 2 and raw.size == 9
            assert raw[8] == new["a"].view(torch.uint8)[2].item()


def test_index_and_value_layouts() -> None:
    old = {"w": torch.zeros(4, 5, dtype=torch.bfloat16), "s": torch.zeros(3, dtype=torch.float32)}
    new = {k: v.clone() for k, v in old.items()}
    new["w"][1, 2] = 1.0
    new["w"][3, 4] = -2.0
    new["s"][0] = 0.5
    wire = PEER["vllm_sparse"].encode(old, new)
    info = json.loads(wire.info)
    assert info == {
        "names": ["w", "s"],
        "dtype_names": ["bfloat16", "float32"],
        "shapes": [[4, 5], [3]],
        "num_updates_list": [2, 1],
    }
    assert np.frombuffer(wire.buffers[0][0], np.int32).tolist() == [7, 19]
    assert PEER["vllm_sparse"].size(wire) == len(wire.info) + 2 * (4 + 2) + (4 + 4)
    # verl: one flush needs one value dtype; a bf16-only view has one
    assert PEER["verl_delta_sharded"].encode(old, new) is None
    bf = {"w": old["w"]}
    flush = PEER["verl_delta_sharded"].encode(bf, {"w": new["w"]})
    meta = pickle.loads(flush.meta)
    assert meta["encoding"] == "indices" and meta["val_dtype"] == "bfloat16" and meta["pos_numel"] == 8
    assert meta["spec"]["params"][0]["pos_width"] == 4
    # TRL: every parameter, changed or not, and values always bf16
    both = {"w": old["w"], "z": torch.zeros(2, dtype=torch.bfloat16)}
    trl = safetensors.torch.load(PEER["trl_raw"].encode(both, {"w": new["w"], "z": both["z"]}))
    assert set(trl) == {"w.idx", "w.val", "z.idx", "z.val"} and trl["w.idx"].dtype == torch.int32
    assert trl["z.idx"].numel() == 0 and trl["w.val"].dtype == torch.bfloat16


def test_nothing_changed_is_nothing_to_send() -> None:
    view = {"w": torch.randn(10).to(torch.bfloat16)}
    for r in peers.measure(view, {"w": view["w"].clone()}).values():
        assert r.bytes is None


def test_a_wrong_decode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    old = {"w": torch.zeros(4, dtype=torch.bfloat16)}
    new = {"w": torch.ones(4, dtype=torch.bfloat16)}
    broken = peers.Peer("broken", "broken", peers._vllm_encode, lambda o, w: dict(o), peers._broadcast_size)
    monkeypatch.setattr(peers, "PEERS", (broken,))
    with pytest.raises(peers.PeerMismatch, match="broken"):
        peers.measure(old, new)


VLLM_PYTHON = os.environ.get("FLIPSYNC_VLLM_PYTHON", "")

CHECK = """
import json, sys, torch
from vllm.distributed.weight_transfer.sparse_nccl_engine import (
    SparseNCCLTrainerWeightTransferEngine, SparseNCCLWeightTransferUpdateInfo, SparseWeightPatch)
from flipsync_apps.bench import peers
old = {"w": torch.zeros(6, 7, dtype=torch.bfloat16), "s": torch.zeros(3)}
new = {k: v.clone() for k, v in old.items()}
new["w"][2, 3] = 1.0; new["s"][1] = 4.0
wire = peers._vllm_encode(old, new)
info = SparseNCCLWeightTransferUpdateInfo(**json.loads(wire.info))  # vLLM's own validation
for name, shape, dt, (ib, vb) in zip(info.names, info.shapes, info.dtype_names, wire.buffers):
    patch = SparseWeightPatch(name, torch.frombuffer(bytearray(ib), dtype=torch.int32),
                              torch.frombuffer(bytearray(vb), dtype=getattr(torch, dt)), tuple(shape))
    SparseNCCLTrainerWeightTransferEngine._validate_patch(patch)
print("RESULT ok")
"""


@pytest.mark.skipif(not VLLM_PYTHON, reason="set FLIPSYNC_VLLM_PYTHON to check against vLLM's own dataclasses")
def test_vllm_sparse_layout_passes_vllms_own_checks() -> None:
    root = Path(__file__).resolve().parents[3]  # the vLLM venv holds the library; the applications come from here
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "src"), str(root / "apps" / "src")]))
    iomp = Path(VLLM_PYTHON).parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    proc = subprocess.run([VLLM_PYTHON, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert "RESULT ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
