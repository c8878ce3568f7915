"""The bulletin board: versions, keyframes and spans of a run on an object store, published create-only.
``BoardWriter`` publishes, ``BoardReader`` fetches verified catch-ups, ``Follower`` follows (docs/board.md)."""

from flipsync.board.cadence import KeyframePolicy
from flipsync.board.catalog import Catalog
from flipsync.board.follow import Follower
from flipsync.board.reader import BoardReader, KeyframeStep, PatchStep, Step
from flipsync.board.signing import Signer, Verifier, generate_keypair
from flipsync.board.writer import BoardWriter
from flipsync.stores import Store, open_store

__all__ = [
    "BoardReader",
    "BoardWriter",
    "Catalog",
    "Follower",
    "KeyframePolicy",
    "KeyframeStep",
    "PatchStep",
    "Signer",
    "Step",
    "Store",
    "Verifier",
    "generate_keypair",
    "open_store",
]
