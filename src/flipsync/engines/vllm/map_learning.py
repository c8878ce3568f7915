"""How a worker learns its checkpoint-to-parameter map (a part of :class:`~flipsync.engines.vllm.worker.WorkerCore`):
probe tensors pushed through the model's own loaders into scratch, while every other parameter is a tripwire.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from flipsync.codec.bits import bits_numpy, dtype_named, dtype_of
from flipsync.engines.vllm.blockmap import (
    compress_map,
    digit_probe,
    exact_int_base,
    iter_chunks,
    probe_passes,
    read_as,
    widens,
    write_bits,
)
from flipsync.engines.vllm.scratch import ScratchFactory, tripwire
from flipsync.engines.vllm.wire import WorkerOpError

# Every parameter by its name in ``named_parameters``: (module name, module, attribute, tensor; None: dropped).
LiveParams = dict[str, tuple[str, torch.nn.Module, str, torch.Tensor | None]]


@dataclass
class ParamInfo:
    """A live parameter as the worker writes it: its module, ``mode`` (in place or through the reload path), why."""

    name: str
    module: str
    mode: str
    reason: str
    dtype: str
    shape: tuple[int, ...]


class MapLearner:
    """The map-learning half of a worker core: module tree, scratch swaps and the probe passes."""

    model: torch.nn.Module
    scratch: ScratchFactory
    specs: dict[str, tuple[tuple[int, ...], str]]
    _dropped: set[str]
    _probe_shapes: dict[str, tuple[tuple[int, ...], torch.dtype, torch.device]]

    # ------------------------------------------------------------------------------ module tree
    def _live_params(self) -> LiveParams:
        """Every parameter, and the ones the engine dropped (the kernel holds them elsewhere) whose model format
        is known."""
        out: LiveParams = {}
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
                found: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # param -> (positions, index so far)
                for k in range(probe_passes(numel, base)):
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
                        if k > 0 and not torch.equal(pos, found[pname][0]):
                            raise WorkerOpError(
                                f"loading {name!r} into {pname!r} is not a pure relayout (the written elements "
                                f"differ between probe passes); this parameter is not supported"
                            )
                        if pos.numel() == 0:
                            continue
                        digits = flat[pos].to(torch.float64) - 1
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
                if not np.array_equal(read_as(t, p, ck), src[c]):
                    raise WorkerOpError(f"loading {name!r} into {pname!r} does not copy bits exactly; not supported")
                write_bits(t, p, np.zeros(p.size, dtype=dtype_of(t).uint_numpy))
