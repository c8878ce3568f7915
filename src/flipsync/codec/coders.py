"""The stream coder interface and registry: position and symbol coders, each a small class with a codec id,
``encode`` and a defensive ``decode`` (its bytes come from the network), named by id in a section's header.
See docs/codec.md ("Coding: pick the smallest per tensor").
"""

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


def positions_from_gaps(gaps: np.ndarray, numel: int) -> np.ndarray:
    """Inverse of :func:`position_gaps` for untrusted gaps: refuses positions at or past ``numel``."""
    n = gaps.size
    if n == 0:
        return np.empty(0, dtype=np.int64)
    # Check the sum before the int64 cumsum so that crafted gaps cannot wrap around.
    if int(gaps.max()) >= numel or float(gaps.astype(np.float64).sum()) + n > numel * 1.0001 + 1:
        raise CorruptPatchError(f"positions run past the end of a tensor of {numel} elements")
    positions = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if positions[-1] >= numel:
        raise CorruptPatchError(f"positions run past the end of a tensor of {numel} elements")
    return positions


class Coder(ABC):
    """A stream coder: a codec id (what a header names it by), ``encode`` and a defensive ``decode``.

    ``base``, where given, is state both sides hold (the base tensor's bits; see ``context``): a coder with
    ``needs_base`` is tried only when the encoder has it, and its streams decode only with it.
    """

    codec_id: ClassVar[str]
    needs_base: ClassVar[bool] = False

    def accepts(self, data: np.ndarray, base: Any = None) -> bool:
        """Whether this coder can code ``data`` at all (the encoder skips it otherwise)."""
        return True

    @abstractmethod
    def encode(self, data: np.ndarray, base: Any = None) -> tuple[Params, bytes]: ...

    def estimate(self, data: np.ndarray, base: Any = None) -> int | None:
        """The bytes ``encode(data, base)`` would return, or a close estimate of them, at a fraction of its cost;
        None where there is none (the registry then encodes). Called only where ``accepts`` is true."""
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
    """The coders a stream may use, by codec id, in the order the encoder tries them (ties go to the first).

    Immutable: a registry is built once from its coders; a new coder is a new entry in the tuple that builds it.
    """

    def __init__(self, what: str, *coders: C) -> None:
        self.what = what
        self._by_id: Mapping[str, C] = MappingProxyType({c.codec_id: c for c in coders})
        if len(self._by_id) != len(coders):
            raise ValueError(f"two {what} coders share a codec id")

    def __contains__(self, codec_id: object) -> bool:
        return codec_id in self._by_id

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

        Coding every candidate to keep one was most of the coding time, so candidates are coded in the order of
        their size estimates (those without one first), and the rest are skipped once their estimates exceed the
        smallest size coded so far by more than ``ESTIMATE_MARGIN`` (an exact estimate never skips the smallest;
        a sampled one may, by about that much). Ties among the coded ones go to the first listed.
        """
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
