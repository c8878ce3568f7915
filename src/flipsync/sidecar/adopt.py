"""Adoption: on boot, find the board version an engine that outlived its sidecar already holds.

The engine's fingerprints are recomputed from its weights (O(size), once) and compared with the target view
of the newest version manifests (signature-checked with a verifier). No match (a commit cut short between
ranks or tensors, weights from elsewhere) means a keyframe, so a half-written engine is never reported.
"""

from __future__ import annotations

import logging

from flipsync.board.reader import BoardReader
from flipsync.domain.manifest import Manifest
from flipsync.engines.base import Engine
from flipsync.errors import EngineUnavailableError, FlipsyncError
from flipsync.sidecar.engine_update import engine_call

log = logging.getLogger(__name__)


def find_held_version(reader: BoardReader, engine: Engine, head: int, search: int) -> Manifest | None:
    """The manifest of the newest of the ``search`` versions up to ``head`` whose view the engine holds.

    None (logged) when adoption is off, the engine cannot say what it serves, or holds none of them. Raises
    ``EngineUnavailableError`` when the engine does not answer (try again once it does).
    """
    name = engine.name
    if search <= 0 or not engine.adoptable:
        log.info("not adopting what the %s engine holds (disabled for it); loading a keyframe", name)
        return None
    try:
        held_table = engine_call(engine, "recompute_table", engine.recompute_table)
    except EngineUnavailableError:
        raise
    except FlipsyncError as e:  # e.g. tensor-parallel replicas disagree: a commit reached some ranks only
        log.warning("cannot read back a consistent view from the %s engine (%s); loading a keyframe", name, e)
        return None
    held = held_table.view_fp()
    tracked = engine.table.view_fp()
    if held != tracked:  # patches are staged against ``table``: it must describe the weights
        log.warning(
            "the %s engine's fingerprint table (%s) does not describe its weights (%s); loading a keyframe",
            name,
            tracked[:16],
            held[:16],
        )
        return None
    lowest = max(head - search + 1, min(reader.catalog.list_versions(), default=0))
    match: Manifest | None = None
    hi = head
    while match is None and hi >= lowest:  # newest first, in small batches: usually it is HEAD or close
        lo = max(lowest, hi - 7)
        found = reader.catalog.read_versions(range(lo, hi + 1))
        match = max((m for m in found.values() if m.target_view_fp == held), key=lambda m: m.version, default=None)
        hi = lo - 1
    if match is None:  # the usual case for an engine started from its base weights: info, not a warning
        log.info(
            "the %s engine holds view %s, which is none of v%d..v%d on the board (other weights, or a commit "
            "cut short); loading a keyframe",
            name,
            held[:16],
            lowest,
            head,
        )
    return match
