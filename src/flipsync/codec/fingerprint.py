"""Proof that a replica holds exactly the target bytes (docs/codec.md, "Verification"): content digests
(xxh3-128), fingerprints that a patch updates in O(changed), and the view fingerprint."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass

import numba
import numpy as np
import torch
import xxhash

from flipsync.codec.bits import bits_numpy, dtype_of
from flipsync.codec.jit import kernel

MASK64 = (1 << 64) - 1  # fingerprints are sums mod 2**64
DIGEST_CHUNK = 64 << 20
_FP_CHUNK = 1 << 24  # elements per fingerprint task
FP_SEED = np.uint64(0x9E3779B97F4A7C15)  # added to each position before it is hashed


@numba.njit(inline="always")
def fmix64(x: np.uint64) -> np.uint64:
    """MurmurHash3's 64-bit finalizer: the mixing step of every element's fingerprint hash."""
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xFF51AFD7ED558CCD)
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xC4CEB9FE1A85EC53)
    x ^= x >> np.uint64(33)
    return x


@kernel
def _fingerprint_dense(bits: np.ndarray, start: int) -> np.uint64:
    acc = np.uint64(0)
    for j in range(bits.shape[0]):
        acc += fmix64(fmix64(np.uint64(start + j) + FP_SEED) ^ np.uint64(bits[j]))
    return acc


@kernel
def _fingerprint_sparse(positions: np.ndarray, bits: np.ndarray) -> np.uint64:
    acc = np.uint64(0)
    for j in range(positions.shape[0]):
        acc += fmix64(fmix64(np.uint64(positions[j]) + FP_SEED) ^ np.uint64(bits[j]))
    return acc


@kernel
def _fingerprint_delta(positions: np.ndarray, old: np.ndarray, new: np.ndarray) -> np.uint64:
    acc = np.uint64(0)
    for j in range(positions.shape[0]):
        h = fmix64(np.uint64(positions[j]) + FP_SEED)  # the position's hash, shared by both terms
        acc += fmix64(h ^ np.uint64(new[j])) - fmix64(h ^ np.uint64(old[j]))
    return acc


def fingerprint_of(positions: np.ndarray, bits: np.ndarray) -> int:
    """The fingerprint contribution of the given elements (positions int64, bits unsigned)."""
    return int(_fingerprint_sparse(positions.astype(np.int64, copy=False), bits.astype(np.uint64)))


def fingerprint_delta(positions: np.ndarray, old: np.ndarray, new: np.ndarray) -> int:
    """``fingerprint_of(positions, new) - fingerprint_of(positions, old)`` mod 2**64, in one pass."""
    if not (positions.shape == old.shape == new.shape):
        raise ValueError("positions, old and new bits must have one length")
    return int(_fingerprint_delta(positions.astype(np.int64, copy=False), old, new))


def fp_hex(fp: int) -> str:
    return f"{fp & MASK64:016x}"


def combine_digests(named: Iterable[tuple[str, str]]) -> str:
    """One digest for a set of (tensor name, content digest) pairs: the XOR of xxh3-128(name NUL digest).
    Order-free, so the combined digests of disjoint sets (one per trainer rank's shard) XOR into their union's."""
    acc = 0
    for name, digest in named:
        acc ^= xxhash.xxh3_128_intdigest(name.encode() + b"\0" + bytes.fromhex(digest))
    return f"{acc:032x}"


def _chunks(n: int, step: int) -> Iterator[tuple[int, int]]:
    for s in range(0, n, step):
        yield s, min(n, s + step)


class Hasher:
    """Computes fingerprints and content digests of tensors on a shared thread pool."""

    def __init__(self, threads: int | None = None) -> None:
        self._pool = ThreadPoolExecutor(max(1, threads or os.cpu_count() or 1), thread_name_prefix="flipsync-hash")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fingerprint(self, t: torch.Tensor, offset: int = 0) -> int:
        """The additive fingerprint of ``t``'s elements; ``offset``: their flat position in the whole tensor, for a
        piece of one (the pieces' fingerprints sum to the tensor's)."""
        bits = bits_numpy(t.detach().contiguous())
        parts = self._pool.map(
            lambda se: int(_fingerprint_dense(bits[se[0] : se[1]], offset + se[0])), _chunks(bits.size, _FP_CHUNK)
        )
        return sum(parts) & MASK64

    # The arg-type ignores below: numpy's stubs give ndarray a __buffer__ only on Python >= 3.12, so
    # xxhash's Buffer parameters reject it on 3.11 (it is a buffer at runtime).

    def digest(self, t: torch.Tensor) -> str:
        """xxh3-128 of the bytes; tensors over one chunk hash the concatenated chunk digests."""
        if t.numel() * t.element_size() > DIGEST_CHUNK:
            return self.digest_soon(t)()
        return xxhash.xxh3_128_hexdigest(bits_numpy(t.detach().contiguous()).view(np.uint8))  # type: ignore[arg-type]

    def digest_soon(self, t: torch.Tensor) -> Callable[[], str]:
        """`digest` started on the pool; calling the result waits for it. ``t`` must not change meanwhile."""
        raw = bits_numpy(t.detach().contiguous()).view(np.uint8)
        if raw.size <= DIGEST_CHUNK:
            return self._pool.submit(xxhash.xxh3_128_hexdigest, raw).result  # type: ignore[arg-type]
        parts = [self._pool.submit(xxhash.xxh3_128_digest, raw[s:e]) for s, e in _chunks(raw.size, DIGEST_CHUNK)]  # type: ignore[arg-type]
        return lambda: xxhash.xxh3_128_hexdigest(b"".join(f.result() for f in parts))


@dataclass(frozen=True)
class TensorId:
    """What a replica needs to know of one tensor to check a patch's base: layout and fingerprint."""

    dtype: str
    shape: tuple[int, ...]
    fp: int


class FingerprintTable(dict[str, TensorId]):
    """Fingerprints of every tensor of a view; updated in O(changed) as patches are applied."""

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], hasher: Hasher | None = None) -> FingerprintTable:
        with nullcontext(hasher) if hasher is not None else Hasher() as h:
            return cls(
                {name: TensorId(dtype_of(t).name, tuple(t.shape), h.fingerprint(t)) for name, t in tensors.items()}
            )

    @classmethod
    def of_sums(cls, layout: Mapping[str, tuple[str, tuple[int, ...]]], sums: Mapping[str, int]) -> FingerprintTable:
        """The table of a view whose tensors (``layout``: name -> dtype name, shape) were fingerprinted in pieces:
        a tensor's fingerprint is the sum of its pieces' (``Hasher.fingerprint`` with their offsets), ``sums``."""
        return cls({n: TensorId(dtype, shape, sums.get(n, 0) & MASK64) for n, (dtype, shape) in layout.items()})

    def view_fp(self) -> str:
        """The view fingerprint: xxh3-128 over the sorted (name, dtype, shape, fingerprint) lines."""
        h = xxhash.xxh3_128()
        for name in sorted(self):
            t = self[name]
            h.update(f"{name}\t{t.dtype}\t{','.join(map(str, t.shape))}\t{fp_hex(t.fp)}\n".encode())
        return h.hexdigest()

    def copy(self) -> FingerprintTable:
        return FingerprintTable(self)

    def advanced(self, deltas: Mapping[str, int]) -> FingerprintTable:
        """The table after adding fingerprint deltas (``PatchEncoder.deltas``) to the named tensors."""
        out = self.copy()
        for name, d in deltas.items():
            tid = out[name]
            out[name] = TensorId(tid.dtype, tid.shape, (tid.fp + d) & MASK64)
        return out
