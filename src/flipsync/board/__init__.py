"""The bulletin board: versions, keyframes and spans of a run on an object store, published create-only.
``BoardWriter`` publishes, ``BoardReader`` fetches verified catch-ups, ``Follower`` follows (docs/board.md).

The names below are imported when first used, not with the package: a process that needs one light part of the
board (the gateway's membership reader and HEAD, a Ray actor's spec) then does not import torch and the codec
that keyframes and patches need (1.6 s of CPU and 300 MB a process).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flipsync.board.cadence import KeyframePolicy
    from flipsync.board.catalog import Catalog
    from flipsync.board.follow import Follower
    from flipsync.board.reader import BoardReader, KeyframeStep, PatchStep, Step
    from flipsync.board.signing import Signer, Verifier, generate_keypair
    from flipsync.board.writer import BoardWriter
    from flipsync.stores import Store, open_store

_HOMES = {
    "BoardReader": "flipsync.board.reader",
    "BoardWriter": "flipsync.board.writer",
    "Catalog": "flipsync.board.catalog",
    "Follower": "flipsync.board.follow",
    "KeyframePolicy": "flipsync.board.cadence",
    "KeyframeStep": "flipsync.board.reader",
    "PatchStep": "flipsync.board.reader",
    "Signer": "flipsync.board.signing",
    "Step": "flipsync.board.reader",
    "Store": "flipsync.stores",
    "Verifier": "flipsync.board.signing",
    "generate_keypair": "flipsync.board.signing",
    "open_store": "flipsync.stores",
}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'flipsync.board' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
