"""From a verified board step to one codec ``Patch`` the engine can stage.

A published version is a list of parts, each a codec patch file. One part is the common case. Several parts
are accepted in two shapes: a chain (each part starts where the previous one ends: squashed into one patch,
O(changed)), or disjoint shards that all start from the version's base view (e.g. one per trainer rank:
their sections are merged). Either way the result must go from the manifest's base view to its target view,
so a patch that disagrees with its (signed) manifest is refused before the engine sees it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from flipsync.codec import FingerprintTable, Patch, squash
from flipsync.domain.headers import ViewRef
from flipsync.domain.manifest import Manifest
from flipsync.errors import CorruptPatchError, PatchError

if TYPE_CHECKING:
    import torch


def patch_from_parts(
    parts: Sequence[bytes],
    manifest: Manifest,
    table: FingerprintTable | None = None,
    base: Mapping[str, torch.Tensor] | None = None,
) -> Patch:
    """One patch from ``manifest.base_view_fp`` to ``manifest.target_view_fp``; CorruptPatchError otherwise.

    ``table``: the engine's tensors. Every section must name one of them with its dtype and shape, checked
    before anything is decoded: squashing a chain decodes every part, and only real shapes bound what the
    counts a header declares would allocate.

    ``base``: the tensors the version applies to (the engine's view), needed to squash a chain of parts some
    of whose sections are coded against their base (``ctx``, a publisher with ``context=True``).
    """
    where = f"{manifest.kind.value} v{manifest.base_version}->v{manifest.target_version}"
    if not parts:
        raise CorruptPatchError(f"{where} has no parts")
    patches = [Patch.from_bytes(p) for p in parts]
    if table is not None:
        for patch in patches:
            _check_layout(patch, table, where)
    if len(patches) == 1:
        patch = patches[0]
    elif all(a.header.target.view == b.header.base.view for a, b in itertools.pairwise(patches)):
        if base is None and any(p.needs_base for p in patches):
            raise PatchError(
                f"{where}: its parts code positions against their base values (ctx), so joining them needs the "
                "tensors they apply to: pass the engine's view as base, or publish with PublisherConfig(context=False)"
            )
        try:
            patch = squash(patches, base=base)
        except PatchError as e:
            raise CorruptPatchError(f"{where}: its parts do not squash into one patch: {e}") from None
    elif all(p.header.base.view == manifest.base_view_fp for p in patches):
        patch = _merge_shards(patches, manifest, where)
    else:
        raise CorruptPatchError(f"{where}: its {len(patches)} parts neither form a chain nor share the base view")
    if patch.header.base.view != manifest.base_view_fp or patch.header.target.view != manifest.target_view_fp:
        raise CorruptPatchError(
            f"{where}: the patch goes from view {patch.header.base.view[:16]} to {patch.header.target.view[:16]}, "
            f"but its manifest says {str(manifest.base_view_fp)[:16]} to {manifest.target_view_fp[:16]}"
        )
    if patch.header.served_format is not None and patch.header.served_format != manifest.served_format:
        raise CorruptPatchError(
            f"{where}: the patch is {patch.header.served_format}, its manifest says {manifest.served_format}"
        )
    return patch


def _check_layout(patch: Patch, table: FingerprintTable, where: str) -> None:
    for s in patch.header.sections:
        tid = table.get(s.name)
        if tid is None or tid.dtype != s.dtype or tuple(tid.shape) != tuple(s.shape):
            have = "no such tensor" if tid is None else f"{tid.dtype} {list(tid.shape)}"
            raise CorruptPatchError(
                f"{where}: a part changes tensor {s.name!r} as {s.dtype} {list(s.shape)}, but the engine holds "
                f"{have} (a patch never changes layout: this one is for another model, or crafted)"
            )


def _merge_shards(patches: Sequence[Patch], manifest: Manifest, where: str) -> Patch:
    """Disjoint shards of one version: their sections side by side, named by the manifest's ends."""
    try:
        return Patch.merge_disjoint(
            patches,
            base=ViewRef(str(manifest.base_view_fp), manifest.base_version),
            target=ViewRef(manifest.target_view_fp, manifest.target_version),
            served_format=patches[0].header.served_format,
        )
    except PatchError as e:
        raise CorruptPatchError(f"{where}: {e}") from None
