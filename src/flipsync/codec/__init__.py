"""Bitwise diff, near-entropy patches, squash, and all-or-nothing in-place apply with verification.

This module is the codec's public API: other packages import from ``flipsync.codec`` only, never from its
submodules (``bits``: integer views and order keys; ``diff``: changed positions; ``coders``/``streams``: the
registry of stream coders, one module each: ``rice``, ``rans``, ``bitpack``, ``zstd``; ``patch``: decoded
changes and the safetensors container; ``encode``: ``diff_views``; ``apply``: check / stage / commit / undo;
``squash``; ``fingerprint``: content digests and O(changed) fingerprints).
"""

from flipsync.codec.apply import (
    ApplyResult,
    StagedWrite,
    UndoRecord,
    Verify,
    apply_patch,
    check_base,
    commit,
    scatter,
    stage,
)
from flipsync.codec.bits import DType, bits_numpy, dtype_named, dtype_of, from_key, int_view, key_steps, to_key, zigzag
from flipsync.codec.context import ClassIndex, conditional_position_bits
from flipsync.codec.diff import DiffEngine, changed_positions_reference
from flipsync.codec.encode import diff_views
from flipsync.codec.fingerprint import FingerprintTable, Hasher, TensorId, fingerprint_delta, fingerprint_of, fp_hex
from flipsync.codec.patch import (
    CONTAINER_VERSION,
    DEFAULT_MAX_DECODED_BYTES,
    OWN_TENSOR_BYTES,
    SMALL_SECTIONS,
    Patch,
    PatchBuilder,
    PatchFileWriter,
    TensorChange,
    encode_change,
    overhead_bytes,
)
from flipsync.codec.squash import squash
from flipsync.codec.streams import decode_symbols

__all__ = [
    "CONTAINER_VERSION",
    "DEFAULT_MAX_DECODED_BYTES",
    "OWN_TENSOR_BYTES",
    "SMALL_SECTIONS",
    "ApplyResult",
    "ClassIndex",
    "DType",
    "DiffEngine",
    "FingerprintTable",
    "Hasher",
    "Patch",
    "PatchBuilder",
    "PatchFileWriter",
    "StagedWrite",
    "TensorChange",
    "TensorId",
    "UndoRecord",
    "Verify",
    "apply_patch",
    "bits_numpy",
    "changed_positions_reference",
    "check_base",
    "commit",
    "conditional_position_bits",
    "decode_symbols",
    "diff_views",
    "dtype_named",
    "dtype_of",
    "encode_change",
    "fingerprint_delta",
    "fingerprint_of",
    "fp_hex",
    "from_key",
    "int_view",
    "key_steps",
    "overhead_bytes",
    "scatter",
    "squash",
    "stage",
    "to_key",
    "zigzag",
]
