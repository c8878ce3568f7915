"""The stream coder interface and registry (docs/codec.md, "Coding: pick the smallest per tensor")."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from flipsync.errors import CorruptPatchError

Params = dict[str, Any]
# CoderRegistry.encode codes a candidate only if its estimate is at most this times the smallest coding so far
# (plus ESTIMATE_SLACK bytes, for the few bytes an estimate of a small stream may be off by).
ESTIMATE_MARGIN = 1.01
ESTIMATE_SLACK = 16
# Values from which estimates are asked for: below, every candidate is coded, as the estimates (zstd has none
# below this either: its sample would be most of the values) cost about what they would save.
ESTIMATE_FROM = 1 << 14
# Status codes of the compiled unpackers.
OK, TRUNCATED, OVERFLOW, CORRUPT = 0, -1, -2, -3


def get_int(params: Params, key: str, allowed: set[int] | range) -> int:
    """An integer codec parameter from an untrusted header, checked against its allowed values."""
    v = params.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v not in allowed:
        raise CorruptPatchError(f"codec parameter {key}={v!r} is out of range")
    return v


def position_gaps(positions: np.ndarray) -> np.ndarray:
    """Sorted unique positions as the gaps between them (the first from -1), uint64."""
    gaps = np.diff(positions, prepend=-1) - 1
    if gaps.size and gaps.min() < 0:
        raise ValueError("positions must be sorted and unique")
    return gaps.astype(np.uint64)


class Coder(ABC):
    """A stream coder: a codec id (what a header names it by), ``encode`` and a defensive ``decode``.
    ``base``: state both sides hold (the base tensor's bits), which a coder with ``needs_base`` decodes with."""

    codec_id: ClassVar[str]
    needs_base: ClassVar[bool] = False

    def accepts(self, data: np.ndarray, base: Any = None) -> bool:
        """Whether this coder can code ``data`` at all (the encoder skips it otherwise)."""
        return True

    @abstractmethod
    def encode(self, data: np.ndarray, base: Any = None) -> tuple[Params, bytes]: ...

    def estimate(self, data: np.ndarray, base: Any = None) -> int | None:
        """About the length of ``encode(data, base)``'s bytes, at a fraction of its cost; None: no estimate."""
        return None


class SymbolCoder(Coder):
    """Codes a stream of unsigned symbols (uint64)."""

    @abstractmethod
    def decode(self, params: Params, blob: bytes, n: int) -> np.ndarray:
        """The n symbols (uint64)."""


class PositionCoder(Coder):
    """Codes a tensor's changed positions: sorted, unique int64 flat indices."""

    @abstractmethod
    def decode(self, params: Params, blob: bytes, n: int, numel: int, base: Any = None) -> np.ndarray:
        """The n sorted unique positions (int64), each below ``numel``."""


C = TypeVar("C", bound=Coder)


class CoderRegistry(Generic[C]):
    """The coders a stream may use, by codec id, in the order the encoder tries them (ties go to the first)."""

    def __init__(self, what: str, *coders: C) -> None:
        self.what = what
        self._by_id: Mapping[str, C] = MappingProxyType({c.codec_id: c for c in coders})
        if len(self._by_id) != len(coders):
            raise ValueError(f"two {what} coders share a codec id")

    def ids(self) -> tuple[str, ...]:
        return tuple(self._by_id)

    def coder(self, params: Params) -> C:
        """The coder a stream's params name; an unknown id is a corrupt (or newer) patch."""
        codec_id = params.get("codec")
        coder = self._by_id.get(codec_id) if isinstance(codec_id, str) else None
        if coder is None:
            raise CorruptPatchError(f"unknown {self.what} codec {codec_id!r}")
        return coder

    def encode(self, data: np.ndarray, base: Any = None) -> tuple[Params, bytes]:
        """The smallest coding among the coders that accept ``data``, its codec id recorded in its params.
        Candidates are coded in the order of their size estimates (those without one first), and the rest are
        skipped once their estimates exceed the smallest size so far by more than ``ESTIMATE_MARGIN``."""
        coders = [c for c in self._by_id.values() if c.accepts(data, base)]
        guesses: list[int | None] = [None] * len(coders)
        if data.size >= ESTIMATE_FROM and len(coders) > 1:
            guesses = [c.estimate(data, base) for c in coders]
        order = sorted(range(len(coders)), key=lambda i: (guesses[i] is not None, guesses[i] or 0, i))
        coded: list[tuple[int, Params, bytes]] = []
        for i in order:
            guess = guesses[i]
            smallest = min((len(b) for _, _, b in coded), default=None)
            if smallest is not None and guess is not None and guess > smallest * ESTIMATE_MARGIN + ESTIMATE_SLACK:
                break  # sorted by estimate: every later one is further off
            coded.append((i, *coders[i].encode(data, base)))
        i, params, blob = min(coded, key=lambda c: (len(c[2]), c[0]))
        return {"codec": coders[i].codec_id, **params}, blob
