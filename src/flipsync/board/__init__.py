"""The bulletin board: versions, keyframes and spans of a run on an object store, published create-only.

``BoardWriter`` publishes (with the keyframe and span cadence), ``BoardReader`` plans and fetches verified
catch-ups, ``Follower`` keeps one replica on its last good version; stores come from ``open_store(url)``.
"""

from flipsync.board.cadence import KeyframePolicy, SpanPolicy, should_write_keyframe, spans_to_publish
from flipsync.board.catalog import Catalog, content_hash
from flipsync.board.follow import Follower
from flipsync.board.keyframes import INDEX_NAME, iter_keyframe_files, tensors_from_files
from flipsync.board.layout import RunLayout
from flipsync.board.reader import BoardReader, KeyframeStep, PatchStep, Step, load_keyframe
from flipsync.board.retention import GcReport, RetentionPolicy, collect_garbage
from flipsync.board.signing import Signer, Verifier, generate_keypair, write_keypair
from flipsync.board.writer import BoardWriter
from flipsync.stores import ObjectInfo, ObstoreStore, Store, StoreOptions, open_store

__all__ = [
    "INDEX_NAME",
    "BoardReader",
    "BoardWriter",
    "Catalog",
    "Follower",
    "GcReport",
    "KeyframePolicy",
    "KeyframeStep",
    "ObjectInfo",
    "ObstoreStore",
    "PatchStep",
    "RetentionPolicy",
    "RunLayout",
    "Signer",
    "SpanPolicy",
    "Step",
    "Store",
    "StoreOptions",
    "Verifier",
    "collect_garbage",
    "content_hash",
    "generate_keypair",
    "iter_keyframe_files",
    "load_keyframe",
    "open_store",
    "should_write_keyframe",
    "spans_to_publish",
    "tensors_from_files",
    "write_keypair",
]
