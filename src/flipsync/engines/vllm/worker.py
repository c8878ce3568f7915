"""The ``vllm`` engine's half inside vLLM's workers: :class:`FlipsyncWorkerExtension` answers ``collective_rpc``;
:class:`WorkerCore` needs only a module with vLLM's ``load_weights`` contract. See docs/engines.md#vllm."""

from __future__ import annotations

import json
import logging
import os
import random
import time
import traceback
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from flipsync.codec.bits import DType, dtype_named, dtype_of
from flipsync.codec.fingerprint import fingerprint_of, fp_hex
from flipsync.engines.vllm.blockmap import (
    copy_blocks,
    exact_int_base,
    group_key,
    iter_chunks,
    read_as,
    read_bits,
    write_as,
    write_bits,
)
from flipsync.engines.vllm.kernel_audit import KernelAuditor
from flipsync.engines.vllm.kernels import DEFAULT_HOOKS, KernelHooks, storage_of, vllm_hooks
from flipsync.engines.vllm.map_learning import LiveParams, ParamInfo
from flipsync.engines.vllm.scratch import (
    Policy,
    ScratchFactory,
    default_policy,
    default_scratch,
    vllm_policy,
    vllm_scratch,
)
from flipsync.engines.vllm.wire import (
    AUDIT_EVERY,
    AUDIT_MODES,
    DEFAULT_MAX_UNDO,
    INPLACE,
    PROTOCOL,
    RELOAD,
    AuditError,
    BaseBitsError,
    StateUnknownError,
    WorkerOpError,
    b64,
    bits_digest,
    readback_digest,
    unb64,
)

log = logging.getLogger(__name__)
_INT64 = np.dtype(np.int64)  # positions' dtype unless a request says int32

# Reloads whole checkpoint tensors through the engine's own reload path (layerwise reprocessing).
Reloader = Callable[[list[tuple[str, torch.Tensor]]], None]


@dataclass
class UndoEntry:
    writes: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)  # param, positions, old bits
    modules: set[str] = field(default_factory=set)


class WorkerCore(KernelAuditor):
    """Learns the checkpoint-to-parameter map of one worker and applies, undoes and fingerprints writes."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        rank: int = 0,
        policy: Policy = default_policy,
        scratch: ScratchFactory = default_scratch,
        reloader: Reloader | None = None,
        default_source: Callable[[], Mapping[str, torch.Tensor] | None] | None = None,
        hooks: KernelHooks = DEFAULT_HOOKS,
    ) -> None:
        self.model = model
        self.rank = rank
        self.policy = policy
        self.scratch = scratch
        self.reloader = reloader
        self.default_source = default_source
        self.hooks = hooks
        self.specs: dict[str, tuple[tuple[int, ...], str]] = {}
        self.maps: dict[str, list[tuple[str, np.ndarray]]] = {}
        self.params: dict[str, ParamInfo] = {}
        self.host: dict[str, torch.Tensor] = {}  # model-format host copies of reload-mode parameters
        self.feeds: dict[str, set[str]] = {}  # module -> checkpoint tensors that load into it
        self.undo: OrderedDict[str, UndoEntry] = OrderedDict()
        self.max_undo = DEFAULT_MAX_UNDO
        self.attached = False
        self.audit = AUDIT_EVERY
        self.repair = True
        self.kinds: dict[str, str] = {}  # kind of layer -> whether the engine's reload of it is faithful
        self._opaque: dict[str, bool] = {}  # repaired kind -> whether its repair takes the twin's opaque state
        self.audit_s = 0.0  # time the last reload's audit took (twins built, compared)
        self.audited: list[str] = []  # the layers the last reload's audit compared
        self._dropped: set[str] = set()  # parameters the engine set to None after loading (model format known)
        self._probe_shapes: dict[str, tuple[tuple[int, ...], torch.dtype, torch.device]] = {}
        self._rng = random.Random(rank)
        self.holders: dict[str, set[str]] = {}  # parameter -> the other modules holding the same tensor
        self._fresh: dict[str, dict[str, torch.Tensor]] = {}  # module -> non-checkpoint tensors at attach
        self._cursor: dict[str, int] = {}  # kind -> position of ``sample``'s rotation through its layers
        self.rechecked: list[str] = []  # repaired layers the last reload compared with an independent twin

    # ------------------------------------------------------------------------------- attach
    def attach(
        self,
        specs: Mapping[str, tuple[Sequence[int], str]],
        source: Mapping[str, torch.Tensor] | None,
        *,
        audit: str = AUDIT_EVERY,
        repair: bool = True,
    ) -> dict:
        """Learn the map for every checkpoint tensor in ``specs``; capture host copies of reload parameters;
        audit the reload-mode layers against a fresh load of ``source`` (``audit``)."""
        if audit not in AUDIT_MODES:
            raise WorkerOpError(f"audit must be one of {', '.join(AUDIT_MODES)}, not {audit!r}")
        t0 = time.perf_counter()
        self.attached = False
        self.audit, self.repair = audit, repair
        self.kinds, self._opaque, self._cursor = {}, {}, {}
        self.specs = {n: (tuple(int(x) for x in s), str(d)) for n, (s, d) in specs.items()}
        with self._buffers_guard():
            return self._attach(source, t0)

    def _attach(self, source: Mapping[str, torch.Tensor] | None, t0: float) -> dict:
        self._find_dropped()
        live = self._live_params()
        owners = self._owners()
        modes: dict[str, ParamInfo] = {}
        for full, (mname, _mod, _pname, p) in live.items():
            if p is None:
                why = "dropped after loading (None): the kernel holds the values elsewhere (an opaque handle)"
                modes[full] = ParamInfo(full, mname, RELOAD, why, "", ())
                continue
            checks = [(om, *self.policy(om, omod, op, p)) for om, omod, op in owners[id(p)]]  # in place if all agree
            refused = [f"{om}: {why}" for om, ok, why in checks if not ok]
            mode, why = (RELOAD, refused[0]) if refused else (INPLACE, checks[-1][2])
            modes[full] = ParamInfo(full, mname, mode, why, "", tuple(p.shape))
        narrowest = min(
            (exact_int_base(p.dtype) for _, _, _, p in live.values() if p is not None and p.dtype.is_floating_point),
            default=1 << 30,
        )
        names: list[str] | set[str]  # the group's names here, the tensors fed into a parameter below
        maps: dict[str, list[tuple[str, np.ndarray]]] = {}
        unheld: dict[str, str] = {}
        for key, names in _grouped(sorted(self.specs)).items():
            members = {full for full in live if full.startswith(key + ".") or full == key}
            if not members:
                log.warning("no parameter under %r; probing %s against the whole model", key, names)
                members = set(live)
            try:
                got = self._probe_group(names, members, narrowest, unheld)
            except RuntimeError as e:
                if "more than one element" not in str(e) or members == set(live):
                    raise
                log.warning("loading %s wrote outside %r; probing against the whole model", names, key)
                got = self._probe_group(names, set(live), narrowest, unheld)
            maps.update(got)
        self.maps = maps
        # parameters that receive checkpoint data: their dtype and shape as loaded
        fed: dict[str, set[str]] = {}
        for name, places in maps.items():
            for pname, _ in places:
                fed.setdefault(pname, set()).add(name)
        self.params = {}
        self.feeds = {}
        for pname, names in fed.items():
            info = modes[pname]
            dtypes = {self.specs[n][1] for n in names}
            if len(dtypes) > 1:
                raise WorkerOpError(f"checkpoint tensors of several dtypes ({sorted(dtypes)}) load into {pname!r}")
            info.dtype = next(iter(dtypes))
            if not info.shape and pname in self._probe_shapes:
                info.shape = self._probe_shapes[pname][0]
            self.params[pname] = info
            self.feeds.setdefault(info.module, set()).update(names)
        # Blind spot 2: a tensor several modules hold (GLM's router bias: the gate and the fused experts) was
        # reloaded and audited in the first one only; every holder is now fed, reloaded and audited.
        self.holders = {}
        for pname in self.params:
            _mname, owner, _attr, p = live[pname]
            seen_modules = {id(owner)}  # one name per module object: vLLM registers some under two names
            others = set()
            for om, omod, _ in owners.get(id(p), []) if p is not None else []:
                if id(omod) not in seen_modules:
                    seen_modules.add(id(omod))
                    others.add(om)
            if others:
                self.holders[pname] = others
                for om in others:
                    self.feeds.setdefault(om, set()).update(fed[pname])
        self.host = {}
        if reload_names := self._reload_names():
            src = source if source is not None else (self.default_source() if self.default_source else None)
            if src is None:
                raise WorkerOpError(
                    f"{len(reload_names)} checkpoint tensors load into repacked parameters (reload mode) and "
                    "no source checkpoint was given to capture their values; pass 'source' (a checkpoint path)"
                )
            self._capture(src)
        self._snapshot_fresh()
        self.attached = True
        log.info(
            "flipsync: rank %d mapped %d checkpoint tensors onto %d parameters (%d in place, %d reload) in %.1fs",
            self.rank,
            len(maps),
            len(self.params),
            sum(p.mode == INPLACE for p in self.params.values()),
            sum(p.mode == RELOAD for p in self.params.values()),
            time.perf_counter() - t0,
        )
        return {
            "rank": self.rank,
            "maps": {n: [[p, blocks.tolist()] for p, blocks in places] for n, places in self.maps.items()},
            "params": {p.name: {k: v for k, v in asdict(p).items() if k != "name"} for p in self.params.values()},
            "unheld": unheld,
            "audit": self._attach_audit(),
        }

    def _reloading(self) -> list[str]:
        """The modules with reload-mode parameters, and every other holder of those parameters."""
        return sorted(self._with_holders({p.name for p in self.params.values() if p.mode == RELOAD}))

    def _with_holders(self, pnames: Iterable[str]) -> set[str]:
        out: set[str] = set()
        for p in pnames:
            out.add(self.params[p].module)
            out |= self.holders.get(p, set())
        return out

    def _reload_names(self) -> list[str]:
        return sorted({n for m in self._reloading() for n in self.feeds[m]})

    def _capture(self, source: Mapping[str, torch.Tensor]) -> None:
        """Host copies of reload-mode parameters, filled by loading their checkpoint tensors from ``source``
        into scratch."""
        reload_params = {p for p, info in self.params.items() if info.mode == RELOAD}
        for pname in reload_params:
            shape, dtype, _device = self._probe_shapes[pname]
            self.host[pname] = torch.zeros(shape, dtype=dtype)
        for group in _grouped(self._reload_names()).values():
            targets = {p for n in group for p, _ in self.maps.get(n, [])}
            with self._swapped(targets) as scratch:
                for name in group:
                    if name not in source:
                        raise WorkerOpError(f"the source checkpoint has no tensor {name!r}")
                    tensor = source[name]
                    self._check_spec(name, tensor)
                    self._load(name, tensor)
                    for pname, blocks in self.maps.get(name, []):
                        if pname not in reload_params:
                            continue
                        for _c, p in iter_chunks(blocks):
                            write_bits(self.host[pname], p, read_bits(scratch[pname], p))

    def _check_spec(self, name: str, tensor: torch.Tensor) -> None:
        shape, dname = self.specs[name]
        if tuple(tensor.shape) != shape or dtype_of(tensor).name != dname:
            raise WorkerOpError(
                f"tensor {name!r} is {tuple(tensor.shape)} {dtype_of(tensor).name}, the served view has {shape} {dname}"
            )

    # ------------------------------------------------------------------------------- element access
    def _target(self, pname: str, live: LiveParams) -> torch.Tensor:
        """Where parameter ``pname``'s checkpoint-format bits live: its host copy (reload) or itself (in place)."""
        info = self.params.get(pname)
        if info is None:
            raise WorkerOpError(f"parameter {pname!r} is not in this worker's map")
        if info.mode == RELOAD:
            return self.host[pname]
        t = live[pname][3]
        assert t is not None  # dropped parameters are reload-mode
        return t

    def _ck(self, pname: str) -> DType:
        return dtype_named(self.params[pname].dtype)

    def _located(
        self, pname: str, pos_b64: str, live: LiveParams, positions: np.dtype
    ) -> tuple[torch.Tensor, np.ndarray, DType]:
        """Parameter ``pname``'s target, the positions sent (checked to lie inside it) and its checkpoint dtype."""
        t = self._target(pname, live)
        pos = unb64(pos_b64, positions).astype(np.int64, copy=False)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= t.numel()):
            raise WorkerOpError(f"positions outside parameter {pname!r} ({t.numel()} elements)")
        return t, pos, self._ck(pname)

    def gather(self, reads: list[list[str]], positions: np.dtype = _INT64) -> list[str]:
        live = self._live_params()
        return [b64(read_as(*self._located(pname, pos_b64, live, positions))) for pname, pos_b64 in reads]

    def _held_checkpoint(self, names: Iterable[str]) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint tensors ``names`` rebuilt from the held values (host copies, live parameters)."""
        live = self._live_params()
        tensors = []
        for name in sorted(names):
            shape, dname = self.specs[name]
            d = dtype_named(dname)
            out = torch.zeros(shape, dtype=d.torch_dtype)
            for pname, blocks in self.maps[name]:
                copy_blocks(out, self._target(pname, live), blocks, d)
            tensors.append((name, out))
        return tensors

    def _reload_modules(self, modules: set[str], *, seed: int = 0) -> None:
        """Rebuild every checkpoint tensor that loads into ``modules`` from the held values; reprocess them
        through the engine's reload path; audit (and where the engine's path is known to fall short, complete)
        the reloaded layers."""
        if not modules:
            return
        if self.reloader is None:
            raise WorkerOpError("this worker has reload-mode parameters but no reload path")
        names = self._feeds_of(modules)
        before = self._storage()
        self.reloader(self._held_checkpoint(names))
        self._check_reloaded(sorted(modules), seed)
        moved = sorted(n for n, s in self._storage().items() if before.get(n, s) != s)
        if moved:
            # Blind spot 6: captured CUDA graphs read the addresses they were captured with; a reload that
            # reallocates passes every value check while the graphs read freed memory.
            raise AuditError(
                f"rank {self.rank}: the reload moved {len(moved)} parameter(s) or buffer(s) to new storage, e.g. "
                f"{moved[:3]}; captured CUDA graphs would read the old memory; the update is refused (report this "
                "engine's reload path; a full restart re-captures the graphs)"
            )

    def _storage(self) -> dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """(address, shape, strides) of every parameter and buffer of the model (method objects' own aside:
        the audit's repair may give a layer a fresh load's)."""
        out = {}
        for mname, module in self.model.named_modules():
            if any(part in ("quant_method", "scheme") for part in mname.split(".")):
                continue
            out.update({f"{mname}.{n}": s for n, s in storage_of(module).items()})
        return out

    # ------------------------------------------------------------------------------- writes
    def apply(self, token: str, writes: list[list[str]], positions: np.dtype = _INT64) -> dict:
        """Write each (parameter, positions, bits[, digest of the bits they replace]); reload and audit the
        reload-mode layers touched; read every write back. A write whose elements hold other bits than its
        digest says (the sidecar staged it from its host copy, not from a gather) is refused before any write."""
        decoded = []
        live = self._live_params()
        for pname, pos_b64, bits_b64, *expect in writes:
            t, pos, ck = self._located(pname, pos_b64, live, positions)
            bits = unb64(bits_b64, ck.uint_numpy)
            if bits.size != pos.size:
                raise WorkerOpError(f"write to {pname!r}: {pos.size} positions but {bits.size} values")
            old = read_as(t, pos, ck)  # checked against the digest, then kept for the undo
            if expect and bits_digest(old) != expect[0]:
                raise BaseBitsError(
                    f"rank {self.rank}: {pname!r} holds other bits than the sidecar's host copy at the patch's "
                    f"changed elements ({pos.size}); nothing was written"
                )
            decoded.append((pname, t, ck, pos, bits, old))
        entry = UndoEntry()
        t0 = time.perf_counter()
        try:
            for pname, t, ck, pos, bits, old in decoded:
                entry.writes.append((pname, pos, old))
                write_as(t, pos, bits, ck)
                if self.params[pname].mode == RELOAD:
                    entry.modules |= self._with_holders([pname])
            self._reload_modules(entry.modules, seed=zlib.crc32(token.encode()))
            # Blind spot 5: in-place parameters (every dense layer on a GPU) were never audited. Each write is
            # read back after the reloads (a reload that writes a neighbour's parameter is seen), from the
            # tensor the model holds now, and its digest goes back to the sidecar, which compares it with
            # the bits it staged against the patch's target: O(changed).
            live_now = self._live_params()
            readback = []
            for pname, _t, ck, pos, bits, _old in decoded:
                got = read_as(self._target(pname, live_now), pos, ck)
                if not np.array_equal(got, bits):
                    raise AuditError(
                        f"rank {self.rank}: read-back of {pname!r} after the commit differs from what was written "
                        f"at {int((got != bits).sum())} of {pos.size} positions; the update is refused"
                    )
                readback.append((pname, pos, got))
        except BaseException as e:
            try:
                self._revert(entry)
            except Exception as undo_error:
                raise StateUnknownError(
                    f"{e}; undoing it failed too ({undo_error}): this worker's weights are unknown, resync it"
                ) from None
            raise
        self.undo[token] = entry
        while len(self.undo) > self.max_undo:
            old, _ = self.undo.popitem(last=False)
            log.info("flipsync: dropped undo record %s (keeping %d)", old, self.max_undo)
        return {
            "n": int(sum(pos.size for _, _, _, pos, _, _ in decoded)),
            "reloaded": sorted(entry.modules),
            "audited": list(self.audited) if entry.modules else [],
            "audit_s": self.audit_s if entry.modules else 0.0,
            "rechecked": list(self.rechecked) if entry.modules else [],
            "readback": readback_digest(readback),
            "seconds": time.perf_counter() - t0,
        }

    def _revert(self, entry: UndoEntry) -> None:
        live = self._live_params()
        for pname, pos, old in reversed(entry.writes):
            write_as(self._target(pname, live), pos, old, self._ck(pname))
        if entry.modules:
            self._reload_modules(entry.modules)

    def undo_token(self, token: str) -> bool:
        entry = self.undo.pop(token, None)
        if entry is None:
            return False
        self._revert(entry)
        return True

    def fingerprints(self, names: Iterable[str] | None) -> dict[str, list[list[Any]]]:
        """Per checkpoint tensor and block: (parameter, block, fingerprint of the block's elements)."""
        out: dict[str, list[list[Any]]] = {}
        live = self._live_params()
        for name in names if names is not None else sorted(self.maps):
            rows = []
            for pname, blocks in self.maps.get(name, []):
                t = self._target(pname, live)
                ck = self._ck(pname)
                for block in blocks:
                    fp = sum(fingerprint_of(c, read_as(t, p, ck)) for c, p in iter_chunks(block[None, :]))
                    rows.append([pname, [int(x) for x in block], fp_hex(fp & 0xFFFFFFFFFFFFFFFF)])
            out[name] = rows
        return out

    def load(self, source: Mapping[str, torch.Tensor]) -> None:
        """Load a full served view through the engine's reload path, refresh the host copies, then audit."""
        missing = sorted(set(self.specs) - set(source))
        if missing:
            raise WorkerOpError(f"the view lacks {len(missing)} tensors, e.g. {missing[:3]}")
        for name in self.specs:
            self._check_spec(name, source[name])
        if self.reloader is None:
            raise WorkerOpError("this worker has no reload path to load a full view")
        self.reloader([(n, source[n]) for n in sorted(self.specs)])
        self._capture(source)
        self.undo.clear()
        self._check_reloaded(self._reloading(), 0)

    # ------------------------------------------------------------------------------- dispatch
    def handle(self, request: Mapping[str, Any]) -> dict:
        """Serve one request; never raises (errors are answers, so that every rank reports)."""
        op = request.get("op")
        try:
            if request.get("protocol") != PROTOCOL:
                raise WorkerOpError(f"protocol {request.get('protocol')!r} != worker protocol {PROTOCOL}")
            mine = request.get("per_rank", {}).get(str(self.rank), [])
            if op == "attach":
                self.max_undo = int(request.get("max_undo", DEFAULT_MAX_UNDO))
                src = _open_checkpoint(request["source"]) if request.get("source") else None
                audit = str(request.get("audit", AUDIT_EVERY))
                result = self.attach(request["specs"], src, audit=audit, repair=bool(request.get("repair", True)))
            elif not self.attached:
                raise WorkerOpError("the worker is not attached; call attach first")
            elif op == "gather":
                result = self.gather(mine, _positions(request))
            elif op == "apply":
                result = self.apply(str(request["token"]), mine, _positions(request))
            elif op == "undo":
                result = self.undo_token(str(request["token"]))
            elif op == "fingerprint":
                result = self.fingerprints(request.get("names"))
            elif op == "load":
                self.load(_open_checkpoint(str(request["source"])))
                result = True
            elif op == "kernels":
                result = self.kernel_state(request.get("modules"))
            elif op == "audit":
                result = self.audit_now(request.get("modules"))
            else:
                raise WorkerOpError(f"unknown operation {op!r}")
            return {"ok": True, "rank": self.rank, "result": result}
        except Exception as e:
            log.error("flipsync: %s failed on rank %d: %s", op, self.rank, e)
            return {
                "ok": False,
                "rank": self.rank,
                "unknown": isinstance(e, StateUnknownError),
                "stale_base": isinstance(e, BaseBitsError),
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(limit=6) if not isinstance(e, WorkerOpError) else "",
            }


def _positions(request: Mapping[str, Any]) -> np.dtype:
    """The dtype the request's positions are in: int64, or int32 where every position fits."""
    name = request.get("positions", "int64")
    if name not in ("int32", "int64"):
        raise WorkerOpError(f"positions must be int32 or int64, not {name!r}")
    return np.dtype(name)


def _grouped(names: Iterable[str]) -> dict[str, list[str]]:
    """``names`` by the module prefix they belong to (`group_key`), in order."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(group_key(name), []).append(name)
    return groups


def _open_checkpoint(path: str) -> Mapping[str, torch.Tensor]:
    from flipsync.checkpoint import Checkpoint

    return Checkpoint(path)


class FlipsyncWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); one RPC method, JSON in and out."""

    def flipsync_call(self, request: str) -> str:
        core: WorkerCore | None = getattr(self, "_flipsync_core", None)
        if core is None:
            core = WorkerCore(
                self.get_model(),  # type: ignore[attr-defined]
                rank=int(getattr(self, "rank", 0)),
                policy=vllm_policy,
                scratch=vllm_scratch,
                reloader=self._flipsync_reload,
                default_source=self._flipsync_default_source,
                hooks=vllm_hooks(self.vllm_config),  # type: ignore[attr-defined]
            )
            self._flipsync_core = core
        t_in = time.time()  # wall clock, so that the sidecar can split its round trip (engine.py: commit's log)
        try:
            req = json.loads(request)
        except (TypeError, ValueError) as e:
            return json.dumps({"ok": False, "rank": core.rank, "error": f"request is not JSON: {e}"})
        answer = core.handle(req)
        answer["clock"] = [t_in, time.time()]
        return json.dumps(answer)

    def _flipsync_reload(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        runner = self.model_runner  # type: ignore[attr-defined]
        if not hasattr(runner, "reload_weights"):
            raise WorkerOpError("this vLLM has no layerwise reload (model_runner.reload_weights); upgrade vLLM")
        runner.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)

    def _flipsync_default_source(self) -> Mapping[str, torch.Tensor] | None:
        path = self.vllm_config.model_config.model  # type: ignore[attr-defined]
        return _open_checkpoint(path) if os.path.isdir(path) else None
