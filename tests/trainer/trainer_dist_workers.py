"""Code that runs inside the spawned ranks of the sharded tests (two processes, gloo, loopback only).

Each function is a ``torch.multiprocessing`` entry point ``fn(rank, world, init_file, board, out_dir)``.
Ranks write what the parent checks (the expected served views, the errors they saw) under ``out_dir``.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

TIMEOUT_S = 30.0


def _no_keyframes() -> Any:
    from flipsync.board import KeyframePolicy

    return KeyframePolicy(chain_fraction=1e9, max_interval=10_000)  # replicas then follow patches


def init(rank: int, world: int, init_file: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S)
    )


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """The ranks' model: a larger tiny Llama (two layers, four heads)."""
    from trainer_helpers import tiny_llama as build

    more = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    return build(seed, hidden=64, layers=2, vocab=128, intermediate_size=96, **more)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 128, (2, 12), generator=g)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def expected_view(model: torch.nn.Module, fmt: str) -> dict[str, torch.Tensor] | None:
    """The full served view computed the plain way (rank 0), for the parent to compare with a replica."""
    from flipsync.formats import served_view

    full: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        full[k] = v.full_tensor() if hasattr(v, "full_tensor") else v  # a collective for DTensors
    full.pop("lm_head.weight")  # tied to model.embed_tokens.weight
    if dist.get_rank() != 0:
        return None
    return {k: v.contiguous() for k, v in served_view(full, fmt).items()}


def _save(out_dir: str, name: str, view: dict[str, torch.Tensor] | None) -> None:
    if view is not None:
        save_file(view, str(Path(out_dir) / f"{name}.safetensors"))


def _note(out_dir: str, rank: int, what: str, value: Any) -> None:
    path = Path(out_dir) / f"notes-{rank}.json"
    notes = json.loads(path.read_text()) if path.exists() else {}
    notes[what] = value
    path.write_text(json.dumps(notes))


def scenarios(rank: int, world: int, init_file: str, board: str, out_dir: str) -> None:
    """Every sharded scenario in one pair of processes (spawning costs seconds): see the test module."""
    init(rank, world, init_file)
    fsdp_and_ddp(rank, out_dir, board)
    dying_rank(rank, out_dir, board)  # last: rank 1 does not come back from it


def fsdp_and_ddp(rank: int, out_dir: str, board: str) -> None:
    """FSDP2 bf16 (row-shard pieces), FSDP2 fp8-tensor (gathered + pieces), DDP-style replicas, a NaN step."""
    from torch.distributed.fsdp import fully_shard

    from flipsync.errors import BoardError, NonFiniteError
    from flipsync.trainer import Publisher, PublisherConfig

    for fmt, run in (("bf16", "fsdp-bf16"), ("fp8-tensor", "fsdp-fp8")):
        model = tiny_llama()
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        with Publisher(
            model,
            board,
            run=run,
            format=fmt,
            optimizer=opt,
            config=PublisherConfig(timeout_s=TIMEOUT_S, keyframe_policy=_no_keyframes()),
        ) as pub:
            for step in range(3):
                train_step(model, opt, step)
                pub.flush()  # one version per step here (a loaded machine would squash them otherwise)
            if fmt == "bf16":
                # A non-finite weight in rank 1's shard: that step is skipped on every rank.
                pub.flush()  # the last step's view is done before weights change outside the optimizer
                w = model.model.layers[0].mlp.up_proj.weight
                saved = w.to_local().clone()
                if rank == 1:
                    with torch.no_grad():
                        w.to_local()[0, 0] = float("nan")
                try:
                    pub.step()
                    pub.flush()
                except NonFiniteError as e:
                    _note(out_dir, rank, "nan", f"NonFiniteError: {e}")
                except BoardError as e:
                    _note(out_dir, rank, "nan", f"BoardError: {e}")
                if rank == 0:  # rank 0 learns it from the next call
                    try:
                        pub.flush()
                    except BoardError as e:
                        _note(out_dir, rank, "nan", f"BoardError: {e}")
                with torch.no_grad():
                    w.to_local().copy_(saved)
                train_step(model, opt, 3)
            pub.flush()
            _note(out_dir, rank, run, pub.stats.head)
        _save(out_dir, run, expected_view(model, fmt))

    # DDP-style: every rank holds the whole model; tensors are split between ranks by size.
    model = tiny_llama()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    with Publisher(
        model,
        board,
        run="ddp-nvfp4",
        format="nvfp4",
        optimizer=opt,
        config=PublisherConfig(timeout_s=TIMEOUT_S, keyframe_policy=_no_keyframes()),
    ) as pub:
        for step in range(3):
            g = torch.Generator().manual_seed(step * 2 + rank)
            x = torch.randint(0, 128, (2, 12), generator=g)
            ddp(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
            pub.flush()
        pub.flush()
        _note(out_dir, rank, "ddp-nvfp4", pub.stats.head)
    _save(out_dir, "ddp-nvfp4", expected_view(model, "nvfp4"))


class DyingStore:
    """A store that kills its process when asked to upload a patch part of ``version``."""

    def __init__(self, inner: Any, version: int) -> None:
        self._inner = inner
        self._marker = f"/{version:012d}/"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def put(self, path: str, data: bytes, *, create_only: bool = False) -> None:
        if self._marker in path and "patch-" in path:
            os._exit(17)  # dies mid-version, after diffing, before its part is durable
        self._inner.put(path, data, create_only=create_only)


def dying_rank(rank: int, out_dir: str, board: str) -> None:
    """Rank 1 dies while uploading its part of v3; rank 0 must fail cleanly without publishing v3."""
    from torch.distributed.fsdp import fully_shard

    from flipsync.board import open_store
    from flipsync.errors import BoardError
    from flipsync.stores import Store
    from flipsync.trainer import Publisher, PublisherConfig

    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    store: Store = open_store(board)
    if rank == 1:
        store = DyingStore(store, 3)  # type: ignore[assignment]
    pub = Publisher(model, store, run="dying", optimizer=opt, config=PublisherConfig(timeout_s=8.0, background=False))
    try:
        for step in range(4):
            train_step(model, opt, step)
    except BoardError as e:
        _note(out_dir, rank, "error", str(e))
        _note(out_dir, rank, "head", pub.stats.head)
    os._exit(0)  # the process group is broken; skip its teardown


def run_ranks(fn: Any, world: int, workdir: Path, timeout_s: float) -> list[int | None]:
    """Run ``fn`` on ``world`` spawned processes; exit codes by rank (None: killed after the timeout)."""
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    args = (world, str(workdir / "init"), str(workdir / "board"), str(workdir))
    procs = [ctx.Process(target=fn, args=(rank, *args), daemon=True) for rank in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    codes: list[int | None] = []
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
            codes.append(None)
        else:
            codes.append(p.exitcode)
    return codes
