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
    PermanentStoreError,
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


# The first class a failure is an instance of names it (subclasses before their bases).
_KINDS: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], str], ...] = (
    (EngineUnavailableError, "engine_down"),
    (EngineError, "engine_rejected"),
    (IntegrityError, "integrity"),
    (PermanentStoreError, "board_refused"),
    (StoreError, "board_unreachable"),
    (NotFoundError, "no_route"),
    (BoardError, "board"),
    (BaseMismatchError, "base_mismatch"),
    (VerificationError, "verification"),
    ((CorruptPatchError, PatchError), "corrupt_patch"),
    (FlipsyncError, "error"),
)


def classify(e: BaseException) -> str:
    """A short, stable name for a failure (status and the ``kind`` label of the failure counter)."""
    if isinstance(e, UnusableArtifactError):  # an IntegrityError that names its own kind
        return e.kind
    return next((kind for cls, kind in _KINDS if isinstance(e, cls)), "internal")
