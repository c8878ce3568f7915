"""One exception hierarchy for flipsync. Every message says what went wrong and what to do about it."""

from __future__ import annotations


class FlipsyncError(Exception):
    """Base class of every error flipsync raises on purpose."""


class ConfigError(FlipsyncError):
    """A setting, argument or file path the user gave cannot be used."""


class MissingExtraError(ConfigError, ImportError):
    """A feature needs packages the library installs only with an extra (``pip install 'flipsync[EXTRA]'``)."""

    def __init__(self, feature: str, extra: str, missing: str) -> None:
        super().__init__(f"{feature} needs {missing}, which is not installed: pip install 'flipsync[{extra}]'")
        self.extra = extra


def require_extra(feature: str, extra: str, *modules: str) -> None:
    """Raise `MissingExtraError` unless every module of ``modules`` can be imported (found, not imported)."""
    import sys
    from importlib.util import find_spec

    # A module already imported counts (find_spec refuses one whose __spec__ is unset, a stand-in for one).
    missing = [m for m in modules if m not in sys.modules and find_spec(m) is None]
    if missing:
        raise MissingExtraError(feature, extra, " and ".join(missing))


class FormatError(FlipsyncError):
    """A served-view recipe cannot be applied to this tensor (bad shape, dtype, non-finite values, ...)."""


class NonFiniteError(FormatError):
    """A master tensor holds NaN or inf; served views of non-finite masters are undefined."""


class PatchError(FlipsyncError):
    """A patch cannot be built, decoded or applied."""


class CorruptPatchError(PatchError):
    """A patch file is truncated, corrupted or crafted: it fails to parse or its contents are inconsistent."""


class BaseMismatchError(PatchError):
    """The tensors a patch is applied to are not the patch's base; nothing was changed."""


class VerificationError(PatchError):
    """After applying, the result does not match the target digest; the apply was rolled back."""


class BoardError(FlipsyncError):
    """The bulletin board (object store) cannot be read or written as asked."""


class StoreError(BoardError):
    """The object store failed; callers decide by subclass (a plain StoreError, a wrapper's own, is transient)."""


class PermanentStoreError(StoreError):
    """The store refused in a way that waiting does not heal: permission or credentials, no such bucket or
    container, a malformed request or configuration, no space left. Raised at once, never retried."""


class TransientStoreError(StoreError):
    """The store failed in a way that may heal (a timeout, throttling, a 5xx, a dropped connection) and kept
    failing after the store's retries; the message says how often and for how long it tried."""


class NotFoundError(BoardError):
    """An object, version or run does not exist on the board."""


class ConflictError(BoardError):
    """Another writer got there first (a manifest for this version already exists)."""


class IntegrityError(BoardError):
    """A part, manifest or keyframe does not match its recorded hash or signature."""


class SignatureError(IntegrityError):
    """A signed document whose signature does not verify: it was modified after signing."""


class UnusableArtifactError(IntegrityError):
    """A board artifact passed its hash checks but cannot be used (a corrupt patch, one that does not match its
    manifest, a keyframe of another view); a reader routes around it or waits for a way past it."""

    def __init__(self, message: str, *, edge: tuple[str, int | None, int], kind: str) -> None:
        super().__init__(message)
        self.edge = edge
        self.kind = kind


class EngineError(FlipsyncError):
    """The inference engine refused or failed an operation on its weights (load, stage, commit, rollback)."""


class EngineUnavailableError(EngineError):
    """The inference engine is down or unreachable; the sidecar waits for it and re-audits its weights."""
