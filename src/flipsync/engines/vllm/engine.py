"""The ``vllm`` engine's sidecar half: checkpoint coordinates, spoken to the workers' half
(:mod:`flipsync.engines.vllm.worker`) with JSON requests over ``collective_rpc``. See docs/engines.md ("One update").
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from flipsync.codec import ClassIndex, Patch
from flipsync.codec.bits import dtype_named, from_key, int_view, to_key
from flipsync.codec.fingerprint import FingerprintTable, TensorId, fingerprint_delta
from flipsync.engines.base import Engine, Staged, Undo
from flipsync.engines.host_copy import flush, write_safetensors
from flipsync.engines.tokenization import folder_tokenizer_digest
from flipsync.engines.vllm.blockmap import block_runs, lookup_blocks
from flipsync.engines.vllm.rpc_transports import RpcTransport
from flipsync.engines.vllm.tensor_specs import TensorSpec, specs_of
from flipsync.engines.vllm.wire import (
    AUDIT_EVERY,
    AUDIT_MODES,
    DEFAULT_MAX_UNDO,
    PROTOCOL,
    RELOAD,
    b64,
    bits_digest,
    readback_digest,
    unb64,
)
from flipsync.errors import (
    BaseMismatchError,
    ConfigError,
    EngineError,
    EngineUnavailableError,
    PatchError,
    VerificationError,
)

log = logging.getLogger(__name__)

__all__ = ["VllmEngine"]


Placement = tuple[str, np.ndarray]  # parameter name, blocks


@dataclass
class VllmStaged(Staged):
    """Writes of one patch per worker rank, and the fingerprints the view will have after them."""

    base_view: str
    target_view: str
    per_rank: dict[str, list[list[str]]]
    targets: dict[str, TensorId]
    n_changed: int
    # with a host copy: each changed tensor's positions, old bits and new bits, for the host copy's own commit
    host_copy_writes: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    positions: str = "int64"  # the dtype of the positions in ``per_rank``
    # per rank, the digest of its writes as it must read them back after the commit (`readback_digest`), computed
    # here so that the commit's pause does not decode its own request again
    readback: dict[str, str] = field(default_factory=dict)


@dataclass
class VllmUndo(Undo):
    token: str
    table_before: dict[str, TensorId] = field(default_factory=dict)
    host_copy_writes: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)


class VllmEngine(Engine[VllmStaged, VllmUndo]):
    """A vLLM engine whose served weights a sidecar keeps bitwise at a board version."""

    name: ClassVar[str] = "vllm"

    def __init__(
        self,
        transport: RpcTransport,
        specs: Mapping[str, TensorSpec],
        *,
        table: FingerprintTable | None = None,
        source: str | os.PathLike[str] | None = None,
        rpc_timeout_s: float = 120.0,
        host_copy: MutableMapping[str, torch.Tensor] | None = None,
        audit: str = AUDIT_EVERY,
        repair: bool = True,
    ) -> None:
        """Attach to the workers: they learn their maps (and capture repacked parameters from ``source``).

        ``table``: None recomputes it from the workers (O(size)). ``audit`` (``every``, ``sample``, ``off``) and
        ``repair``: the kernel-state audit, docs/engines.md#the-kernel-state-audit.
        """
        if not specs:
            raise ConfigError("no tensor specs: pass specs_of(view) or specs_from_checkpoint(model_dir)")
        if audit not in AUDIT_MODES:
            raise ConfigError(f"audit must be one of {', '.join(AUDIT_MODES)}, not {audit!r}")
        if host_copy is not None and specs_of(host_copy) != dict(specs):
            raise ConfigError(
                "the host copy does not hold the engine's tensors (names, shapes, dtypes): create it from the "
                "checkpoint the engine serves"
            )
        self._host_copy = host_copy
        self._host_copy_current = False  # whether the host copy holds what the workers serve
        self._index = ClassIndex()  # of the host copy, kept current with it: sparse ctx sections read only their blocks
        self._transport = transport
        self._specs = dict(specs)
        self._timeout = rpc_timeout_s
        self._source = source  # the model folder vLLM serves: its tokenizer is the engine's
        t0 = time.perf_counter()
        answers = self._call(
            {
                "op": "attach",
                "specs": {n: [list(s.shape), s.dtype] for n, s in self._specs.items()},
                "source": str(source) if source is not None else None,
                "max_undo": DEFAULT_MAX_UNDO,
                "audit": audit,
                "repair": repair,
            },
            900.0,
        )
        self.attach_s = time.perf_counter() - t0
        ranks = [str(a["rank"]) for a in answers]
        if len(set(ranks)) != len(ranks):
            raise ConfigError(
                f"several vLLM workers answered as the same rank ({ranks}); data-parallel engines are not supported: "
                "attach one VllmEngine per engine instance"
            )
        results = {str(a["rank"]): a["result"] for a in answers}
        self._maps: dict[str, dict[str, list[Placement]]] = {
            rank: {
                n: [(p, np.asarray(blocks, dtype=np.int64).reshape(-1, 6)) for p, blocks in places]
                for n, places in res["maps"].items()
            }
            for rank, res in results.items()
        }
        self.params: dict[str, dict[str, dict[str, Any]]] = {rank: res["params"] for rank, res in results.items()}
        self.audit = audit
        # per rank: the reload-mode layers compared with ``source`` at attach, what differed, and the time taken
        self.attach_audit: dict[str, dict[str, Any]] = {rank: res.get("audit", {}) for rank, res in results.items()}
        self.last_audit: dict[str, Any] = {}  # the last commit's: layers audited per rank, seconds (slowest rank)
        self.unheld = self._coverage({n: why for res in results.values() for n, why in res.get("unheld", {}).items()})
        self._table = table.copy() if table is not None else FingerprintTable()
        # Why the ranks hold no consistent view (None: they do); patches are refused until a full load.
        self._diverged: str | None = None
        if table is None:
            try:
                self._table = self.recompute_table()
            except VerificationError as e:
                # A commit that reached some ranks only (its sidecar killed before the undo): attach anyway,
                # so that the sidecar can resync the engine from a keyframe instead of failing to boot.
                self._diverged = str(e)
                self._table = self._recompute(strict=False)
                log.warning("vllm engine: the workers hold no consistent view (%s); a full load is needed", e)
        elif set(table) != set(self._specs):
            raise ConfigError("the fingerprint table does not describe the same tensors as the specs")
        stale = {
            f"rank {r} {m}": found for r, a in self.attach_audit.items() for m, found in a.get("mismatches", {}).items()
        }
        if stale and self._diverged is None:
            where, found = next(iter(stale.items()))
            self._diverged = (
                f"{len(stale)} layer(s) differ from a fresh load of the source checkpoint, e.g. {where}: {found[0]}"
            )
            log.warning("vllm engine: %s; patches are refused until a full load", self._diverged)
        if host_copy is not None:
            copied = FingerprintTable.of(host_copy).view_fp()
            self._host_copy_current = self._diverged is None and copied == self._table.view_fp()
            if not self._host_copy_current:
                log.warning(
                    "vllm engine: the host copy does not hold what the workers serve; patches coded against their "
                    "base are refused until the next full load"
                )
        log.info(
            "vllm engine attached: %d workers, %d tensors (%d not held), in %.1fs",
            len(self._maps),
            len(self._specs),
            len(self.unheld),
            self.attach_s,
        )

    # ------------------------------------------------------------------------------------ plumbing
    def _call(self, request: dict[str, Any], timeout_s: float | None = None) -> list[dict[str, Any]]:
        request = {"protocol": PROTOCOL, **request}
        answers = self._transport.call(request, timeout_s or self._timeout)
        if not answers:
            raise EngineUnavailableError("vLLM answered with no workers")
        failed = [a for a in answers if not a.get("ok")]
        if failed:
            detail = "; ".join(f"rank {a.get('rank')}: {a.get('error')}" for a in failed)
            if any(a.get("unknown") for a in failed):  # a worker could not undo: refuse patches until a full load
                self._diverged = f"a worker's weights are unknown after a failed {request['op']!r}"
            if any(a.get("stale_base") for a in failed):  # a worker held other bits than the host copy says
                self._host_copy_current = False
                detail += (
                    "; the host copy is no longer used (patches coded against their base wait for a full load; "
                    "others read the old bits from the workers)"
                )
            raise EngineError(f"vLLM workers failed {request['op']!r}: {detail}")
        return answers

    def _coverage(self, unheld: dict[str, str]) -> dict[str, str]:
        """Tensors the workers do not hold completely; checks that distinct held blocks never overlap."""
        out = dict(unheld)
        for name, spec in self._specs.items():
            if name in out:
                continue
            regions: set[tuple[int, int, int, int]] = set()
            for maps in self._maps.values():
                for _p, blocks in maps.get(name, []):
                    regions.update((int(b[0]), int(b[2]), int(b[3]), int(b[4])) for b in blocks)
            if not regions:
                out[name] = "no worker holds it"
                continue
            runs = block_runs(np.array([[c0, 0, ln, cnt, cs, 0] for c0, ln, cnt, cs in regions], dtype=np.int64))
            runs = runs[np.argsort(runs[:, 0], kind="stable")]
            ends = runs[:, 0] + runs[:, 1]
            if runs.shape[0] > 1 and bool((runs[1:, 0] < ends[:-1]).any()):
                raise EngineError(
                    f"workers hold overlapping but different blocks of {name!r}; its fingerprint cannot be "
                    "assembled (unsupported layout)"
                )
            held = int(runs[:, 1].sum())
            if held != spec.numel:
                out[name] = f"workers hold {held} of its {spec.numel} elements"
        for name, why in out.items():
            log.warning("vllm engine: tensor %r is not held by the engine (%s); patches to it are refused", name, why)
        return out

    # ------------------------------------------------------------------------------------- the port
    @property
    def table(self) -> FingerprintTable:
        return self._table

    @property
    def adoptable(self) -> bool:
        """Whether ``recompute_table`` reads what the kernels compute from: not with reload-mode (repacked)
        parameters, whose host copies describe ``source`` (docs/sidecar.md#adopt-on-boot)."""
        return (
            self._diverged is None
            and (self._host_copy is None or self._host_copy_current)
            and all(info["mode"] != RELOAD for params in self.params.values() for info in params.values())
        )

    @property
    def decodes_context(self) -> bool:
        return self._host_copy is not None

    @property
    def host_view(self) -> Mapping[str, torch.Tensor] | None:
        """The host_copy, while it holds what the workers serve; else None (see ``__init__``)."""
        return self._host_copy if self._host_copy_current else None

    def load_view(self, view: Mapping[str, torch.Tensor]) -> None:
        if specs_of(view) != self._specs:
            raise ConfigError(
                "the view does not have the tensors (names, shapes, dtypes) this engine was attached with"
            )
        with tempfile.TemporaryDirectory(prefix="flipsync-view-") as tmp:
            write_safetensors(view, Path(tmp) / "model.safetensors")  # one tensor in memory at a time
            self._call({"op": "load", "source": tmp}, max(self._timeout, 600.0))
        self._host_copy_current = False
        self._table = FingerprintTable.of(view)
        held = self.recompute_table()
        if held.view_fp() != self._table.view_fp():
            bad = sorted(n for n in held if held[n] != self._table[n])
            raise VerificationError(f"after loading the view the engine holds other bytes in {bad[:5]}")
        self._diverged = None
        if self._host_copy is not None:
            for name, t in view.items():
                self._host_copy[name].copy_(t.detach().cpu())
            flush(self._host_copy)
            self._host_copy_current = True
            self._index = ClassIndex()

    def stage(self, patch: Patch) -> VllmStaged:
        t_stage = time.perf_counter()
        if self._diverged is not None:
            raise BaseMismatchError(f"the workers hold no consistent view ({self._diverged}); load a full view first")
        for s in patch.sections:
            spec = self._specs.get(s.name)
            if spec is None:
                raise BaseMismatchError(f"the patch changes tensor {s.name!r}, which this engine does not serve")
            if spec.shape != tuple(s.shape) or spec.dtype != s.dtype:
                raise BaseMismatchError(
                    f"tensor {s.name!r} is {spec.shape} {spec.dtype}, the patch expects {tuple(s.shape)} {s.dtype}"
                )
        held = self._table.view_fp()
        if held != patch.header.base.view:
            raise BaseMismatchError(
                f"this patch applies to view {patch.header.base.view} (version {patch.header.base.version}), "
                f"but the engine holds view {held}; fetch the patches in between or resync from a keyframe"
            )
        for s in patch.sections:
            if s.name in self.unheld:
                raise EngineError(
                    f"the patch changes {s.name!r}, which the engine does not hold ({self.unheld[s.name]}); "
                    "serve the model so that every served tensor is loaded (e.g. untied embeddings)"
                )
        base = self.host_view
        if patch.needs_base and base is None:
            raise PatchError(
                "this patch codes positions against its base values ('ctx', from flipsync diff), which the vLLM "
                "engine's sidecar does not hold (they live in the workers): attach the engine with a host copy "
                "(VllmEngine(..., host_copy=...); the sidecar creates one unless told host_copy=none), publish with "
                "PublisherConfig(context=False), or rebuild it with diff_views(..., context=False)"
            )
        changes = {}
        for s in patch.sections:
            against = None
            if base is not None and patch.section_needs_base(s.name):
                d = dtype_named(s.dtype)
                against = self._index.base(
                    s.name, self._host_copy_bits(s.name, d.uint_numpy), d, self._table[s.name].fp
                )
            changes[s.name] = patch.change(s.name, against)
        # where each changed element lives, and who reports its old bits
        plans: dict[str, list[tuple[str, str, np.ndarray, np.ndarray]]] = {}
        reads: dict[str, list[tuple[str, np.ndarray]]] = {}
        read_slots: dict[str, list[tuple[str, np.ndarray]]] = {}
        checkpoint_pos = {name: ch.positions.astype(np.int64, copy=False) for name, ch in changes.items()}
        for name, pos in checkpoint_pos.items():
            covered = np.zeros(pos.size, dtype=bool)
            plan = []
            for rank in sorted(self._maps, key=int):
                for pname, blocks in self._maps[rank].get(name, []):
                    hit, ppos = lookup_blocks(blocks, pos)
                    if hit.size == 0:
                        continue
                    plan.append((rank, pname, hit, ppos))
                    first = ~covered[hit]
                    if first.any():
                        reads.setdefault(rank, []).append((pname, ppos[first]))
                        read_slots.setdefault(rank, []).append((name, hit[first]))
                        covered[hit] = True
            if not covered.all():
                raise EngineError(
                    f"{int((~covered).sum())} changed elements of {name!r} are held by no vLLM worker; "
                    "re-attach the engine (its map is stale)"
                )
            plans[name] = plan
        # positions go as int32 where every parameter position fits (the requests' bulk, halved)
        widest = max((int(pp.max()) for plan in plans.values() for *_, pp in plan if pp.size), default=0)
        positions = np.dtype(np.int32 if widest < 2**31 else np.int64)
        t_gather = time.perf_counter()
        if base is not None:
            # The host copy holds what the workers serve: the old bits come from it, with no round trip through a
            # busy engine; each write carries their digest, and a worker that holds other bits refuses it.
            old = {n: self._host_copy_bits(n, ch.dtype.uint_numpy)[checkpoint_pos[n]] for n, ch in changes.items()}
        else:
            old = self._gather(changes, reads, read_slots, positions)
        gather_s = time.perf_counter() - t_gather
        host_copy_writes: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        per_rank: dict[str, list[list[str]]] = {}
        readback: dict[str, list[tuple[str, np.ndarray, np.ndarray]]] = {}
        targets: dict[str, TensorId] = {}
        for name, ch in changes.items():
            new = from_key(ch.new_keys(to_key(old[name], ch.dtype)), ch.dtype)
            pos = checkpoint_pos[name]
            fp = (self._table[name].fp + fingerprint_delta(pos, old[name], new)) & ((1 << 64) - 1)
            for rank, pname, hit, ppos in plans[name]:
                write = [pname, b64(ppos.astype(positions)), b64(new[hit])]
                if base is not None:
                    write.append(bits_digest(old[name][hit]))
                per_rank.setdefault(rank, []).append(write)
                readback.setdefault(rank, []).append((pname, ppos, new[hit]))
            if base is not None:
                host_copy_writes[name] = (pos, old[name], new)
            targets[name] = TensorId(ch.dtype.name, ch.shape, fp)
        after = self._table.copy()
        after.update(targets)
        if after.view_fp() != patch.header.target.view:
            if base is not None:  # the host copy or the patch: the workers' own bits tell which
                held_old = self._gather(changes, reads, read_slots, positions)
                drifted = [n for n in changes if not np.array_equal(held_old[n], old[n])]
                if drifted:
                    self._host_copy_current = False
                    raise EngineError(
                        f"the host copy's {drifted[0]!r} differs from what the workers serve at the patch's changed "
                        "elements; it is no longer used (resync from a keyframe to refresh it)"
                    )
            raise VerificationError(
                f"applying this patch would give view {after.view_fp()}, not its target view "
                f"{patch.header.target.view}; the patch is corrupt or crafted (nothing was changed)"
            )
        log.info(
            "stage: %.3f s (old bits %s: %.3f s)",
            time.perf_counter() - t_stage, "from the host copy" if base is not None else "gathered", gather_s,
        )  # fmt: skip
        return VllmStaged(
            base_view=held,
            target_view=after.view_fp(),
            per_rank=per_rank,
            targets=targets,
            n_changed=sum(ch.n for ch in changes.values()),
            host_copy_writes=host_copy_writes,
            positions=positions.name,
            readback={rank: readback_digest(writes) for rank, writes in readback.items()},
        )

    def _gather(
        self,
        changes: Mapping[str, Any],
        reads: dict[str, list[tuple[str, np.ndarray]]],
        read_slots: dict[str, list[tuple[str, np.ndarray]]],
        positions: np.dtype,
    ) -> dict[str, np.ndarray]:
        """The bits the workers hold at each change's positions (one round trip)."""
        old = {name: np.zeros(ch.n, dtype=ch.dtype.uint_numpy) for name, ch in changes.items()}
        if reads:
            per_rank = {r: [[p, b64(pp.astype(positions))] for p, pp in rr] for r, rr in reads.items()}
            for a in self._call({"op": "gather", "per_rank": per_rank, "positions": positions.name}):
                for (name, hit), bits in zip(read_slots.get(str(a["rank"]), []), a["result"], strict=True):
                    old[name][hit] = unb64(bits, changes[name].dtype.uint_numpy)
        return old

    def commit(self, staged: VllmStaged) -> VllmUndo:
        if self._table.view_fp() != staged.base_view:
            raise BaseMismatchError("the engine's view changed since this patch was staged; stage it again")
        token = secrets.token_hex(8)
        t0, sent = time.perf_counter(), time.time()
        try:
            request = {"op": "apply", "token": token, "per_rank": staged.per_rank, "positions": staged.positions}
            answers = self._call(request)
            received = time.time()
            self._check_readback(answers, staged)
        except BaseException as e:
            try:
                self._call({"op": "undo", "token": token})  # the ranks that did write
            except Exception as undo_error:
                raise EngineUnavailableError(
                    f"commit failed ({e}) and the undo failed too ({undo_error}); the engine's weights are unknown: "
                    "audit with recompute_table or resync from a keyframe"
                ) from None
            if isinstance(e, EngineError | KeyboardInterrupt):
                raise
            raise EngineError(f"commit failed and was undone: {e}") from None
        self.last_audit = {
            "layers": {str(a["rank"]): a["result"].get("audited", []) for a in answers},
            "seconds": max(float(a["result"].get("audit_s", 0.0)) for a in answers),
            "reloaded": {str(a["rank"]): a["result"].get("reloaded", []) for a in answers},
            "rechecked": {str(a["rank"]): a["result"].get("rechecked", []) for a in answers},
            "apply_s": max(float(a["result"].get("seconds", 0.0)) for a in answers),
            "rpc_s": time.perf_counter() - t0,
            "legs_s": _legs(sent, received, answers),
        }
        a, legs = self.last_audit, self.last_audit["legs_s"]
        split = "to the workers {:.3f} s, in them {:.3f} s, back {:.3f} s".format(*legs) if legs else "legs unknown"
        log.info(
            "apply: %.3f s round trip (%s), %.3f s in the slowest worker's writes, reloads and audit (audit %.3f s "
            "of it), %d layer(s) reloaded",
            a["rpc_s"], split, a["apply_s"], a["seconds"], max((len(r) for r in a["reloaded"].values()), default=0),
        )  # fmt: skip
        undo = VllmUndo(token, {n: self._table[n] for n in staged.targets}, staged.host_copy_writes)
        self._table.update(staged.targets)
        self._write_host_copy(staged.host_copy_writes, new=True, fps=(undo.table_before, staged.targets))
        return undo

    @staticmethod
    def _check_readback(answers: list[dict[str, Any]], staged: VllmStaged) -> None:
        """Every written element as each worker read it back after the commit (reloads included) must be the
        bits staged against the patch's target: O(changed); the audit of in-place parameters."""
        for a in answers:
            got = a["result"].get("readback")
            if got is None:  # a worker of an older flipsync
                continue
            if got != staged.readback.get(str(a["rank"]), readback_digest([])):
                raise VerificationError(
                    f"rank {a['rank']} read back other bits than the patch's target after the commit; the commit "
                    "is undone (a write that did not land, or a reload that overwrote a parameter)"
                )

    def rollback(self, undo: VllmUndo) -> None:
        answers = self._call({"op": "undo", "token": undo.token})
        missing = [a["rank"] for a in answers if a["result"] is not True]
        if missing:
            raise EngineError(
                f"workers {missing} no longer keep the undo record of this commit (they keep the last few); "
                "resync from a keyframe"
            )
        committed = {n: self._table[n] for n in undo.table_before}
        self._table.update(undo.table_before)
        self._write_host_copy(undo.host_copy_writes, new=False, fps=(committed, undo.table_before))

    def recompute_table(self) -> FingerprintTable:
        return self._recompute(strict=True)

    def _recompute(self, *, strict: bool) -> FingerprintTable:
        """``strict=False``: where replicas disagree, the lowest rank's bytes count (a placeholder table)."""
        answers = self._call({"op": "fingerprint", "names": None}, max(self._timeout, 600.0))
        regions: dict[str, dict[tuple[int, int, int, int], tuple[str, str]]] = {}
        for a in answers:
            rank = str(a["rank"])
            for name, rows in a["result"].items():
                per = regions.setdefault(name, {})
                for pname, block, fp in rows:
                    key = (int(block[0]), int(block[2]), int(block[3]), int(block[4]))
                    if strict and key in per and per[key][0] != fp:
                        raise VerificationError(
                            f"replicas of {name!r} disagree: {per[key][1]} and rank {rank} {pname} hold different "
                            "bytes for the same elements; resync from a keyframe"
                        )
                    per.setdefault(key, (fp, f"rank {rank} {pname}"))
        table = FingerprintTable()
        for name, spec in self._specs.items():
            if name in self.unheld:
                if name not in self._table:
                    raise EngineError(f"tensor {name!r} is not held by the engine and has no tracked fingerprint")
                table[name] = self._table[name]
                continue
            total = sum(int(fp, 16) for fp, _ in regions.get(name, {}).values()) & ((1 << 64) - 1)
            table[name] = TensorId(dtype_named(spec.dtype).name, spec.shape, total)
        return table

    @cached_property
    def tokenizer_digest(self) -> str | None:
        """How the model folder vLLM serves tokenizes (`engines.tokenization`), worked out once."""
        return None if self._source is None else folder_tokenizer_digest(self._source)

    def health(self) -> bool:
        return self._transport.health()

    def close(self) -> None:
        if self._host_copy is not None:
            with contextlib.suppress(OSError, ValueError):
                flush(self._host_copy)
        self._transport.close()

    # ---------------------------------------------------------------------------------------- host_copy
    def _write_host_copy(
        self,
        writes: Mapping[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
        *,
        new: bool,
        fps: tuple[Mapping[str, TensorId], Mapping[str, TensorId]],
    ) -> None:
        """The new (or, undoing, the old) bits of a commit the workers took, into the host copy and its class index
        (``fps``: the tensors' fingerprints before and after)."""
        if self._host_copy is None or not writes:
            return
        try:
            for name, (pos, old, new_bits) in writes.items():
                was, now = (old, new_bits) if new else (new_bits, old)
                self._host_copy_bits(name, old.dtype)[pos] = now
                before, after = fps[0].get(name), fps[1].get(name)
                if before is None or after is None:
                    self._index.drop(name)
                else:
                    self._index.moved(name, pos, was, now, before.fp, after.fp)
            # no sync to disk per commit (the whole file, under the commit's pause): the mapping is shared, so a
            # restarted sidecar maps what was written; it syncs at close, and attach checks it against the workers
        except Exception as e:  # the workers hold the version; only the host copy is behind
            self._host_copy_current = False
            log.warning("vllm engine: could not update the host copy (%s); it is no longer used until a full load", e)

    def _host_copy_bits(self, name: str, bits: np.dtype) -> np.ndarray:
        """The host copy's tensor ``name`` as flat unsigned bit patterns (a view: writes reach the host copy)."""
        assert self._host_copy is not None
        return int_view(self._host_copy[name]).reshape(-1).numpy().view(bits)

    # ---------------------------------------------------------------------------------------- extras
    def _per_rank(self, op: str, modules: Sequence[str] | None) -> dict[str, Any]:
        answers = self._call({"op": op, "modules": list(modules) if modules is not None else None}, 600.0)
        return {str(a["rank"]): a["result"] for a in answers}

    def kernel_state(self, modules: Sequence[str] | None = None) -> dict[str, dict[str, dict[str, list[Any]]]]:
        """Per rank and module: digests of the tensors as the kernels hold them and of the kernel outputs on
        identity probes (reload-mode layers). A fresh engine started from the same version gives the same."""
        return self._per_rank("kernels", modules)

    def audit_now(self, modules: Sequence[str] | None = None) -> dict[str, dict[str, list[str]]]:
        """Compare reload-mode layers (default: all) with fresh loads of what the workers hold, now; per rank,
        what differs (empty: nothing)."""
        return self._per_rank("audit", modules)

    def modes(self) -> dict[str, str]:
        """Per vLLM parameter (rank 0): ``inplace`` or ``reload``, with the reason."""
        first = self.params[min(self.params, key=int)]
        return {p: f"{info['mode']}: {info['reason']}" for p, info in first.items()}


def _legs(sent: float, received: float, answers: list[dict[str, Any]]) -> tuple[float, float, float] | None:
    """A round trip split by the workers' wall clocks (entry and exit of their RPC method): the slowest worker's
    way in, time inside (decode included) and way back. None when a worker gave no clock (an older worker); on
    another host the split is only as good as the clocks' agreement."""
    clocks = [a.get("clock") for a in answers]
    if not all(isinstance(c, list) and len(c) == 2 for c in clocks):
        return None
    t_in = max(float(c[0]) for c in clocks)  # type: ignore[index]
    t_out = max(float(c[1]) for c in clocks)  # type: ignore[index]
    return max(0.0, t_in - sent), max(0.0, t_out - t_in), max(0.0, received - t_out)
