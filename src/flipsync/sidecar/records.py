"""What a replica reports about itself: the loop's state, the last update applied, the last failure, each
failure's short stable name (``status()`` and the ``kind`` label of the failure counter)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from flipsync.errors import (
    BaseMismatchError,
    BoardError,
    CorruptPatchError,
    EngineError,
    EngineUnavailableError,
    FlipsyncError,
    IntegrityError,
    NotFoundError,
    PatchError,
    StoreError,
    UnusableArtifactError,
    VerificationError,
)


class State(StrEnum):
    IDLE = "idle"
    FETCHING = "fetching"
    STAGING = "staging"
    COMMITTING = "committing"
    ERROR = "error"


@dataclass(frozen=True)
class Update:
    """One applied artifact and what it cost."""

    kind: str
    base: int | None
    target: int
    bytes: int
    n_changed: int | None
    fetch_s: float
    stage_s: float
    commit_s: float
    pause_s: float
    drain_s: float
    drained: bool
    at: str


@dataclass(frozen=True)
class Failure:
    kind: str
    message: str
    at: str
    consecutive: int


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def classify(e: BaseException) -> str:
    """A short, stable name for a failure (status and the ``kind`` label of the failure counter)."""
    if isinstance(e, UnusableArtifactError):
        return e.kind
    if isinstance(e, EngineUnavailableError):
        return "engine_down"
    if isinstance(e, EngineError):
        return "engine_rejected"
    if isinstance(e, IntegrityError):
        return "integrity"
    if isinstance(e, StoreError):
        return "board_unreachable"
    if isinstance(e, NotFoundError):
        return "no_route"
    if isinstance(e, BoardError):
        return "board"
    if isinstance(e, BaseMismatchError):
        return "base_mismatch"
    if isinstance(e, VerificationError):
        return "verification"
    if isinstance(e, CorruptPatchError | PatchError):
        return "corrupt_patch"
    if isinstance(e, FlipsyncError):
        return "error"
    return "internal"
