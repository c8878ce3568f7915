"""What the sidecar half and the worker half of the vLLM engine agree on: the RPC method and protocol version,
the parameter modes, the audit's settings, and arrays inside the JSON requests (base64 of little-endian bytes).
"""

from __future__ import annotations

import base64
import binascii
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
    # strict_mode: the C decoder rejects what base64.b64decode(validate=True) rejects, in one pass (no regex
    # check first: 36 -> 33 ms for a 7 MB request)
    try:
        raw = binascii.a2b_base64(s, strict_mode=True)
    except (binascii.Error, ValueError) as e:
        raise WorkerOpError(f"an array in the request is not valid base64: {e}") from None
    dt = np.dtype(dtype)
    if len(raw) % dt.itemsize:
        raise WorkerOpError(f"array of {len(raw)} bytes is not a whole number of {dt} elements")
    return np.frombuffer(raw, dtype=dt).copy()


def bits_digest(bits: np.ndarray) -> str:
    """Digest of an array's bytes: the base bits a write expects, sent instead of the bits themselves."""
    return hashlib.blake2b(np.ascontiguousarray(bits).tobytes(), digest_size=16).hexdigest()


def readback_digest(writes: list[tuple[str, np.ndarray, np.ndarray]]) -> str:
    """One digest of (parameter, positions as int64, bits) per write, in order: the worker hashes what it reads
    back after a commit (reloads included), the sidecar what it sent (checked against the patch's target at
    stage). The arrays are hashed in place, not copied into one string first."""
    h = hashlib.blake2b(digest_size=16)
    for pname, pos, bits in writes:
        positions = np.ascontiguousarray(pos, dtype="<i8")
        h.update(pname.encode() + b"\0" + positions.nbytes.to_bytes(8, "little"))
        h.update(memoryview(positions).cast("B"))
        h.update(memoryview(np.ascontiguousarray(bits)).cast("B"))
    return h.hexdigest()
