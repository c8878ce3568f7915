"""Drive the flipsync checkpoint engine through verl's own classes; run with the verl venv's Python.

``python verl_check.py WORKDIR`` prints one ``RESULT {json}`` line (tests/integrations/test_verl.py reads it).

What is verl's and what stands in for hardware this machine lacks:

- the weights are what verl's FSDP engine exports: `FSDPEngine.get_per_tensor_param()` (its state-dict walk,
  HF key conversion and MoE unfusing) and, for ``delta_sharded``, `get_per_tensor_param_shard()` /
  `prime_delta_snapshots()` / `get_per_tensor_param_delta_shard()` (its bf16 shard diff), on a bare
  `FSDPEngine` over a tiny Llama. verl has no CPU platform, so the engine's device helpers
  (`get_device_id`, the GPU memory log, the FSDP GPU load) are replaced by CPU ones;
- both checkpoint engines come from `CheckpointEngineRegistry.new`; ``flipsync`` is driven exactly as
  `CheckpointEngineManager.update_weights` does (prepare, build_topology, init_process_group, send on every
  actor rank, receive on each rollout worker, finalize);
- the rollout side applies what flipsync yields: ``named_tensors`` into a dict, ``delta_flush`` through
  verl's own SGLang loader `delta_loader.apply_delta` (its checksum, its NaN-masked copy) onto a module
  whose ``load_weights`` copies by name, as SGLang's does for unfused names;
- ``delta_sharded`` imports cupy (NCCL staging) at load: a stand-in module is put in ``sys.modules``; its
  transport (`_publish_flush` etc.: zmq + NCCL broadcasts from CUDA) is replaced by a capture of the flush
  objects verl built, whose bytes (int32 positions + raw values, and the JSON spec the zmq side channel
  carries) are what it would send.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

T0 = time.perf_counter()
_cupy = types.ModuleType("cupy")
_cupy.ndarray = type("ndarray", (), {})  # type: ignore[attr-defined]  # only named in annotations at import
sys.modules.setdefault("cupy", _cupy)

import verl.workers.engine.fsdp.transformer_impl as fsdp_impl  # noqa: E402
from verl.checkpoint_engine import CheckpointEngineRegistry  # noqa: E402
from verl.checkpoint_engine.delta_checkpoint_engine import DeltaShardedCheckpointEngine  # noqa: E402
from verl.workers.rollout.sglang_rollout import delta_loader  # noqa: E402

import flipsync.integrations.verl as fv  # noqa: E402  (registers "flipsync")
from flipsync.board import BoardReader, open_store  # noqa: E402
from flipsync.codec.bits import int_view  # noqa: E402
from flipsync.formats import served_view  # noqa: E402

IMPORT_S = time.perf_counter() - T0
fsdp_impl.get_device_id = lambda: "cpu"
fsdp_impl.log_gpu_memory_usage = lambda *a, **k: None
fsdp_impl.load_fsdp_model_to_gpu = lambda *a, **k: None
fsdp_impl.offload_fsdp_model_to_cpu = lambda *a, **k: None

STEPS = 3
LR = 1e-6


def tiny_llama(seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def fsdp_engine(model: torch.nn.Module) -> Any:
    """verl's FSDP engine around ``model`` without its process groups (one rank, CPU)."""
    e = fsdp_impl.FSDPEngine.__new__(fsdp_impl.FSDPEngine)
    e.module = model
    e._uses_fsdp2_cpu_offload_policy = False
    e._is_offload_param = False
    e._qat_enabled = False
    e.delta_pin_snapshots = False
    e.model_config = SimpleNamespace(lora={}, hf_config=model.config)
    return e


def bits_equal(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bits differ (integer views), or are missing / extra."""
    bad = sorted(set(want) ^ set(got))
    for k in set(want) & set(got):
        a, b = want[k].contiguous(), got[k].contiguous()
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(int_view(a), int_view(b)):
            bad.append(k)
    return sorted(bad)


class LoadByName(torch.nn.Module):
    """What an SGLang model's ``load_weights`` does for unfused names: ``param.copy_(loaded)`` by name."""

    def __init__(self, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> None:
        super().__init__()
        self.held = {k: torch.zeros(s, dtype=d) for k, (s, d) in shapes.items()}
        self.loads = 0

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            self.held[name].copy_(t)
            self.loads += 1


class Captured:
    """delta_sharded's transport replaced by a record of the flushes it built (see the module doc)."""

    def __init__(self) -> None:
        self.payload = 0  # int32 positions + raw values
        self.spec = 0  # the JSON spec per flush (the zmq side channel's content)
        self.changed = 0
        self.flushes = 0

    def flush(self, flush: Any, first: bool, is_last: bool) -> None:
        self.payload += int(flush.wire_bytes)
        self.changed += int(flush.nnz)
        spec = {"encoding": "indices", "params": [vars(p) for p in flush.params], "checksum": int(flush.checksum)}
        self.spec += len(json.dumps(spec))
        self.flushes += 1

    def values_flush(self, params: list[Any], values: torch.Tensor, is_last: bool, verify: bool = False) -> None:
        self.payload += int(values.nbytes)
        self.spec += len(json.dumps({"encoding": "dense", "params": [vars(p) for p in params]}))
        self.flushes += 1


def delta_sharded(bucket: int) -> tuple[Any, Captured]:
    e = CheckpointEngineRegistry.new("delta_sharded", bucket_size=bucket, is_master=False)
    assert isinstance(e, DeltaShardedCheckpointEngine)
    e.is_master, e.rank = True, 0  # rank 0 without its zmq server (it only publishes, through the capture)
    cap = Captured()
    e._publish_flush = cap.flush
    e._publish_values_flush = cap.values_flush
    e._publish_terminal = lambda first: None
    e._release_staging_pool = lambda phase: None
    return e, cap


def manager_round(trainer: list[Any], rollouts: list[Any]) -> None:
    """What CheckpointEngineManager.build_process_group does, for our backend's class."""
    meta = [e.prepare() for e in trainer + rollouts]
    actor_kw, rollout_kw = fv.FlipsyncCheckpointEngine.build_topology(len(trainer), len(rollouts), meta)
    for e, i in zip(trainer, range(len(trainer)), strict=True):
        e.init_process_group(**{k: v[i] for k, v in actor_kw.items()})
    for e, i in zip(rollouts, range(len(rollouts)), strict=True):
        e.init_process_group(**{k: v[i] for k, v in rollout_kw.items()})


def main(work: Path) -> dict[str, Any]:
    checks: dict[str, bool] = {}
    timings: dict[str, float] = {"import_s": round(IMPORT_S, 2)}
    board = work / "board"
    kw = {"board": str(board), "run": "verl-check", "format": "bf16", "bucket_size": 1 << 20}
    checks["registered"] = CheckpointEngineRegistry.get("flipsync") is fv.FlipsyncCheckpointEngine
    actor0 = CheckpointEngineRegistry.new("flipsync", is_master=True, **kw)
    actor1 = CheckpointEngineRegistry.new("flipsync", is_master=False, **kw)  # walks the generator only
    named = CheckpointEngineRegistry.new("flipsync", **kw)
    flush = CheckpointEngineRegistry.new("flipsync", wire_format="delta_flush", **kw)
    checks["wire_formats"] = (named.wire_format, flush.wire_format) == ("named_tensors", "delta_flush")

    model = tiny_llama()
    engine = fsdp_engine(model)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    ds, cap = delta_sharded(1 << 20)
    served_named: dict[str, torch.Tensor] = {}
    loader_model: LoadByName | None = None
    rows = []
    prev: dict[str, torch.Tensor] | None = None
    for g in range(STEPS + 1):
        if g:  # a real Adam step on random tokens
            x = torch.randint(0, 512, (4, 32), generator=torch.Generator().manual_seed(g))
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        want = {k: v.contiguous() for k, v in served_view(dict(engine.get_per_tensor_param()[0]), "bf16").items()}
        manager_round([actor0, actor1], [named, flush])
        t = time.perf_counter()
        metrics = asyncio.run(actor0.send_weights(engine.get_per_tensor_param()[0], global_steps=g))
        asyncio.run(actor1.send_weights(engine.get_per_tensor_param()[0], global_steps=g))
        timings[f"send_{g}_s"] = round(time.perf_counter() - t, 3)
        # named_tensors: the first sync every tensor, then the changed ones whole
        down0 = named._replica.follower.bytes_downloaded if named._replica else 0
        got = list(named.receive_weights(global_steps=g))
        down = named._replica.follower.bytes_downloaded - down0
        served_named.update({k: v.clone() for k, v in got})
        checks[f"named_bitwise_{g}"] = not bits_equal(want, served_named)
        # delta_flush: applied by verl's own SGLang loader
        flushes = list(flush.receive_weights(global_steps=g))
        if loader_model is None:
            loader_model = LoadByName({k: (v.shape, v.dtype) for k, v in want.items()})
        checks[f"flush_last_{g}"] = not flushes or (flushes[-1][1] and not any(last for _, last in flushes[:-1]))
        for tensors, _last in flushes:
            delta_loader.apply_delta(loader_model, tensors)
        checks[f"delta_flush_bitwise_{g}"] = not bits_equal(want, loader_model.held)
        for e in (actor0, actor1, named, flush):
            e.finalize()
        # verl's delta_sharded on the same weights at the same step
        before = (cap.payload, cap.spec, cap.changed)
        ds_metrics = asyncio.run(ds.send_weights(engine, global_steps=g)) or {}
        after = (cap.payload, cap.spec, cap.changed)
        ds_payload, ds_spec, ds_changed = (a - b for a, b in zip(after, before, strict=True))
        reader = BoardReader(open_store(board), "verl-check")
        m = reader.catalog.version(int(metrics["checkpoint_engine/flipsync_version"]))
        manifest_bytes = len(open_store(board).get(reader.catalog.layout.version_manifest(m.version)))
        if prev is None:
            changed = sum(v.numel() for v in want.values())
            moved = set(want)
        else:  # counted here from the two served views, not taken from either engine
            diffs = {k: int((int_view(want[k]) != int_view(prev[k])).sum()) for k in want}
            changed = sum(diffs.values())
            moved = {k for k, n in diffs.items() if n}
        checks[f"step_recorded_{g}"] = m.meta.get("step") == g and m.meta.get(fv.VERL_STEP_KEY) == g
        checks[f"named_yields_changed_only_{g}"] = {k for k, _ in got} == moved
        if prev is not None:
            checks[f"same_changes_{g}"] = (
                ds_changed == changed == int(metrics["checkpoint_engine/changed_elems"])
                and int(ds_metrics.get("checkpoint_engine/changed_elems", 0)) == changed
            )
        prev = want
        rows.append(
            {
                "step": g,
                "kind": m.kind.value,
                "changed": changed,
                "flipsync_bytes": down,
                "flipsync_manifest_bytes": manifest_bytes,
                "delta_sharded_bytes": ds_payload,
                "delta_sharded_spec_bytes": ds_spec,
                "named_tensors_yielded": len(got),
                "delta_flushes": len(flushes),
            }
        )
    checks["one_version_per_sync"] = BoardReader(open_store(board), "verl-check").head() == STEPS
    elements = sum(v.numel() for v in want.values())
    timings["total_s"] = round(time.perf_counter() - T0, 2)
    return {"checks": checks, "rows": rows, "elements": elements, "lr": LR, "timings": timings}


if __name__ == "__main__":
    out = main(Path(sys.argv[1]))
    print("RESULT " + json.dumps(out), flush=True)
