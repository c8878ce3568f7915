"""`served_view`: a whole state dict of masters -> the checkpoint-format tensors an engine holds."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Literal

import torch

from flipsync.errors import ConfigError, FormatError
from flipsync.formats.base import ServedFormat, cast_master, tensor_amax
from flipsync.formats.registry import get_format

KeepFn = Callable[[str, torch.Tensor], bool]
# (shape, dtype, device) -> a tensor for a plain cast to write into, or None to allocate a new one.
Alloc = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor | None]
# (name, master, dtype, out) -> the plain cast `cast_master` gives (a publisher fuses it with its diff).
Cast = Callable[[str, torch.Tensor, torch.dtype, torch.Tensor | None], torch.Tensor]
# (format, name, master or prepared input, group amax, from_fp32) -> the components the format's recipe gives,
# or None to run the recipe (a publisher fuses some recipes with their diff).
Quantize = Callable[[ServedFormat, str, torch.Tensor, torch.Tensor | None, bool], dict[str, torch.Tensor] | None]
FusedGroups = Literal["auto"] | Sequence[Sequence[str]] | None

# Fused shards an engine loads into one parameter (qkv_proj, gate_up_proj / w13), in engine order.
_ROLES = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj"), "w13": ("w1", "w3")}
_FUSED_PATTERNS = {
    kind: re.compile(rf"^(?P<prefix>(?:.*\.)?)(?P<role>{'|'.join(roles)})\.weight$") for kind, roles in _ROLES.items()
}


def fused_groups_auto(names: Iterable[str]) -> list[list[str]]:
    """Fused groups found from Hugging Face parameter names: ``<p>.q_proj/k_proj/v_proj.weight``,
    ``<p>.gate_proj/up_proj.weight`` and ``<p>.w1/w3.weight`` of one prefix (MoE experts included). Groups keep
    engine order (q, k, v; gate, up), come in order of their first member, and have at least two members."""
    found: dict[tuple[str, str], dict[str, str]] = {}
    for name in names:
        for kind, pattern in _FUSED_PATTERNS.items():
            match = pattern.match(name)
            if match:
                found.setdefault((kind, match["prefix"]), {})[match["role"]] = name
                break
    return [
        [members[role] for role in _ROLES[kind] if role in members]
        for (kind, _prefix), members in found.items()
        if len(members) >= 2
    ]


def check_fused_groups(fused_groups: FusedGroups, names: Collection[str]) -> list[list[str]]:
    """`fused_groups` (``"auto"``: `fused_groups_auto`) as lists of names, each checked to be one of ``names``."""
    if fused_groups is None:
        return []
    if isinstance(fused_groups, str):
        if fused_groups != "auto":
            raise ConfigError(f"fused_groups must be 'auto', None or a list of name lists, not {fused_groups!r}")
        return fused_groups_auto(names)
    groups = []
    seen: set[str] = set()
    for group in fused_groups:
        if isinstance(group, str):
            raise ConfigError(
                f"fused_groups must be a list of name lists, but got the bare name {group!r}; wrap each group in a list"
            )
        for member in group:
            if member not in names:
                raise ConfigError(f"fused group member {member!r} is not a master tensor name")
            if member in seen:
                raise ConfigError(f"tensor {member!r} appears in more than one fused group")
            seen.add(member)
        groups.append(list(group))
    return groups


def served_view(
    masters: Mapping[str, torch.Tensor],
    fmt: str | ServedFormat,
    *,
    from_fp32: bool = False,
    fused_groups: FusedGroups = "auto",
    keep: KeepFn | None = None,
    alloc: Alloc | None = None,
    cast: Cast | None = None,
    quantize: Quantize | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint-format tensors an engine holds for `masters` under format `fmt`, by name (payload, then
    scales), in master order, each on its master's device; what is quantized: docs/formats.md ("Common rules").
    ``alloc``: where plain casts of fp32 masters write (reused buffers); ``cast`` / ``quantize``: what computes
    them instead of `cast_master` / the recipe (same bits and errors). ``dtypes``: tensors served by a plain
    cast to another dtype, never quantized."""
    f = get_format(fmt)
    kept_dtypes = _check_dtypes(dtypes, masters)
    selected = {
        name
        for name, tensor in masters.items()
        if tensor.is_floating_point()
        and f.selects(name, tensor)
        and not (keep is not None and keep(name, tensor))
        and name not in kept_dtypes
    }
    # restricted to the tensors being quantized
    groups = [
        g for group in check_fused_groups(fused_groups, masters) if len(g := [m for m in group if m in selected]) >= 2
    ]
    group_of = {member: i for i, group in enumerate(groups) for member in group} if f.uses_group_amax else {}
    group_amax: dict[int, torch.Tensor] = {}
    prepared: dict[str, torch.Tensor] = {}

    out: dict[str, torch.Tensor] = {}
    for name, tensor in masters.items():
        if tensor.is_complex():
            raise FormatError(f"tensor {name!r} is complex ({tensor.dtype}); served views hold real tensors only")
        if not tensor.is_floating_point():
            parts = {name: tensor}
        elif name in selected and f.quantized:
            amax = None
            if name in group_of:
                gid = group_of[name]
                if gid not in group_amax:
                    for member in groups[gid]:
                        prepared[member] = f.prepare(member, masters[member], from_fp32=from_fp32)
                    amaxes = [tensor_amax(prepared[member]).cpu() for member in groups[gid]]
                    group_amax[gid] = torch.stack(amaxes).amax()
                amax = group_amax[gid].to(tensor.device)
            ready = name in prepared
            x = prepared.pop(name) if ready else tensor
            got = quantize(f, name, x, amax, from_fp32) if quantize is not None else None
            if got is None:
                got = f.encode(name, x if ready else f.prepare(name, x, from_fp32=from_fp32), amax)
            parts = got
        else:  # a plain cast: every float tensor of bf16/fp16 views, the kept ones of quantized views
            dtype = kept_dtypes.get(name) or (f.payload_dtype if name in selected else f.unquantized_dtype)
            buf = alloc(tuple(tensor.shape), dtype, tensor.device) if alloc is not None else None
            value = (cast or cast_master)(name, tensor, dtype, buf)
            if value is tensor:  # an FP32 master served as FP32: never hand out the master itself
                value = value.clone()
            parts = {name: value}
        for key, value in parts.items():
            if key in out:
                raise ConfigError(
                    f"served name {key!r} (from master {name!r}) collides with another served tensor; "
                    "rename the master tensors"
                )
            out[key] = value
    return out


_PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SAFETENSORS_FLOATS = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def _check_dtypes(
    dtypes: Mapping[str, torch.dtype] | None, masters: Mapping[str, torch.Tensor]
) -> dict[str, torch.dtype]:
    if not dtypes:
        return {}
    for name, dtype in dtypes.items():
        if name not in masters:
            raise ConfigError(f"dtypes names {name!r}, which is not a master tensor")
        if dtype not in _PLAIN_DTYPES:
            raise ConfigError(
                f"dtypes gives {name!r} the dtype {dtype}; a tensor kept out of the format is served as one of "
                f"{', '.join(str(d) for d in _PLAIN_DTYPES)}"
            )
        if not masters[name].is_floating_point():
            raise ConfigError(f"dtypes names {name!r}, which is not a floating tensor")
    return dict(dtypes)


def checkpoint_dtypes(
    dtypes: Mapping[str, str | torch.dtype], fmt: str | ServedFormat, masters: Mapping[str, torch.Tensor]
) -> dict[str, torch.dtype]:
    """The ``dtypes`` argument of `served_view` that serves masters the way a checkpoint holds them (``dtypes``:
    name -> safetensors dtype name or torch dtype, e.g. from its headers): a tensor the checkpoint keeps in a
    plain float dtype other than the one the format gives it (FP32 norms beside BF16 weights), or unquantized
    where the format would quantize it, is served in the checkpoint's dtype."""
    f = get_format(fmt)
    out: dict[str, torch.dtype] = {}
    for name, tensor in masters.items():
        want = dtypes.get(name)
        d = want if isinstance(want, torch.dtype) else _SAFETENSORS_FLOATS.get(str(want))
        if d is None or not tensor.is_floating_point():
            continue
        quantized = f.quantized and f.selects(name, tensor)
        default = f.payload_dtype if not f.quantized else f.unquantized_dtype
        if quantized or d != default:
            out[name] = d
    return out


def dequantize_view(served: Mapping[str, torch.Tensor], fmt: str | ServedFormat) -> dict[str, torch.Tensor]:
    """Float32 values an engine computes from `served` (the output of `served_view`), by master name, for
    analysis tools and tests; non-floating tensors are returned as they are."""
    f = get_format(fmt)
    payloads: set[str] = set()
    consumed: set[str] = set()
    if f.quantized:
        for key, tensor in served.items():
            if tensor.dtype == f.payload_dtype and all(key + s in served for s in f.scale_suffixes):
                payloads.add(key)
                consumed.update(key + s for s in f.scale_suffixes)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in served.items():
        if key in consumed and key not in payloads:
            continue
        if key in payloads:
            out[key] = f.dequantize(key, {c: served[c] for c in f.component_names(key)})
        elif tensor.is_floating_point():
            out[key] = tensor.float()
        else:
            out[key] = tensor
    return out
