"""A patch: its header (``flipsync.domain.headers``) and each changed tensor's coded streams, decoded on demand."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from functools import reduce
from operator import xor
from pathlib import Path

import torch

from flipsync.codec.container import RESERVED_NAMES, PatchFileWriter, read_container
from flipsync.codec.section import Base, TensorChange, decode_change, encode_change, needs_base
from flipsync.domain.headers import PatchHeader, SectionHeader, ViewRef
from flipsync.errors import BaseMismatchError, CorruptPatchError, PatchError

# What one decoded change holds in memory: an int64 position, an int64 value and a raw flag.
DECODED_BYTES_PER_CHANGE = 17
# Default cap on what decoding whole patches without their tensors (flipsync squash) may allocate. A header may
# declare up to 2**48 changes per tensor and the coded streams expand ~32,000x (zstd) or more (ans), so a
# small crafted file could otherwise ask for terabytes; apply bounds them by the real tensors instead.
DEFAULT_MAX_DECODED_BYTES = 8 << 30


class Patch:
    """A patch: its header plus the coded section streams, decoded on demand."""

    def __init__(
        self,
        header: PatchHeader,
        blobs: Mapping[str, bytes | memoryview],
        small: frozenset[str] | None = None,
        raw: memoryview | None = None,
    ) -> None:
        names = [s.name for s in header.sections]
        if len(set(names)) != len(names) or set(names) & set(RESERVED_NAMES):
            raise PatchError("a tensor name is used twice or reserved")
        self.header = header
        self._blobs = blobs
        self._sections = {s.name: s for s in header.sections}
        # Read from a file: its small sections are written back small (a grouped stream given back to its section
        # in a simpler code may have grown past OWN_TENSOR_BYTES), the file itself as it is (signed, recorded).
        self._small = small
        self._raw = raw

    @classmethod
    def from_changes(
        cls,
        changes: Iterable[TensorChange],
        *,
        base: ViewRef,
        target: ViewRef,
        served_format: str | None = None,
        meta: Mapping[str, str] | None = None,
        digest: str | None = None,
    ) -> Patch:
        """Code decoded changes (without a base: no ``ctx`` positions); empty changes are left out."""
        sections, blobs = [], {}
        for change in changes:
            if change.n:
                section, blobs[change.name] = encode_change(change)
                sections.append(section)
        return cls(PatchHeader(base, target, tuple(sections), served_format, dict(meta or {}), digest), blobs)

    @classmethod
    def merge_disjoint(
        cls, patches: Iterable[Patch], *, base: ViewRef, target: ViewRef, served_format: str | None = None
    ) -> Patch:
        """Shards of one version side by side, not decoded; a tensor may be in one shard only."""
        sections: list[SectionHeader] = []
        blobs: dict[str, bytes | memoryview] = {}
        digests: list[str | None] = []
        for p in patches:
            for s in p.sections:
                if s.name in blobs:
                    raise PatchError(f"tensor {s.name!r} appears in more than one shard")
                sections.append(s)
                blobs[s.name] = p._blobs[s.name]
            digests.append(p.header.digest)
        # Disjoint shards: the XOR of their combined digests is the digest of the union (combine_digests).
        digest = None if None in digests else f"{reduce(xor, (int(d, 16) for d in digests if d is not None), 0):032x}"
        return cls(PatchHeader(base, target, tuple(sections), served_format, digest=digest), blobs)

    @property
    def sections(self) -> tuple[SectionHeader, ...]:
        return self.header.sections

    def __len__(self) -> int:
        return len(self.header.sections)

    def section_bytes(self, name: str) -> int:
        return len(self._blobs.get(name, b""))

    def change(self, name: str, base: Base | None = None) -> TensorChange:
        """One tensor's change; ``base`` (the tensor it applies to) is needed for ``ctx``-coded positions."""
        return decode_change(self._sections[name], self.section_blob(name), base)

    def section_blob(self, name: str) -> bytes | memoryview:
        """The coded streams of one section, back to back (see ``section.split_streams``)."""
        if name not in self._blobs:
            raise CorruptPatchError(f"patch lacks the coded streams of tensor {name!r}")
        return self._blobs[name]

    def changes(self, base: Mapping[str, torch.Tensor] | None = None) -> Iterator[TensorChange]:
        """Every tensor's change, in header order; ``base``: the view the patch applies to (see ``change``)."""
        for s in self.header.sections:
            yield self.change(s.name, _base_tensor(base, s.name) if base is not None and needs_base(s) else None)

    @property
    def needs_base(self) -> bool:
        """Whether some section decodes only with its base tensor (``ctx`` positions)."""
        return any(needs_base(s) for s in self.header.sections)

    def section_needs_base(self, name: str) -> bool:
        return needs_base(self._sections[name])

    def decodable_alone(self, base: Mapping[str, torch.Tensor]) -> Patch:
        """This patch with every ``ctx`` section decoded against ``base`` (its view) and coded again without it."""
        sections, blobs = [], dict(self._blobs)
        for s in self.header.sections:
            if needs_base(s):
                s, blobs[s.name] = encode_change(self.change(s.name, _base_tensor(base, s.name)))
            sections.append(s)
        return Patch(replace(self.header, sections=tuple(sections)), blobs)

    def with_refs(self, *, base: ViewRef | None = None, target: ViewRef | None = None) -> Patch:
        """The same patch with its ends renamed (e.g. stamped with board version numbers)."""
        header = replace(self.header, base=base or self.header.base, target=target or self.header.target)
        return Patch(header, self._blobs, self._small)

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self._blobs.values())

    def to_bytes(self) -> bytes:
        """The patch file (for a patch read from a file: that file)."""
        if self._raw is not None:
            return bytes(self._raw)
        writer = PatchFileWriter()
        small = self._small
        data = [
            writer.add(s.name, self._blobs[s.name], None if small is None else s.name in small)
            for s in self.header.sections
        ]
        head, tail = writer.finish(self.header)
        return b"".join([head, *(d for d in data if d is not None), tail])

    def save(self, path: str | Path) -> None:
        Path(path).write_bytes(self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Patch:
        view = memoryview(data)
        header, blobs, small = read_container(view)
        return cls(header, blobs, small, view)

    @classmethod
    def load(cls, path: str | Path) -> Patch:
        try:
            data = Path(path).read_bytes()
        except OSError as e:
            raise PatchError(f"cannot read patch {path}: {e.strerror}") from None
        return cls.from_bytes(data)


def _base_tensor(base: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in base:
        raise BaseMismatchError(f"the patch changes tensor {name!r}, which the base does not hold")
    return base[name]


def check_decoded_size(patches: Iterable[Patch], max_bytes: int = DEFAULT_MAX_DECODED_BYTES) -> None:
    """Refuse, before anything is decoded, patches whose declared changes would take more than ``max_bytes``."""
    patches = list(patches)
    n = sum(p.header.n_changed for p in patches)  # declared counts: nothing is decoded
    total = n * DECODED_BYTES_PER_CHANGE
    if total > max_bytes:
        raise CorruptPatchError(
            f"the patch{'es' if len(patches) > 1 else ''} declare{'' if len(patches) > 1 else 's'} {n:,} changed "
            f"values, {total / (1 << 30):,.1f} GiB once decoded, more than the limit of "
            f"{max_bytes / (1 << 30):g} GiB: a crafted or corrupt patch, or a chain too large for this limit "
            "(if the patches are genuine, raise it: flipsync squash --max-decoded-gib N, or max_decoded_bytes)"
        )
