"""The part of the ``vllm`` engine that runs inside vLLM's workers.

vLLM loads :class:`FlipsyncWorkerExtension` into every worker (``--worker-extension-cls
flipsync.engines.vllm.worker.FlipsyncWorkerExtension``, or ``LLM(worker_extension_cls=...)``); the sidecar
reaches it through ``collective_rpc("flipsync_call", args=(json,))``, in process (``LLM.collective_rpc``) or
over HTTP (``POST /collective_rpc`` with ``VLLM_SERVER_DEV_MODE=1``). Requests and answers are JSON strings
(the HTTP route passes string arguments only); arrays travel as base64 of their little-endian bytes.

All engine-independent logic lives in :class:`WorkerCore`, which needs only a module with vLLM's
``load_weights(Iterable[(checkpoint name, tensor)])`` contract; unit tests drive it with a small fake model.
Beside it: ``wire`` (what both halves agree on), ``blockmap`` (the map's blocks and probe digits, pure) and
``scratch`` (the stand-ins probing loads into, and the in-place policies).

The map from checkpoint coordinates to vLLM's parameters is *learned*, never written by hand: each
checkpoint tensor is pushed through the model's own ``load_weights`` (stacked-parameter mapping, fused
``qkv_proj`` / ``gate_up_proj``, tensor-parallel sharding, vocabulary padding) into zeroed scratch copies
of the parameters, with values that encode the element index in base ``B`` digits (``B`` = the largest
power of two whose integers 1..B the dtype holds exactly: 256 for BF16, 2048 for FP16, 16 for FP8 E4M3),
one pass per digit. Reading back where each digit landed gives, per parameter, the checkpoint index of
every element; the pairs are compressed into affine 2-D blocks (one block for a contiguous or row-sharded
slice, one strided block for a column-sharded one). A last pass loads random values and checks that every
mapped element holds the checkpoint's exact bits, so a loader that casts or transforms values is caught.
The live parameters are never written while probing: the parameters of the probed layer are swapped for
scratch tensors (rebuilt from vLLM's recorded model-format metadata where the kernel format differs), and
every other parameter for a zero-stride "tripwire" that raises on any write.

Two ways to apply the writes of a patch, decided per parameter at start-up:

- ``inplace``: the kernel computes from the parameter as loaded (BF16/FP16 on CUDA, norms, embedding
  lookups). Writes are scattered straight into the live parameter: O(changed).
- ``reload``: the kernel computes from a repacked copy (vLLM's CPU backend packs every linear weight for
  oneDNN and drops the parameter; Marlin, quantized kernels...). The worker keeps a host copy of the
  parameter in model format, scatters into it (O(changed)), rebuilds the checkpoint tensors of each touched
  layer from it and hands them to vLLM's layerwise reload (``model_runner.reload_weights``), which reprocesses
  only those layers: O(size of the touched layers).

Parameters the engine dropped after loading (set to None, their values kept in an opaque handle) are found
through vLLM's recorded model-format metadata and go through the reload path. A checkpoint tensor loaded into
a parameter of a wider dtype (BF16 or FP16 into FP32) is patched through that exact conversion; a narrowing
one is refused (the engine could not report the checkpoint's bits).

After every reload the worker audits the touched layers (:mod:`flipsync.engines.vllm.kernels`): a *twin* of
the layer, loaded with the same checkpoint tensors through the same loaders and processed as at engine start,
must equal the live layer bitwise (tensors, and the kernel's outputs on identity probes where it computes
from an opaque copy). The first reload of each kind of layer is always audited: where the engine's update
path leaves the layer differing from a fresh load (vLLM CPU's MoE skips its expert prepack), the layer takes
the twin's processed state, and so does every later reload of that kind. Any other mismatch refuses the
update (the writes are undone). ``audit``: ``every`` touched layer (default), ``sample`` (one per kind and
update, a sample of probe rows) or ``off`` (only the first reload of each kind).

Every apply keeps the old bits as an undo record (at most ``max_undo`` records per worker, oldest dropped).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
import traceback
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flipsync.codec.bits import DType, bits_numpy, dtype_named, dtype_of, int_view
from flipsync.codec.fingerprint import fingerprint_of, fp_hex
from flipsync.engines.vllm.blockmap import (
    compress_map,
    digit_probe,
    exact_int_base,
    group_key,
    iter_chunks,
    probe_passes,
)
from flipsync.engines.vllm.kernels import (
    ADOPTED,
    DEFAULT_HOOKS,
    SAMPLE_ROWS,
    KernelHooks,
    compare,
    digest,
    module_tensors,
    vllm_hooks,
)
from flipsync.engines.vllm.scratch import (
    Policy,
    ScratchFactory,
    default_policy,
    default_scratch,
    tripwire,
    vllm_policy,
    vllm_scratch,
)
from flipsync.engines.vllm.wire import (
    AUDIT_EVERY,
    AUDIT_MODES,
    AUDIT_OFF,
    DEFAULT_MAX_UNDO,
    INPLACE,
    PROTOCOL,
    RELOAD,
    AuditError,
    StateUnknownError,
    WorkerOpError,
    b64,
    uint_dtype,
    unb64,
)

log = logging.getLogger(__name__)

# Reloads whole checkpoint tensors through the engine's own reload path (layerwise reprocessing).
Reloader = Callable[[list[tuple[str, torch.Tensor]]], None]


# ------------------------------------------------------------------------------------------- worker
@dataclass
class ParamInfo:
    name: str
    module: str
    mode: str
    reason: str
    dtype: str
    shape: tuple[int, ...]


@dataclass
class UndoEntry:
    writes: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)  # param, positions, old bits
    modules: set[str] = field(default_factory=set)


def _read_bits(t: torch.Tensor, positions: np.ndarray) -> np.ndarray:
    d = dtype_of(t)
    flat = int_view(t.detach())
    if flat.device.type == "cpu":
        return flat.numpy()[positions].view(d.uint_numpy)
    idx = torch.from_numpy(positions).to(flat.device)
    return flat[idx].cpu().numpy().view(d.uint_numpy)


def _write_bits(t: torch.Tensor, positions: np.ndarray, bits: np.ndarray) -> None:
    d = dtype_of(t)
    flat = int_view(t.detach())
    signed = np.ascontiguousarray(bits.astype(d.uint_numpy, copy=False)).view(_np_int(d.bits))
    if flat.device.type == "cpu":
        flat.numpy()[positions] = signed
    else:
        flat.index_copy_(0, torch.from_numpy(positions).to(flat.device), torch.from_numpy(signed).to(flat.device))


def _np_int(bits: int) -> np.dtype:
    return np.dtype(np.uint8) if bits == 8 else np.dtype(f"<i{bits // 8}")


# Checkpoint dtype -> engine parameter dtypes it converts into exactly (and back, for the values it came from).
_WIDENS: dict[torch.dtype, tuple[torch.dtype, ...]] = {
    torch.bfloat16: (torch.float32,),
    torch.float16: (torch.float32,),
}


def widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` converts exactly into ``dst`` (BF16 or FP16 loaded into FP32)."""
    return dst in _WIDENS.get(src, ())


def _read_as(t: torch.Tensor, positions: np.ndarray, ck: DType) -> np.ndarray:
    """The checkpoint-dtype bits of elements ``positions`` of ``t`` (which may hold them widened)."""
    if t.dtype == ck.torch_dtype:
        return _read_bits(t, positions)
    flat = t.detach().reshape(-1)
    vals = flat[torch.from_numpy(positions).to(flat.device)]
    back = vals.to(ck.torch_dtype)
    if not torch.equal(int_view(back.to(t.dtype)), int_view(vals)):
        raise WorkerOpError(
            f"a {t.dtype} parameter holds values that are not {ck.name} values; it no longer holds what the "
            "checkpoint loaded into it"
        )
    return int_view(back).cpu().numpy().view(ck.uint_numpy)


def _write_as(t: torch.Tensor, positions: np.ndarray, bits: np.ndarray, ck: DType) -> None:
    """Write checkpoint-dtype ``bits`` at ``positions`` of ``t``, converted exactly into its dtype."""
    if t.dtype == ck.torch_dtype:
        _write_bits(t, positions, bits)
        return
    raw = np.ascontiguousarray(bits.astype(ck.uint_numpy, copy=False)).view(_np_int(ck.bits))
    flat = t.detach().reshape(-1)
    vals = torch.from_numpy(raw).view(ck.torch_dtype).to(t.dtype).to(flat.device)
    flat.index_copy_(0, torch.from_numpy(positions).to(flat.device), vals)


_KIND_UNKNOWN, _KIND_FAITHFUL, _KIND_REPAIRED = "unknown", "faithful", "repaired"


class WorkerCore:
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
        open_source: Callable[[str], Mapping[str, torch.Tensor]] | None = None,
        hooks: KernelHooks = DEFAULT_HOOKS,
    ) -> None:
        self.model = model
        self.rank = rank
        self.policy = policy
        self.scratch = scratch
        self.reloader = reloader
        self.default_source = default_source
        self.open_source = open_source or _open_checkpoint
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

    # ------------------------------------------------------------------------------ module tree
    def _live_params(self) -> dict[str, tuple[str, torch.nn.Module, str, torch.Tensor | None]]:
        """Every parameter by its name in ``named_parameters`` (module name, module, attribute, tensor), and the
        ones the engine dropped (None: the kernel holds them elsewhere) whose model format is known."""
        out: dict[str, tuple[str, torch.nn.Module, str, torch.Tensor | None]] = {}
        seen: set[int] = set()
        for mname, mod in self.model.named_modules():
            for pname, p in mod._parameters.items():
                full = f"{mname}.{pname}" if mname else pname
                if p is None:
                    if full in self._dropped:
                        out[full] = (mname, mod, pname, None)
                    continue
                if id(p) in seen:
                    continue
                seen.add(id(p))
                out[full] = (mname, mod, pname, p)
        return out

    def _find_dropped(self) -> None:
        """Parameters set to None whose model format the scratch factory can rebuild (vLLM's metadata)."""
        self._dropped = set()
        for mname, mod in self.model.named_modules():
            for pname, p in mod._parameters.items():
                if p is None and self.scratch(mod, pname, None) is not None:
                    self._dropped.add(f"{mname}.{pname}" if mname else pname)

    def _owners(self) -> dict[int, list[tuple[str, torch.nn.Module, str]]]:
        owners: dict[int, list[tuple[str, torch.nn.Module, str]]] = {}
        for mname, mod in self.model.named_modules(remove_duplicate=False):
            for pname, p in mod._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), []).append((mname, mod, pname))
        return owners

    @contextmanager
    def _swapped(self, scratch_names: set[str]) -> Iterator[dict[str, torch.Tensor]]:
        """Swap the named parameters for zeroed scratch and every other one for a tripwire; restore on exit."""
        live = self._live_params()
        owners = self._owners()
        saved: list[tuple[torch.nn.Module, str, torch.Tensor | None]] = []
        scratch: dict[str, torch.Tensor] = {}
        try:
            for full, (_mname, mod, pname, p) in live.items():
                if p is None:  # dropped: scratch only where probed
                    if full in scratch_names:
                        s = self.scratch(mod, pname, None)
                        if s is not None:
                            scratch[full] = s
                            saved.append((mod, pname, None))
                            mod._parameters[pname] = s  # type: ignore[assignment]
                    continue
                if full in scratch_names:
                    s = self.scratch(mod, pname, p)
                    assert s is not None
                    scratch[full] = s
                elif p.numel() == 0:
                    continue
                else:
                    s = tripwire(p, mod)
                for _m, omod, opname in owners.get(id(p), [(_mname, mod, pname)]):
                    saved.append((omod, opname, omod._parameters[opname]))
                    omod._parameters[opname] = s  # type: ignore[assignment]
            yield scratch
        finally:
            for mod, pname, p in reversed(saved):
                mod._parameters[pname] = p  # type: ignore[assignment]

    def _load(self, name: str, tensor: torch.Tensor) -> set[str] | None:
        ret = self.model.load_weights([(name, tensor)])  # type: ignore[operator]
        return set(ret) if isinstance(ret, set | frozenset | list | tuple) else None

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
        self.kinds, self._opaque = {}, {}
        self.specs = {n: (tuple(int(x) for x in s), str(d)) for n, (s, d) in specs.items()}
        with self._buffers_guard():
            return self._attach(source, t0)

    @contextmanager
    def _buffers_guard(self) -> Iterator[None]:
        """Probes load through ``load_weights``, which may also write buffers; put every buffer back after."""
        saved = [(b, b.detach().clone()) for _, b in self.model.named_buffers() if b is not None and b.numel()]
        try:
            yield
        finally:
            with torch.no_grad():
                for b, copy in saved:
                    if not torch.equal(b, copy):
                        b.copy_(copy)

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
            ok, why = True, ""
            for omname, omod, opname in owners[id(p)]:
                o_ok, o_why = self.policy(omname, omod, opname, p)
                if not o_ok:
                    ok, why = False, f"{omname}: {o_why}"
                    break
                why = o_why
            modes[full] = ParamInfo(full, mname, INPLACE if ok else RELOAD, why, "", tuple(p.shape))
        narrowest = min(
            (exact_int_base(p.dtype) for _, _, _, p in live.values() if p is not None and p.dtype.is_floating_point),
            default=1 << 30,
        )
        groups: dict[str, list[str]] = {}
        names: list[str] | set[str]  # the group's names here, the tensors fed into a parameter below
        for name in sorted(self.specs):
            groups.setdefault(group_key(name), []).append(name)
        maps: dict[str, list[tuple[str, np.ndarray]]] = {}
        unheld: dict[str, str] = {}
        for key, names in groups.items():
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
        self.host = {}
        reload_names = sorted({n for m, ns in self.feeds.items() for n in ns if self._module_reloads(m)})
        if reload_names:
            src = source if source is not None else (self.default_source() if self.default_source else None)
            if src is None:
                raise WorkerOpError(
                    f"{len(reload_names)} checkpoint tensors load into repacked parameters (reload mode) and "
                    "no source checkpoint was given to capture their values; pass 'source' (a checkpoint path)"
                )
            self._capture(reload_names, src)
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
        out = self.describe(unheld)
        out["audit"] = self._attach_audit()
        return out

    def _attach_audit(self) -> dict[str, Any]:
        """Compare the reload-mode layers, as the engine loaded them at start, with twins loaded from the host
        copies (``source``): equal means the engine serves ``source`` and the twins are fresh loads. A
        mismatch is reported (the sidecar then refuses patches until a full load), not raised."""
        modules = sorted(m for m in self.feeds if self._module_reloads(m))
        picked = self._pick(modules) if self.audit != AUDIT_OFF else []
        t0 = time.perf_counter()
        bad: dict[str, list[str]] = {}
        for m in picked:
            twin = self._twin(m)
            found = self._compare(m, twin, self._rows())
            if found:
                bad[m] = found
                log.warning(
                    "flipsync: rank %d: layer %s (%s) differs from a fresh load of the source checkpoint: %s",
                    self.rank,
                    m,
                    self._kind(m),
                    "; ".join(found[:3]),
                )
        return {"layers": picked, "mismatches": bad, "seconds": time.perf_counter() - t0}

    def _module_reloads(self, module: str) -> bool:
        return any(p.mode == RELOAD for p in self.params.values() if p.module == module)

    def describe(self, unheld: Mapping[str, str] | None = None) -> dict:
        return {
            "rank": self.rank,
            "maps": {n: [[p, blocks.tolist()] for p, blocks in places] for n, places in self.maps.items()},
            "params": {
                p.name: {
                    "module": p.module,
                    "mode": p.mode,
                    "reason": p.reason,
                    "dtype": p.dtype,
                    "shape": list(p.shape),
                }
                for p in self.params.values()
            },
            "unheld": dict(unheld or {}),
        }

    def _probe_group(
        self, names: list[str], members: set[str], narrowest: int, unheld: dict[str, str]
    ) -> dict[str, list[tuple[str, np.ndarray]]]:
        out: dict[str, list[tuple[str, np.ndarray]]] = {}
        with self._swapped(members) as scratch:
            for full, s in scratch.items():
                self._probe_shapes[full] = (tuple(s.shape), s.dtype, s.device)
            for name in names:
                shape, dname = self.specs[name]
                dtype = dtype_named(dname).torch_dtype
                numel = math.prod(shape)
                if numel == 0:
                    unheld[name] = "empty tensor"
                    continue
                base = min(exact_int_base(dtype), narrowest)
                if base < 2:
                    raise WorkerOpError(f"cannot probe {name!r}: dtype {dname} holds no small integers exactly")
                passes = probe_passes(numel, base)
                found: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # param -> (positions, index so far)
                for k in range(passes):
                    loaded = self._load(name, digit_probe(numel, shape, dtype, base, k))
                    if k > 0:
                        candidates = list(found)
                    elif loaded is not None and loaded & scratch.keys():
                        candidates = sorted(loaded & scratch.keys())
                    else:
                        candidates = list(scratch)
                    for pname in candidates:
                        flat = scratch[pname].detach().reshape(-1)
                        pos = torch.nonzero(flat != 0).squeeze(1)
                        if k > 0 and (pname not in found or not torch.equal(pos, found[pname][0])):
                            raise WorkerOpError(
                                f"loading {name!r} into {pname!r} is not a pure relayout (the written elements "
                                f"differ between probe passes); this parameter is not supported"
                            )
                        if pos.numel() == 0:
                            continue
                        vals = flat[pos].to(torch.float64)
                        digits = vals - 1
                        if not bool(((digits >= 0) & (digits < base) & (digits == digits.round())).all()):
                            raise WorkerOpError(
                                f"loading {name!r} into {pname!r} transforms values (a probe digit did not survive); "
                                "serve this tensor in the checkpoint's dtype without online quantization"
                            )
                        acc = found[pname][1] if pname in found else torch.zeros(pos.numel(), dtype=torch.int64)
                        acc = acc + digits.to(torch.int64).cpu() * (base**k)
                        found[pname] = (pos, acc)
                        flat[pos] = 0
                places: list[tuple[str, np.ndarray]] = []
                for pname, (pos, idx) in sorted(found.items()):
                    idx_np = idx.numpy()
                    if idx_np.size and int(idx_np.max()) >= numel:
                        raise WorkerOpError(f"probe of {name!r} decoded an index past its end in {pname!r}")
                    places.append((pname, compress_map(idx_np, pos.cpu().numpy())))
                if not places:
                    unheld[name] = "the engine does not load this tensor (ignored, tied or on another pipeline stage)"
                    continue
                self._verify(name, shape, dtype, places, scratch)
                out[name] = places
        return out

    def _verify(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        places: list[tuple[str, np.ndarray]],
        scratch: Mapping[str, torch.Tensor],
    ) -> None:
        """Load random values and check that every mapped element holds the checkpoint's exact bits (or their
        exact conversion into a wider parameter dtype)."""
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        if dtype.is_floating_point:
            rnd = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
        else:
            rnd = torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g).to(dtype)
        self._load(name, rnd)
        ck = dtype_named(dtype_of(rnd).name)
        src = bits_numpy(rnd.contiguous())
        for pname, blocks in places:
            t = scratch[pname]
            if t.dtype != dtype and not widens(dtype, t.dtype):
                raise WorkerOpError(
                    f"checkpoint tensor {name!r} is {dtype} but loads into {pname!r} as {t.dtype}, which cannot hold "
                    f"its bits exactly; serve the model so that the engine keeps the checkpoint's dtype (e.g. --dtype "
                    f"bfloat16 for a BF16 view), or save the checkpoint with {name!r} in {t.dtype}"
                )
            for c, p in iter_chunks(blocks):
                if not np.array_equal(_read_as(t, p, ck), src[c]):
                    raise WorkerOpError(f"loading {name!r} into {pname!r} does not copy bits exactly; not supported")
                _write_bits(t, p, np.zeros(p.size, dtype=dtype_of(t).uint_numpy))

    def _capture(self, names: list[str], source: Mapping[str, torch.Tensor]) -> None:
        """Host copies of reload-mode parameters, filled by loading ``names`` from ``source`` into scratch."""
        reload_params = {p for p, info in self.params.items() if info.mode == RELOAD}
        shapes = self._probe_shapes
        for pname in reload_params:
            shape, dtype, _device = shapes[pname]
            self.host[pname] = torch.zeros(shape, dtype=dtype)
        groups: dict[str, list[str]] = {}
        for name in names:
            groups.setdefault(group_key(name), []).append(name)
        for _key, group in groups.items():
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
                            _write_bits(self.host[pname], p, _read_bits(scratch[pname], p))

    def _check_spec(self, name: str, tensor: torch.Tensor) -> None:
        shape, dname = self.specs[name]
        if tuple(tensor.shape) != shape or dtype_of(tensor).name != dname:
            raise WorkerOpError(
                f"tensor {name!r} is {tuple(tensor.shape)} {dtype_of(tensor).name}, the served view has {shape} {dname}"
            )

    # ------------------------------------------------------------------------------- element access
    def _target(
        self, pname: str, live: Mapping[str, tuple[str, torch.nn.Module, str, torch.Tensor | None]] | None = None
    ) -> torch.Tensor:
        """Where parameter ``pname``'s checkpoint-format bits live: its host copy (reload) or itself (in place)."""
        info = self.params.get(pname)
        if info is None:
            raise WorkerOpError(f"parameter {pname!r} is not in this worker's map")
        if info.mode == RELOAD:
            return self.host[pname]
        live = live if live is not None else self._live_params()
        t = live[pname][3]
        assert t is not None  # dropped parameters are reload-mode
        return t

    def _ck(self, pname: str) -> DType:
        return dtype_named(self.params[pname].dtype)

    def _positions_ok(self, pname: str, t: torch.Tensor, positions: np.ndarray) -> None:
        if positions.size and (int(positions.min()) < 0 or int(positions.max()) >= t.numel()):
            raise WorkerOpError(f"positions outside parameter {pname!r} ({t.numel()} elements)")

    def gather(self, reads: list[list[str]]) -> list[str]:
        out = []
        live = self._live_params()
        for pname, pos_b64 in reads:
            t = self._target(pname, live)
            pos = unb64(pos_b64, np.int64)
            self._positions_ok(pname, t, pos)
            out.append(b64(_read_as(t, pos, self._ck(pname))))
        return out

    def _held_checkpoint(self, names: Iterable[str]) -> list[tuple[str, torch.Tensor]]:
        """The checkpoint tensors ``names`` rebuilt from the held values (host copies, live parameters)."""
        live = self._live_params()
        tensors = []
        for name in sorted(names):
            shape, dname = self.specs[name]
            d = dtype_named(dname)
            out = torch.zeros(shape, dtype=d.torch_dtype)
            for pname, blocks in self.maps[name]:
                target = self._target(pname, live)
                for c, p in iter_chunks(blocks):
                    _write_bits(out, c, _read_as(target, p, d))
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
        names = {n for m in modules for n in self.feeds.get(m, ())}
        self.reloader(self._held_checkpoint(names))
        self._check_reloaded(sorted(modules), seed)

    # ------------------------------------------------------------------------------- the audit
    def _kind(self, mname: str) -> str:
        return self.hooks.kind(self.model.get_submodule(mname))

    def _rows(self) -> int | None:
        return None if self.audit == AUDIT_EVERY else SAMPLE_ROWS

    def _pick(self, modules: Sequence[str]) -> list[str]:
        """The layers an audit compares: all of them (``every``) or one of each kind, at random (``sample``)."""
        if self.audit == AUDIT_EVERY:
            return list(modules)
        by_kind: dict[str, list[str]] = {}
        for m in modules:
            by_kind.setdefault(self._kind(m), []).append(m)
        return sorted(self._rng.choice(ms) for ms in by_kind.values())

    def _twin(self, mname: str) -> torch.nn.Module:
        """A fresh load of layer ``mname``: its checkpoint tensors (rebuilt from the held values) loaded into
        zeroed model-format scratch through the model's own loaders, then processed by the hooks' twin."""
        module = self.model.get_submodule(mname)
        names = sorted(self.feeds.get(mname, ()))
        members = {p for p, info in self.params.items() if info.module == mname}
        tensors = self._held_checkpoint(names)
        with self._buffers_guard(), self._swapped(members) as scratch:
            for name, t in tensors:
                self._load(name, t)
            loaded = {full.rpartition(".")[2]: s for full, s in scratch.items() if full in members}
        return self.hooks.twin(mname, module, loaded)

    def _compare(self, mname: str, twin: torch.nn.Module, rows: int | None) -> list[str]:
        """What differs between layer ``mname`` as the kernels hold it and its twin (empty: nothing)."""
        module = self.model.get_submodule(mname)
        bad = compare(module_tensors(module), module_tensors(twin))
        seed = self._rng.randrange(1 << 30)
        bad += compare(self.hooks.probe(mname, module, rows, seed), self.hooks.probe(mname, twin, rows, seed), "probe ")
        return bad

    def _adopt(self, mname: str, twin: torch.nn.Module, *, opaque: bool = False) -> tuple[list[str], bool]:
        """Make layer ``mname`` hold its twin's processed state: tensors copied into the live storage (same
        shapes, dtypes, strides), then, if the kernel's outputs still differ (or ``opaque``: the kind's repair
        needed it before), the twin's opaque state. Returns what still differs (empty: the layer now equals a
        fresh load) and whether the opaque state was taken."""
        module = self.model.get_submodule(mname)
        live_t, twin_t = module_tensors(module), module_tensors(twin)
        if set(live_t) != set(twin_t):
            return [f"the layer holds tensors {sorted(live_t)}, a fresh load {sorted(twin_t)}"], False
        for name, b in twin_t.items():
            a = live_t[name]
            if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype or (a.numel() > 1 and a.stride() != b.stride()):
                return [f"{name} has another layout than in a fresh load; it cannot be copied over"], False
        with torch.no_grad():
            for name, b in twin_t.items():
                if compare({name: live_t[name]}, {name: b}):
                    live_t[name].data.copy_(b.data)
        bad = [] if opaque else self._compare(mname, twin, None)
        if opaque or bad:
            # An opaque copy can look right and still be wrong later: vLLM CPU's oneDNN INT8 handle reads its
            # scales from the tensors it was built from, which a reload frees. The live layer takes the twin's
            # state and keeps the twin alive (its tensors with it) until the next one.
            self.hooks.transplant(module, twin)
            vars(module)[ADOPTED] = twin
            return self._compare(mname, twin, None), True
        return bad, False

    def _check_reloaded(self, modules: list[str], seed: int) -> None:
        """The audit after a reload. A kind of layer reloaded for the first time is always compared with its
        twin: equal, its reload path is faithful; different, the layer takes the twin's state (``repair``) and
        so will every later reload of that kind. Faithful kinds are then audited per ``audit``. Raises
        `AuditError` for any layer that still differs."""
        t0 = time.perf_counter()
        self.audited = []
        rng_state = self._rng.getstate()
        self._rng.seed(self.rank * 1_000_003 + seed)
        try:
            by_status: dict[str, list[str]] = {}
            for m in modules:
                by_status.setdefault(self.kinds.get(self._kind(m), _KIND_UNKNOWN), []).append(m)
            must = by_status.get(_KIND_UNKNOWN, []) + by_status.get(_KIND_REPAIRED, [])
            faithful = by_status.get(_KIND_FAITHFUL, [])
            chosen = self._pick(faithful) if self.audit != AUDIT_OFF and faithful else []
            failures: list[str] = []
            for m in sorted(set(must) | set(chosen)):
                kind = self._kind(m)
                status = self.kinds.get(kind, _KIND_UNKNOWN)
                twin = self._twin(m)
                self.audited.append(m)
                if status == _KIND_REPAIRED:  # the engine's path is known to fall short: take the fresh state
                    bad, _ = self._adopt(m, twin, opaque=self._opaque.get(kind, False))
                    if not bad:
                        continue
                else:
                    full = status != _KIND_FAITHFUL or self.audit == AUDIT_EVERY
                    bad = self._compare(m, twin, None if full else SAMPLE_ROWS)
                    if not bad:
                        self.kinds.setdefault(kind, _KIND_FAITHFUL)
                        continue
                if status == _KIND_UNKNOWN and self.repair:
                    left, opaque = self._adopt(m, twin)
                    if not left:
                        log.warning(
                            "flipsync: rank %d: the engine's reload of %s (%s) leaves it differing from a fresh "
                            "load (%s); such layers now take a fresh load's processed state after each reload",
                            self.rank, m, kind, "; ".join(bad[:3]),
                        )  # fmt: skip
                        self.kinds[kind] = _KIND_REPAIRED
                        self._opaque[kind] = opaque
                        continue
                    bad = left
                failures.append(f"layer {m} ({kind}): {'; '.join(bad[:3])}")
                log.error(
                    "flipsync: rank %d: kernel-state audit: layer %s (%s) computes from other weights than a "
                    "fresh load of the same checkpoint tensors: %s",
                    self.rank,
                    m,
                    kind,
                    "; ".join(bad[:3]),
                )
            if failures:
                raise AuditError(
                    f"rank {self.rank}: {len(failures)} reloaded layer(s) differ from a fresh load of the same "
                    f"checkpoint tensors, e.g. {failures[0]}; the update is refused"
                )
        finally:
            self._rng.setstate(rng_state)
            self.audit_s = time.perf_counter() - t0

    def kernel_state(self, modules: Iterable[str] | None = None) -> dict[str, dict[str, list[Any]]]:
        """Digests of every module's tensors as the kernels hold them, and of the kernel outputs on the full
        identity probes for reload-mode layers: what a fresh engine of the same version must also give."""
        wanted = set(modules) if modules is not None else None
        out: dict[str, dict[str, list[Any]]] = {}
        for mname, module in self.model.named_modules():
            if wanted is not None and mname not in wanted:
                continue
            rows: dict[str, list[Any]] = {n: digest(t) for n, t in module_tensors(module).items()}
            if mname in self.feeds and self._module_reloads(mname):
                for label, t in self.hooks.probe(mname, module, None, 0).items():
                    rows[f"probe {label}"] = digest(t)
            if rows:
                out[mname] = rows
        return out

    def audit_now(self, modules: Iterable[str] | None = None) -> dict[str, list[str]]:
        """Compare the named reload-mode layers (default: all) with twins of the held values, full probes."""
        names = sorted(modules) if modules is not None else sorted(m for m in self.feeds if self._module_reloads(m))
        return {m: found for m in names if (found := self._compare(m, self._twin(m), None))}

    # ------------------------------------------------------------------------------- writes
    def apply(self, token: str, writes: list[list[str]]) -> dict:
        decoded = []
        live = self._live_params()
        for pname, pos_b64, bits_b64 in writes:
            t = self._target(pname, live)
            ck = self._ck(pname)
            pos = unb64(pos_b64, np.int64)
            bits = unb64(bits_b64, uint_dtype(ck.bits))
            if bits.size != pos.size:
                raise WorkerOpError(f"write to {pname!r}: {pos.size} positions but {bits.size} values")
            self._positions_ok(pname, t, pos)
            decoded.append((pname, t, ck, pos, bits))
        entry = UndoEntry()
        t0 = time.perf_counter()
        try:
            for pname, t, ck, pos, bits in decoded:
                entry.writes.append((pname, pos, _read_as(t, pos, ck)))
                _write_as(t, pos, bits, ck)
                if self.params[pname].mode == RELOAD:
                    entry.modules.add(self.params[pname].module)
            for pname, t, ck, pos, bits in decoded:
                if not np.array_equal(_read_as(t, pos, ck), bits):
                    raise WorkerOpError(f"read-back of {pname!r} after the scatter differs from what was written")
            self._reload_modules(entry.modules, seed=zlib.crc32(token.encode()))
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
            "n": int(sum(p.size for _, _, _, p, _ in decoded)),
            "reloaded": sorted(entry.modules),
            "audited": list(self.audited) if entry.modules else [],
            "audit_s": self.audit_s if entry.modules else 0.0,
            "seconds": time.perf_counter() - t0,
        }

    def _revert(self, entry: UndoEntry) -> None:
        live = self._live_params()
        for pname, pos, old in reversed(entry.writes):
            _write_as(self._target(pname, live), pos, old, self._ck(pname))
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
                    fp = sum(fingerprint_of(c, _read_as(t, p, ck)) for c, p in iter_chunks(block[None, :]))
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
        reload_names = sorted({n for m, ns in self.feeds.items() for n in ns if self._module_reloads(m)})
        if reload_names:
            self._capture(reload_names, source)
        self.undo.clear()
        self._check_reloaded(sorted(m for m in self.feeds if self._module_reloads(m)), 0)

    # ------------------------------------------------------------------------------- dispatch
    def handle(self, request: Mapping[str, Any]) -> dict:
        """Serve one request; never raises (errors are answers, so that every rank reports)."""
        op = request.get("op")
        try:
            if request.get("protocol") != PROTOCOL:
                raise WorkerOpError(f"protocol {request.get('protocol')!r} != worker protocol {PROTOCOL}")
            if op == "attach":
                self.max_undo = int(request.get("max_undo", DEFAULT_MAX_UNDO))
                src_path = request.get("source")
                src = self.open_source(src_path) if src_path else None
                specs = {n: (tuple(s), d) for n, (s, d) in request["specs"].items()}
                audit = str(request.get("audit", AUDIT_EVERY))
                result = self.attach(specs, src, audit=audit, repair=bool(request.get("repair", True)))
                return {"ok": True, "rank": self.rank, "result": result}
            if not self.attached:
                raise WorkerOpError("the worker is not attached; call attach first")
            mine = request.get("per_rank", {}).get(str(self.rank), [])
            if op == "gather":
                result = self.gather(mine)
            elif op == "apply":
                result = self.apply(str(request["token"]), mine)
            elif op == "undo":
                result = self.undo_token(str(request["token"]))
            elif op == "fingerprint":
                result = self.fingerprints(request.get("names"))
            elif op == "load":
                self.load(self.open_source(str(request["source"])))
                result = True
            elif op == "describe":
                result = self.describe()
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
                "error": f"{type(e).__name__}: {e}",
                "trace": traceback.format_exc(limit=6) if not isinstance(e, WorkerOpError) else "",
            }


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
        try:
            req = json.loads(request)
        except (TypeError, ValueError) as e:
            return json.dumps({"ok": False, "rank": core.rank, "error": f"request is not JSON: {e}"})
        return json.dumps(core.handle(req))

    def _flipsync_reload(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        runner = self.model_runner  # type: ignore[attr-defined]
        if not hasattr(runner, "reload_weights"):
            raise WorkerOpError("this vLLM has no layerwise reload (model_runner.reload_weights); upgrade vLLM")
        runner.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)

    def _flipsync_default_source(self) -> Mapping[str, torch.Tensor] | None:
        import os

        path = self.vllm_config.model_config.model  # type: ignore[attr-defined]
        return _open_checkpoint(path) if os.path.isdir(path) else None
