"""The worker's kernel-state audit (part of `WorkerCore`): per kind of layer, whether the engine's reload is
faithful, repairs, refusals. The twins and probes are :mod:`flipsync.engines.vllm.kernels`."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from flipsync.engines.vllm.kernels import (
    ADOPTED,
    SAMPLE_ROWS,
    KernelHooks,
    compare,
    digest,
    fingerprint,
    module_tensors,
    state_tensors,
)
from flipsync.engines.vllm.map_learning import MapLearner, ParamInfo
from flipsync.engines.vllm.wire import AUDIT_EVERY, AUDIT_OFF, AuditError

# The worker's logger: what the audit reports is the worker's.
log = logging.getLogger("flipsync.engines.vllm.worker")

_KIND_UNKNOWN, _KIND_FAITHFUL, _KIND_REPAIRED = "unknown", "faithful", "repaired"
# A live layer's probes as taken before any twin: (rows probed or None for all, seed, label -> fingerprint).
Observed = tuple[int | None, int, dict[str, Any]]


class KernelAuditor(MapLearner):
    """The audit half of a worker core: twins of reloaded layers, compared with (or adopted by) the live ones."""

    rank: int
    hooks: KernelHooks
    params: dict[str, ParamInfo]
    feeds: dict[str, set[str]]
    audit: str
    repair: bool
    kinds: dict[str, str]
    _opaque: dict[str, bool]
    audit_s: float
    audited: list[str]
    _rng: random.Random
    holders: dict[str, set[str]]  # parameter -> every module holding it (vLLM's GLM router bias: gate and experts)
    _fresh: dict[str, dict[str, torch.Tensor]]  # module -> its non-checkpoint parameters and buffers at attach
    rechecked: list[str]
    _cursor: dict[str, int]  # kind -> how many of its layers ``sample`` has compared (the rotation's position)

    if TYPE_CHECKING:  # the rest of the worker core (WorkerCore)

        def _held_checkpoint(self, names: Iterable[str]) -> list[tuple[str, torch.Tensor]]: ...

        def _reloading(self) -> list[str]: ...

    def _snapshot_fresh(self) -> None:
        """Blind spot 3: the non-checkpoint parameters and buffers of every reload-mode layer as the engine's
        own fresh load left them (an attach that the audit then finds equal to a fresh load of ``source``), so
        that a twin takes these rather than the live values a broken reload may have changed."""
        self._fresh = {}
        for m in self._reloading():
            module = self.model.get_submodule(m)
            fed = {p.rpartition(".")[2] for p in self._members(m)}
            self._fresh[m] = {n: t.detach().clone() for n, t in module_tensors(module).items() if n not in fed}

    def _members(self, mname: str) -> set[str]:
        """The mapped parameters module ``mname`` holds, its own and those it shares with another module."""
        return {p for p, info in self.params.items() if info.module == mname or mname in self.holders.get(p, ())}

    def _attach_audit(self) -> dict[str, Any]:
        """Compare the reload-mode layers, as the engine loaded them at start, with twins loaded from the host
        copies (``source``): equal means the engine serves ``source`` and the twins are fresh loads. A
        mismatch is reported (the sidecar then refuses patches until a full load), not raised."""
        picked = self._pick(self._reloading()) if self.audit != AUDIT_OFF else []
        t0 = time.perf_counter()
        bad: dict[str, list[str]] = {}
        for m in picked:
            found = self._compare(m, self._twin(m), None if self.audit == AUDIT_EVERY else SAMPLE_ROWS)
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

    # ------------------------------------------------------------------------------- the audit
    def _kind(self, mname: str) -> str:
        return self.hooks.kind(self.model.get_submodule(mname))

    def _pick(self, modules: Sequence[str]) -> list[str]:
        """The layers an audit compares: all of them (``every``) or one of each kind (``sample``). Blind spot 4:
        a draw at random found a fault in one of a kind's n layers with chance 1/n per update, forever; the draw
        now walks each kind's layers in turn (from a random start), so every touched layer of a kind is compared
        within n updates that touch that kind."""
        if self.audit == AUDIT_EVERY:
            return list(modules)
        by_kind: dict[str, list[str]] = {}
        for m in modules:
            by_kind.setdefault(self._kind(m), []).append(m)
        picked = []
        for kind, ms in by_kind.items():
            ms = sorted(ms)
            if kind not in self._cursor:
                self._cursor[kind] = self._rng.randrange(len(ms))
            picked.append(ms[self._cursor[kind] % len(ms)])
            self._cursor[kind] += 1
        return sorted(picked)

    def _twin(self, mname: str) -> torch.nn.Module:
        """A fresh load of layer ``mname``: its checkpoint tensors (rebuilt from the held values) loaded into
        zeroed model-format scratch through the model's own loaders, then processed by the hooks' twin."""
        module = self.model.get_submodule(mname)
        members = self._members(mname)
        tensors = self._held_checkpoint(self._feeds_of({mname}))
        with self._buffers_guard(), self._swapped(members) as scratch:
            for name, t in tensors:
                self._load(name, t)
            loaded = {full.rpartition(".")[2]: s for full, s in scratch.items() if full in members}
        return self.hooks.twin(mname, module, loaded, self._fresh.get(mname, {}))

    def _feeds_of(self, modules: Iterable[str]) -> set[str]:
        """The checkpoint tensors that load into ``modules``, shared parameters included."""
        return {n for m in modules for n in self.feeds.get(m, ())}

    def _compare(self, mname: str, twin: torch.nn.Module, rows: int | None) -> list[str]:
        """What differs between layer ``mname`` as the kernels hold it now and its twin (empty: nothing)."""
        return self._against(mname, twin, self._observe(mname, rows))

    def _against(self, mname: str, twin: torch.nn.Module, seen: Observed) -> list[str]:
        """What differs between layer ``mname`` and its twin: their tensors now, the twin's probes against the live
        layer's as `_observe` took them (``seen``; in a reload's audit, before any twin was built)."""
        module = self.model.get_submodule(mname)
        bad = compare(state_tensors(module), state_tensors(twin))
        rows, seed, before = seen
        fresh = self.hooks.probe(mname, twin, rows, seed)
        if {label: fingerprint(t) for label, t in fresh.items()} == before:
            return bad
        now = compare(self.hooks.probe(mname, module, rows, seed), fresh, "probe ")
        return bad + (now or [f"probe {', '.join(sorted(before))} differed from a fresh load right after the "
                              "reload and no longer does: the kernel reads memory that has changed since (a "
                              "pointer into tensors the reload freed)"])  # fmt: skip

    def _observe(self, mname: str, rows: int | None) -> Observed:
        """Blind spot 8: the live layer's probes, fingerprinted, taken right after the reload and before any twin
        is built. A kernel that kept a pointer into tensors the reload freed (vLLM CPU's oneDNN INT8 handle reads
        its weight scales so) computes right whenever a twin loading the same values is given that freed
        memory, as the allocator does; a probe taken after the twin was built then passed such a kind as
        faithful, and its other layers were refused."""
        seed = self._rng.randrange(1 << 30)
        module = self.model.get_submodule(mname)
        return rows, seed, {label: fingerprint(t) for label, t in self.hooks.probe(mname, module, rows, seed).items()}

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
            faithful = [m for m in modules if self.kinds.get(self._kind(m)) == _KIND_FAITHFUL]
            chosen = self._pick(faithful) if self.audit != AUDIT_OFF and faithful else []
            repaired = [m for m in modules if self.kinds.get(self._kind(m)) == _KIND_REPAIRED]
            chosen_repaired = set(self._pick(repaired)) if self.audit != AUDIT_OFF and repaired else set()
            self.rechecked = []
            failures: list[str] = []
            compared = sorted(set(modules) - set(faithful) | set(chosen))
            seen: dict[str, Observed] = {}
            for m in compared:
                status = self.kinds.get(self._kind(m), _KIND_UNKNOWN)
                if status != _KIND_REPAIRED:  # (repaired layers take the twin's state whatever they hold)
                    full = status != _KIND_FAITHFUL or self.audit == AUDIT_EVERY
                    seen[m] = self._observe(m, None if full else SAMPLE_ROWS)
            for m in compared:
                kind = self._kind(m)
                status = self.kinds.get(kind, _KIND_UNKNOWN)
                twin = self._twin(m)
                self.audited.append(m)
                if status == _KIND_REPAIRED:  # the engine's path is known to fall short: take the fresh state
                    bad, _ = self._adopt(m, twin, opaque=self._opaque.get(kind, False))
                    if not bad and m in chosen_repaired:
                        # Blind spot 3: the layer was just compared with the twin it copied; the scheduled
                        # layers are compared with an independent fresh twin as well.
                        bad = self._compare(m, self._twin(m), None)
                        self.rechecked.append(m)
                    if not bad:
                        continue
                else:
                    bad = self._against(m, twin, seen[m])
                    if not bad:
                        self.kinds.setdefault(kind, _KIND_FAITHFUL)
                        continue
                if status == _KIND_UNKNOWN and self.repair:
                    # Only the kernel's outputs differ: its opaque state is at fault, and a tensor copy followed
                    # by a probe could again read freed memory that the twin holds (blind spot 8).
                    left, opaque = self._adopt(m, twin, opaque=all(b.startswith("probe ") for b in bad))
                    if not left:  # not only equal to the twin it copied: to an independent fresh load too
                        left = self._compare(m, self._twin(m), None)
                        self.rechecked.append(m)
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
        reloading = set(self._reloading())
        out: dict[str, dict[str, list[Any]]] = {}
        for mname, module in self.model.named_modules():
            if wanted is not None and mname not in wanted:
                continue
            # reload-mode layers with their method objects' state; others' plain attributes are runtime state
            # (an attention layer's KV cache)
            held = state_tensors(module) if mname in reloading else module_tensors(module)
            rows: dict[str, list[Any]] = {n: digest(t) for n, t in held.items()}
            if mname in reloading:
                for label, t in self.hooks.probe(mname, module, None, 0).items():
                    rows[f"probe {label}"] = digest(t)
            if rows:
                out[mname] = rows
        return out

    def audit_now(self, modules: Iterable[str] | None = None) -> dict[str, list[str]]:
        """Compare the named reload-mode layers (default: all) with twins of the held values, full probes."""
        names = sorted(modules) if modules is not None else self._reloading()
        return {m: found for m in names if (found := self._compare(m, self._twin(m), None))}
