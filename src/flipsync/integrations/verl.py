"""flipsync as a verl checkpoint engine (``checkpoint_engine.backend=flipsync``): the actor publishes each weight
sync to a board and the rollout workers follow it, with no network path between them (docs/integrations/verl.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any

import httpx
import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry

from flipsync.errors import BoardError, ConfigError
from flipsync.integrations.named import HostReplica, StepPublisher
from flipsync.stores import StoreOptions
from flipsync.trainer import PublisherConfig

log = logging.getLogger(__name__)

BACKEND = "flipsync"
WIRE_FORMATS = ("named_tensors", "delta_flush")
# Names PEFT gives adapter tensors: verl yields them (and renamed base weights) when LoRA is not merged.
LORA_MARKERS = (".lora_A.", ".lora_B.", ".lora_embedding_A", ".lora_embedding_B", ".lora_magnitude_vector")
# verl's delta receivers densify each entry with an int64 index transient: its sender caps entries at this.
MAX_ENTRY_ELEMS = 64 << 20
# verl's delta wire marks unchanged positions with NaN, so it carries only float dtypes that have NaN.
DELTA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
VERL_STEP_KEY = "verl_global_steps"
MAX_SIDECAR_WAIT_S = 300.0  # the sidecar's long poll takes at most this per request


def refuse_layout(name: str, tensor: Any, seen: set[str]) -> None:
    """ConfigError for what a flipsync version cannot hold as verl yields it (see the module doc)."""
    if any(m in name for m in LORA_MARKERS) or ".base_layer." in name:
        raise ConfigError(
            f"verl sent the LoRA adapter tensor {name!r}: flipsync publishes full served weights. Set "
            "actor_rollout_ref.model.lora.merge=True so that verl merges the adapters before the sync"
        )
    if type(tensor).__name__ == "DTensor":
        raise ConfigError(
            f"verl sent {name!r} as a DTensor shard; the flipsync checkpoint engine takes whole tensors, as "
            "verl's get_per_tensor_param() yields them (FSDP full_tensor(), Megatron-Bridge export)"
        )
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"verl sent {name!r} as {type(tensor).__name__}, not a tensor")
    if name in seen:
        raise ConfigError(
            f"verl's export yields {name!r} twice (two source parameters mapped to one HF tensor); a version "
            "holds each tensor once"
        )
    seen.add(name)


async def walk(weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator[tuple[str, torch.Tensor]]) -> Any:
    """Iterate a sync or async generator of ``(name, tensor)`` (verl hands either)."""
    if hasattr(weights, "__aiter__"):
        async for item in weights:  # type: ignore[union-attr]
            yield item
    else:
        for item in weights:  # type: ignore[union-attr]
            yield item


# -- verl's delta wire -------------------------------------------------------------------------------------


def delta_checksum(positions: torch.Tensor, values: torch.Tensor) -> int:
    """The flush checksum verl's delta receivers recompute: an XOR-reduce hash of each blob, combined."""
    p = int(torch.hash_tensor(positions).item()) if positions.numel() else 0
    v = int(torch.hash_tensor(values).item()) if values.numel() else 0
    return p ^ (v << 1)


# One entry of a flush: name, tensor, flat positions (int32; None in a dense seed), values.
_Piece = tuple[str, torch.Tensor, torch.Tensor | None, torch.Tensor]


def delta_flushes(
    tensors: Mapping[str, torch.Tensor],
    changed: Mapping[str, torch.Tensor] | None,
    bucket_bytes: int,
    device: str | torch.device = "cpu",
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """``(named_tensors, is_last)`` flushes in verl's delta wire (what its ``delta_flush`` adapters apply).

    ``changed`` None: a dense seed (every tensor's values, no positions); else for each changed tensor its
    flat positions as int32 and the new values, in entries of at most `MAX_ENTRY_ELEMS`. A flush holds one
    dtype and about ``bucket_bytes``; nothing is yielded when nothing changed.
    """
    bad = [(n, t.dtype) for n, t in tensors.items() if t.dtype not in DELTA_DTYPES]
    if bad:
        raise ConfigError(
            f"wire_format=delta_flush cannot carry {bad[0][0]!r} ({bad[0][1]}, and {len(bad) - 1} more): verl's "
            "delta wire marks unchanged values with NaN, so it holds bf16 / fp16 / fp32 tensors only. Use "
            "wire_format=named_tensors for this served format"
        )
    by_dtype: dict[torch.dtype, list[_Piece]] = {}
    for name, t in tensors.items():
        flat = t.reshape(-1)
        if changed is None:
            by_dtype.setdefault(t.dtype, []).append((name, t, None, flat))
            continue
        pos = changed.get(name)
        if pos is None or not pos.numel():
            continue
        if flat.numel() >= 1 << 31:
            raise ConfigError(f"{name!r} has {flat.numel()} elements: verl's delta wire positions are int32")
        for s in range(0, pos.numel(), MAX_ENTRY_ELEMS):
            p = pos[s : s + MAX_ENTRY_ELEMS]
            by_dtype.setdefault(t.dtype, []).append((name, t, p.to(torch.int32), flat[p]))
    flushes: list[list[_Piece]] = []
    for group in by_dtype.values():  # every group holds a piece
        flushes.append([])
        size = 0
        for piece in group:
            nbytes = piece[3].numel() * piece[3].element_size() + (4 * piece[2].numel() if piece[2] is not None else 0)
            if flushes[-1] and size + nbytes > bucket_bytes:
                flushes.append([])
                size = 0
            flushes[-1].append(piece)
            size += nbytes
    for i, flush in enumerate(flushes):
        last = i == len(flushes) - 1
        yield _flush(flush, changed is None, is_last=last, device=device), last


def _flush(
    pieces: list[_Piece], dense: bool, *, is_last: bool, device: str | torch.device
) -> list[tuple[str, torch.Tensor]]:
    params: list[dict[str, Any]] = []
    pos_off = val_off = 0
    for name, t, pos, vals in pieces:
        n = vals.numel()
        pos_bytes = 0 if pos is None else 4 * n
        params.append(
            {
                "name": name,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "pos_start": pos_off,
                "pos_end": pos_off + pos_bytes,
                "pos_width": 4,
                "val_start": val_off,
                "val_end": val_off + n,
            }
        )
        pos_off += pos_bytes
        val_off += n
    values = torch.cat([v for _, _, _, v in pieces]).contiguous()
    if dense:
        positions = torch.empty(0, dtype=torch.uint8)
        spec: dict[str, Any] = {"encoding": "dense", "verify": False, "is_last": is_last, "params": params}
    else:
        positions = torch.cat([p for _, _, p, _ in pieces if p is not None]).contiguous().view(torch.uint8)
        spec = {"encoding": "indices", "params": params}
    spec["checksum"] = delta_checksum(positions, values)
    spec_t = torch.frombuffer(bytearray(json.dumps(spec).encode()), dtype=torch.uint8)
    named = [("__delta_spec__", spec_t.to(device)), ("__values__", values.to(device))]
    if not dense:
        named.insert(1, ("__positions__", positions.to(device)))
    return named


# -- the checkpoint engine ---------------------------------------------------------------------------------


@CheckpointEngineRegistry.register(BACKEND)
class FlipsyncCheckpointEngine(CheckpointEngine):
    """verl checkpoint engine over a flipsync board.

    verl builds it on every actor rank (``is_master`` on rank 0) and every rollout worker, with
    ``bucket_size`` (bytes) and the ``engine_kwargs.flipsync`` options (docs/integrations/verl.md lists them).
    """

    wire_format = "named_tensors"

    def __init__(
        self,
        bucket_size: int = 512 << 20,
        is_master: bool = False,
        *,
        board: str | None = None,
        run: str | None = None,
        format: str = "bf16",
        wire_format: str = "named_tensors",
        changed_only: bool = True,
        sidecar: str | None = None,
        resume: bool = False,
        new_weights: bool = False,
        timeout_s: float = 600.0,
        device: str | None = None,
        publisher: Mapping[str, Any] | None = None,
        store_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not board:
            raise ConfigError(
                "the flipsync checkpoint engine needs a board: set "
                "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.flipsync.board=URL"
            )
        if not run:
            raise ConfigError(
                "the flipsync checkpoint engine needs a run name shared by trainer and rollout: set "
                "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.flipsync.run=NAME"
            )
        if wire_format not in WIRE_FORMATS:
            raise ConfigError(f"wire_format must be one of {', '.join(WIRE_FORMATS)}, not {wire_format!r}")
        if timeout_s <= 0:
            raise ConfigError("timeout_s must be positive")
        self.bucket_size = int(bucket_size) or 512 << 20
        self.is_master = bool(is_master)
        self.board = str(board)
        self.run = str(run)
        self.format = format
        self.wire_format = wire_format
        self.changed_only = bool(changed_only)
        self.sidecar = str(sidecar).rstrip("/") if sidecar else None
        self.resume = bool(resume)
        self.new_weights = bool(new_weights)
        self.timeout_s = float(timeout_s)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.store_options = StoreOptions(**dict(store_options)) if store_options else None
        unknown = sorted(set(publisher or {}) - {f.name for f in dataclasses.fields(PublisherConfig)})
        if unknown:
            raise ConfigError(f"flipsync checkpoint engine: unknown publisher option(s) {', '.join(unknown)}")
        self.config = PublisherConfig(**(publisher or {}))
        if self.store_options is not None:
            self.config = dataclasses.replace(self.config, store_options=self.store_options)
        self._trainer: StepPublisher | None = None
        self._replica: HostReplica | None = None
        self.last_version: int | None = None  # the version the last send or receive ended on

    # -- topology: nothing but the board travels between the two sides ----------------------------------

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None  # the publisher and the host copy live on from one sync to the next

    # -- trainer side -------------------------------------------------------------------------------------

    async def send_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator[tuple[str, torch.Tensor]],
        global_steps: int | None = None,
    ) -> dict[str, float]:
        """Walk verl's weight generator (every actor rank: producing a tensor may be collective); on rank 0
        publish the tensors as the version of ``global_steps``. Returns the sync's metrics (rank 0)."""
        tensors: dict[str, torch.Tensor] = {}
        seen: set[str] = set()
        async for name, tensor in walk(weights):
            if not self.is_master:
                continue  # the others only keep verl's collectives in step
            refuse_layout(name, tensor, seen)
            tensors[name] = tensor.detach().to("cpu")
        if not self.is_master:
            return {}
        t0 = time.perf_counter()
        published = await asyncio.to_thread(self._publish, tensors, global_steps)
        self.last_version = published.version
        return {
            "checkpoint_engine/flipsync_version": float(published.version),
            "checkpoint_engine/payload_mbytes": published.part_bytes / (1 << 20),
            "checkpoint_engine/changed_elems": float(published.changed),
            "checkpoint_engine/publish_s": time.perf_counter() - t0,
        }

    def _publish(self, tensors: Mapping[str, torch.Tensor], global_steps: int | None) -> Any:
        if self._trainer is None:
            self._trainer = StepPublisher(
                self.board,
                run=self.run,
                format=self.format,
                resume=self.resume,
                new_weights=self.new_weights,
                step_key=VERL_STEP_KEY,
                config=self.config,
            )
        return self._trainer.publish(tensors, global_steps)

    # -- rollout side -------------------------------------------------------------------------------------

    def receive_weights(self, global_steps: int | None = None) -> Iterator[Any]:  # type: ignore[override]
        """The weights of the version holding ``global_steps``, as ``wire_format`` says (see the class doc).

        A generator, as verl's server adapters consume it; it waits for the version when first advanced.
        """
        if self._replica is None:
            self._replica = HostReplica(self.board, run=self.run, store_options=self.store_options)
        replica = self._replica
        version = replica.version_for_step(global_steps, self.timeout_s)
        if self.sidecar is not None:
            self._wait_sidecar(version)
            self.last_version = version
            return
        caught = replica.sync(version)
        self.last_version = caught.version
        changed = caught.changed if self.changed_only or self.wire_format == "delta_flush" else None
        log.info("flipsync: verl step %s is v%d (%s)", global_steps, caught.version, "whole" if changed is None
                 else f"{len(changed)} tensors changed")  # fmt: skip
        if self.wire_format == "delta_flush":
            yield from delta_flushes(replica.tensors, changed, self.bucket_size, self.device)
        else:
            for name, t in replica.tensors.items():
                if changed is None or name in changed:  # every tensor, or the changed ones only, whole
                    yield name, t.to(self.device)

    def _wait_sidecar(self, version: int) -> None:
        """Block until the sidecar at ``self.sidecar`` serves ``version`` or newer (its long poll)."""
        deadline = time.monotonic() + self.timeout_s
        url = f"{self.sidecar}/flipsync/wait"
        with httpx.Client() as client:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BoardError(
                        f"the flipsync sidecar at {self.sidecar} did not serve v{version} within {self.timeout_s:g} s"
                    )
                wait = min(left, MAX_SIDECAR_WAIT_S)
                try:
                    r = client.get(url, params={"min_version": version, "timeout_s": wait}, timeout=wait + 10)
                except httpx.HTTPError as e:
                    log.warning("waiting for the sidecar at %s: %s", self.sidecar, e)
                    time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
                    continue
                if r.status_code == 200:
                    return
                if r.status_code != 408:
                    raise BoardError(f"the flipsync sidecar at {self.sidecar} answered {r.status_code}: {r.text[:200]}")
