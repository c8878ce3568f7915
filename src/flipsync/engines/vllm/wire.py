"""What the sidecar half and the worker half of the vLLM engine agree on: the RPC method and protocol version,
the parameter modes, the audit's settings, and arrays inside the JSON requests (base64 of little-endian bytes).
"""

from __future__ import annotations

import base64
import hashlib

import numpy as np
from numpy.typing import DTypeLike

PROTOCOL = 3  # 3: a write may carry the digest of the bits it replaces
RPC_METHOD = "flipsync_call"
EXTENSION_CLS = "flipsync.engines.vllm.worker.FlipsyncWorkerExtension"
INPLACE, RELOAD = "inplace", "reload"
DEFAULT_MAX_UNDO = 2
# How often the worker compares reloaded layers with a fresh load of the same tensors (the kernel-state audit):
# every touched layer, one touched layer of each kind per update, or never.
AUDIT_EVERY, AUDIT_SAMPLE, AUDIT_OFF = "every", "sample", "off"
AUDIT_MODES = (AUDIT_EVERY, AUDIT_SAMPLE, AUDIT_OFF)


class WorkerOpError(Exception):
    """A worker-side operation failed; reported to the sidecar as an error answer, never raised across RPC."""


class AuditError(WorkerOpError):
    """A layer's kernels compute from other weights than a fresh load of the same checkpoint tensors gives."""


class BaseBitsError(WorkerOpError):
    """A write's elements held other bits than the sidecar expected (its host copy): nothing was written."""


class StateUnknownError(WorkerOpError):
    """An operation failed and so did undoing it: the worker's weights are unknown until a full load."""


def b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()


def unb64(s: str, dtype: DTypeLike) -> np.ndarray:
    raw = base64.b64decode(s, validate=True)
    dt = np.dtype(dtype)
    if len(raw) % dt.itemsize:
        raise WorkerOpError(f"array of {len(raw)} bytes is not a whole number of {dt} elements")
    return np.frombuffer(raw, dtype=dt).copy()


def bits_digest(bits: np.ndarray) -> str:
    """Digest of an array's bytes: the base bits a write expects, sent instead of the bits themselves."""
    return hashlib.blake2b(np.ascontiguousarray(bits).tobytes(), digest_size=16).hexdigest()


def readback_digest(writes: list[tuple[str, bytes, bytes]]) -> str:
    """One digest of (parameter, positions, bits) per write, in order: the worker hashes what it reads back after
    a commit (reloads included), the sidecar what it sent (checked against the patch's target at stage)."""
    h = hashlib.blake2b(digest_size=16)
    for pname, pos, bits in writes:
        h.update(pname.encode() + b"\0" + len(pos).to_bytes(8, "little") + pos + bits)
    return h.hexdigest()
