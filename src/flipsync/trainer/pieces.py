"""What each rank serves: its model's masters -> checkpoint-format *pieces* of the served view, planned once
from every rank's master list (`plan_view`). See docs/trainer.md ("Sharded training").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from flipsync.codec import Changes
from flipsync.codec.bits import dtype_of
from flipsync.errors import ConfigError, PatchError
from flipsync.formats import get_format, served_view
from flipsync.formats.base import ServedFormat, cast_master
from flipsync.formats.cast_diff import CastDiffer
from flipsync.formats.view import Alloc, Cast, FusedGroups, check_fused_groups

KeepFn = Callable[[str, torch.Tensor], bool]
StateSource = torch.nn.Module | Callable[[], Mapping[str, torch.Tensor]]
MasterKind = Literal["plain", "piece", "gather"]


@dataclass(frozen=True)
class Piece:
    """Elements ``offset .. offset + tensor.numel()`` of the flattened served tensor of full ``shape``."""

    tensor: torch.Tensor
    offset: int
    shape: tuple[int, ...]

    @property
    def whole(self) -> bool:
        return self.offset == 0 and self.tensor.numel() == math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def dtype_name(self) -> str:
        return dtype_of(self.tensor).name

    def spec(self, name: str, rank: int) -> PieceSpec:
        return PieceSpec(name, self.dtype_name, self.shape, self.offset, self.tensor.numel(), rank)


LocalView = dict[str, Piece]


def view_bytes(view: Mapping[str, Piece]) -> int:
    return sum(p.nbytes for p in view.values())


@dataclass(frozen=True)
class PieceSpec:
    """Where one piece lives (the layout every rank agrees on at the start)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    rank: int


@dataclass(frozen=True)
class FusedDiff:
    """Changes found while a view was computed (`Fuse`) against the view of the item whose token is ``base``;
    the worker uses them only when that view is the base it diffs against."""

    base: object
    changes: dict[str, Changes]


@dataclass
class Fuse:
    """Casts and quantizations that diff against a previous view as they run (`flipsync.formats.cast_diff`);
    pieces whose previous piece lies elsewhere (another offset, layout or device) are diffed later."""

    caster: CastDiffer
    ref: LocalView
    found: dict[str, Changes] = field(default_factory=dict)

    def hook(self, offset: int) -> Cast:
        """The `served_view` cast hook for pieces starting at flat element ``offset``."""

        def cast(name: str, master: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
            prev = self.ref.get(name)
            where = (offset, dtype, master.device, master.shape)
            if prev is None or (prev.offset, prev.tensor.dtype, prev.tensor.device, prev.tensor.shape) != where:
                return cast_master(name, master, dtype, out)
            new, self.found[name] = self.caster.cast_diff(name, master, dtype, prev.tensor, out)
            return new

        return cast

    def quantize(
        self, f: ServedFormat, name: str, x: torch.Tensor, group_amax: torch.Tensor | None, from_fp32: bool
    ) -> dict[str, torch.Tensor] | None:
        """The `served_view` quantize hook (whole tensors): quantized payloads diffed as made."""
        prev = self.ref.get(name)
        if prev is None or prev.offset != 0:
            return None
        got = self.caster.quantize_diff(f.name, name, x, prev.tensor, group_amax, from_fp32=from_fp32)
        if got is None:
            return None
        parts, self.found[name] = got
        return parts


@dataclass(frozen=True)
class MasterInfo:
    """What one rank holds of one master, sent to every rank to plan who serves what."""

    kind: MasterKind
    nbytes: int


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def _alias_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    local = _local(t)
    if local.device.type == "meta" or local.numel() == 0:
        return None
    return (
        local.device,
        local.untyped_storage().data_ptr(),
        local.storage_offset(),
        tuple(local.shape),
        local.stride(),
        local.dtype,
    )


def state_of(source: StateSource) -> Mapping[str, torch.Tensor]:
    """The named masters of a model (``state_dict()``) or of any callable returning them."""
    return source.state_dict() if isinstance(source, torch.nn.Module) else source()


def tied_targets(model: StateSource) -> set[str]:
    """State-dict names Hugging Face drops from checkpoints because they alias another tensor."""
    out: set[str] = set()
    if not isinstance(model, torch.nn.Module):
        return out
    for prefix, module in model.named_modules():
        keys = getattr(module, "_tied_weights_keys", None)
        if not keys:
            continue
        names = keys.keys() if isinstance(keys, Mapping) else keys  # transformers 5: {target: source}
        for key in names:
            if isinstance(key, str):
                out.add(f"{prefix}.{key}" if prefix else key)
    return out


def dedupe_tied(
    state: Mapping[str, torch.Tensor], drop_first: set[str] | frozenset[str] = frozenset()
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(masters without aliases, {alias: kept name}). Of names that share one tensor the first is kept, unless
    Hugging Face drops it (``drop_first``) and not another: so ``model.embed_tokens.weight`` is served and
    ``lm_head.weight`` is its alias, as in a checkpoint of a tied model."""
    groups: dict[tuple[Any, ...], list[str]] = {}
    order: list[str] = []
    for name, t in state.items():
        key = _alias_key(t)
        if key is None or key not in groups:
            order.append(name)
        if key is not None:
            groups.setdefault(key, []).append(name)
    aliases: dict[str, str] = {}
    rename: dict[str, str] = {}
    for names in groups.values():
        if len(names) < 2:
            continue
        kept = next((n for n in names if n not in drop_first), names[0])
        for n in names:
            if n != kept:
                aliases[n] = kept
        rename[names[0]] = kept
    masters = {rename.get(n, n): state[rename.get(n, n)] for n in order}
    return masters, aliases


def _castable(f: ServedFormat, name: str, t: torch.Tensor, keep: KeepFn | None) -> bool:
    """True when the recipe for this tensor is an element-wise cast, so a row shard serves its own rows."""
    if not t.is_floating_point():
        return False
    if not f.quantized:
        return True
    return not f.selects(name, t) or (keep is not None and keep(name, t))


def _row_shard(t: torch.Tensor) -> int | None:
    """The shard index of a DTensor ``Shard(0)`` on a 1-D mesh, else None."""
    from torch.distributed.tensor import Shard

    placements = t.placements  # type: ignore[attr-defined]
    mesh = t.device_mesh  # type: ignore[attr-defined]
    if mesh.ndim != 1 or len(placements) != 1 or placements[0] != Shard(0) or t.dim() == 0:
        return None
    coord = mesh.get_coordinate()
    return None if coord is None else int(coord[0])


def master_infos(masters: Mapping[str, torch.Tensor], fmt: str, keep: KeepFn | None) -> dict[str, MasterInfo]:
    """How this rank holds each master (see the module doc)."""
    f = get_format(fmt)
    out: dict[str, MasterInfo] = {}
    for name, t in masters.items():
        kind: MasterKind = "plain"
        if _is_dtensor(t) and not all(p.is_replicate() for p in t.placements):  # type: ignore[attr-defined]
            piece = _row_shard(t) is not None and _castable(f, name, t, keep)
            kind = "piece" if piece else "gather"
        out[name] = MasterInfo(kind, t.numel() * t.element_size())
    return out


@dataclass
class ViewPlan:
    """This rank's part of serving the model; the same plan is derived on every rank."""

    fmt: str
    from_fp32: bool
    keep: KeepFn | None
    dtypes: Mapping[str, torch.dtype]  # tensors served in their own plain dtype (see `served_view`)
    order: list[str]  # every master name, in state-dict order (without aliases)
    aliases: dict[str, str]
    drop_first: set[str]
    owned: list[str]  # masters this rank serves whole
    pieces: list[str]  # masters this rank serves as its own row shard
    gathered: list[str]  # DTensor masters every rank gathers each step (owned by one)
    groups: list[list[str]] | None  # fused groups among `owned` (formats with a shared scale)
    owners: dict[str, int] = field(default_factory=dict)

    def masters(self, model: StateSource) -> dict[str, torch.Tensor]:
        """The model's current masters by name, checked against the plan (no tensor added or removed)."""
        state = state_of(model)
        masters, aliases = dedupe_tied(state, self.drop_first)
        if list(masters) != self.order or aliases != self.aliases:
            added = sorted(set(masters) - set(self.order))
            gone = sorted(set(self.order) - set(masters))
            raise PatchError(
                f"the model's tensors changed since the publisher started (added: {added[:5]}, removed: "
                f"{gone[:5]}, tied: {sorted(aliases.items())[:3]} vs {sorted(self.aliases.items())[:3]}); "
                "a patch cannot add or remove tensors: call publisher.snapshot() to publish a full view, "
                "or start a new run"
            )
        return masters

    def gather(self, masters: Mapping[str, torch.Tensor]) -> Inputs:
        """What this rank serves from (training thread: ``full_tensor()`` of gathered DTensors is a collective);
        references to the live masters, valid until they change again (the next optimizer step)."""
        whole: dict[str, torch.Tensor] = {}
        owned = set(self.owned)
        for name in self.gathered:  # every rank takes part, in the same order
            full = masters[name].full_tensor()  # type: ignore[attr-defined]
            if name in owned:
                whole[name] = full
        for name in self.owned:
            if name not in whole:
                whole[name] = _local(masters[name])
        rows = []
        for name in self.pieces:
            t = masters[name]
            local = _local(t)
            rows.append((name, local, _row_offset(name, t, local), tuple(t.shape)))
        return Inputs(whole, rows)

    def compute(self, inputs: Inputs, alloc: Alloc | None = None, fuse: Fuse | None = None) -> LocalView:
        """This rank's served pieces from `gather`'s inputs (torch ops on their devices; any thread);
        ``alloc`` gives plain casts their output buffers (see `served_view`), ``fuse`` diffs them as they run."""
        out: LocalView = {}
        if inputs.whole:
            served = served_view(
                inputs.whole,
                self.fmt,
                from_fp32=self.from_fp32,
                fused_groups=self.groups,
                keep=self.keep,
                dtypes={n: d for n, d in self.dtypes.items() if n in inputs.whole},
                alloc=alloc,
                cast=fuse.hook(0) if fuse is not None else None,
                quantize=fuse.quantize if fuse is not None else None,
            )
            held = _storages(inputs.whole.values())
            for key, t in served.items():
                out[key] = Piece(_own(t, held), 0, tuple(t.shape))
        for name, local, offset, shape in inputs.rows:
            hook = fuse.hook(offset) if fuse is not None else None
            dtype = {name: self.dtypes[name]} if name in self.dtypes else None
            cast = served_view(
                {name: local},
                self.fmt,
                fused_groups=None,
                keep=lambda _n, _t: True,
                dtypes=dtype,
                alloc=alloc,
                cast=hook,
            )[name]
            out[name] = Piece(_own(cast, _storages([local])), offset, shape)
        return out


@dataclass
class Inputs:
    """The tensors one step's served view is computed from (see `ViewPlan.gather`)."""

    whole: dict[str, torch.Tensor]  # masters this rank serves whole
    rows: list[tuple[str, torch.Tensor, int, tuple[int, ...]]]  # (name, local rows, flat offset, full shape)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.whole.values(), *(local for _, local, _, _ in self.rows)]


def _storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


def _own(t: torch.Tensor, held: set[int]) -> torch.Tensor:
    """A tensor the optimizer cannot change later: served_view returns non-float masters as they are."""
    t = t.contiguous()
    return t.clone() if t.numel() and t.untyped_storage().data_ptr() in held else t


def _row_offset(name: str, t: torch.Tensor, local: torch.Tensor) -> int:
    """Flat offset of this rank's rows (torch.chunk rule: ceil(N / W) rows per shard, the last ones short)."""
    index = _row_shard(t)
    assert index is not None
    n = t.shape[0]
    chunk = -(-n // t.device_mesh.size())  # type: ignore[attr-defined]
    start = min(index * chunk, n)
    rows = max(0, min(chunk, n - start))
    if tuple(local.shape) != (rows, *t.shape[1:]):
        raise ConfigError(
            f"DTensor {name!r} (shape {tuple(t.shape)}) holds local rows {tuple(local.shape)} on shard {index}, "
            f"not the torch.chunk split ({rows} rows); uneven custom sharding is not supported"
        )
    return start * math.prod(t.shape[1:])


def plan_view(
    *,
    rank: int,
    infos: Sequence[Mapping[str, MasterInfo]],
    order: list[str],
    aliases: dict[str, str],
    drop_first: set[str],
    fmt: str,
    from_fp32: bool,
    keep: KeepFn | None,
    fused_groups: FusedGroups,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> ViewPlan:
    """Decide who serves what from every rank's `master_infos` (identical inputs give identical plans)."""
    world = len(infos)
    kinds: dict[str, MasterKind] = {}
    holders: dict[str, list[int]] = {}
    for r, info in enumerate(infos):
        for name, mi in info.items():
            if name in kinds and kinds[name] != mi.kind:
                raise ConfigError(
                    f"master {name!r} is a {kinds[name]} tensor on one rank and a {mi.kind} tensor on rank {r}; "
                    "every rank must hold a tensor the same way"
                )
            kinds[name] = mi.kind
            holders.setdefault(name, []).append(r)
    sizes = {name: mi.nbytes for info in infos for name, mi in info.items()}
    for name, kind in kinds.items():
        if kind in ("piece", "gather") and len(holders[name]) != world:
            raise ConfigError(f"DTensor {name!r} is not held by every rank; the publisher spans the whole world")
    # Fused groups (formats with a shared scale) must be served by one rank. Row-shard members are cast, not
    # quantized: served_view leaves them out of their group too.
    shared_scale = get_format(fmt).uses_group_amax
    resolved = check_fused_groups(fused_groups, kinds) if shared_scale else []
    groups = [g for group in resolved if len(g := [m for m in group if kinds[m] != "piece"]) >= 2]
    grouped = {m for g in groups for m in g}
    # the units served whole, each by one rank: fused groups, then every other master that is not a row piece
    whole = dict.fromkeys(n for info in infos for n in info if kinds[n] != "piece" and n not in grouped)
    owners: dict[str, int] = {}
    load = [0] * world
    for unit in sorted([*groups, *([n] for n in whole)], key=lambda u: (-sum(sizes[m] for m in u), u[0])):
        candidates = [r for r in range(world) if all(r in holders[m] for m in unit)]
        if not candidates:
            raise ConfigError(
                f"the fused group {unit} is split across ranks; its shared scale needs every member on one rank"
            )
        owner = min(candidates, key=lambda r: (load[r], r))
        load[owner] += sum(sizes[m] for m in unit)
        for m in unit:
            owners[m] = owner
    owned = [n for n in order if owners.get(n) == rank]
    mine = set(owned)
    return ViewPlan(
        fmt=fmt,
        from_fp32=from_fp32,
        keep=keep,
        dtypes=dict(dtypes or {}),
        order=order,
        aliases=aliases,
        drop_first=drop_first,
        owned=owned,
        pieces=[n for n in order if kinds.get(n) == "piece"],
        gathered=[n for n in order if kinds.get(n) == "gather"],
        groups=[g for g in groups if g[0] in mine] if shared_scale else None,
        owners=owners,
    )


def check_layout(view: Mapping[str, Piece], expected: Mapping[str, PieceSpec]) -> None:
    """A patch changes values, never layout: refuse a piece whose dtype, shape or place moved."""
    if set(view) != set(expected):
        added, gone = sorted(set(view) - set(expected)), sorted(set(expected) - set(view))
        raise PatchError(
            f"the served view's tensors changed (added: {added[:5]}, removed: {gone[:5]}); a patch cannot add "
            "or remove tensors: call publisher.snapshot() to publish a full view, or start a new run"
        )
    for name, p in view.items():
        e = expected[name]
        if (p.dtype_name, p.shape, p.offset, p.tensor.numel()) != (e.dtype, e.shape, e.offset, e.numel):
            raise PatchError(
                f"served tensor {name!r} changed layout from {e.shape} {e.dtype} to {p.shape} {p.dtype_name} "
                f"(a parameter changed shape or dtype); a patch cannot change layout: call "
                "publisher.snapshot() to publish a full view at the next version, or start a new run"
            )
