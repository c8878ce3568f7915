"""The Engine port: what the sidecar needs from an inference engine to keep it at a board version (the sidecar
owns the protocol, the engine the weights). See docs/sidecar.md ("The Engine port and the torch engine").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar, Generic, TypeVar

import torch

from flipsync.codec import Patch
from flipsync.codec.fingerprint import FingerprintTable
from flipsync.domain.balance import EngineLoad


class Staged:
    """What ``Engine.stage`` returns and ``Engine.commit`` takes: one patch, decoded and checked, not yet
    written. Each engine subclasses it with what its commit needs."""

    # Elements the commit will write, for status and metrics; None where an engine does not count them.
    n_changed: int | None = None


class Undo:
    """What ``Engine.commit`` returns and ``Engine.rollback`` takes: enough to restore the weights (and the
    table) held before that commit. Each engine subclasses it."""


StagedT = TypeVar("StagedT", bound=Staged)
UndoT = TypeVar("UndoT", bound=Undo)


class Engine(ABC, Generic[StagedT, UndoT]):
    """An inference engine whose served weights a sidecar keeps bitwise at a board version.

    ``StagedT`` / ``UndoT``: the engine's own `Staged` and `Undo` types; optional capabilities have defaults here.
    """

    name: ClassVar[str]

    @property
    @abstractmethod
    def table(self) -> FingerprintTable:
        """Fingerprints of the served view the engine holds now, kept current in O(changed) by commits."""

    @abstractmethod
    def load_view(self, view: Mapping[str, torch.Tensor]) -> None:
        """Replace every weight with a full served view (boot, or resync from a keyframe).

        On return ``table`` describes ``view``; on failure the engine must not serve (the sidecar marks it
        unhealthy and retries)."""

    @abstractmethod
    def stage(self, patch: Patch) -> StagedT:
        """Decode and prepare ``patch`` against the current weights without changing them.

        Raises a ``flipsync`` error (``BaseMismatchError``, ``CorruptPatchError``, ``VerificationError``)
        when the patch does not apply to what the engine holds."""

    @abstractmethod
    def commit(self, staged: StagedT) -> UndoT:
        """Write the staged changes in place and return an undo token; all or nothing."""

    @abstractmethod
    def rollback(self, undo: UndoT) -> None:
        """Restore the weights (and ``table``) to what they were before the commit that made ``undo``."""

    @abstractmethod
    def recompute_table(self) -> FingerprintTable:
        """Fingerprints recomputed from the weights actually held (O(size)); for audits after faults."""

    @property
    def adoptable(self) -> bool:
        """Whether ``recompute_table`` reads the weights the engine serves, so that a new sidecar may report
        the version an engine that outlived its old sidecar holds (else it loads a keyframe)."""
        return True

    @property
    def host_view(self) -> Mapping[str, torch.Tensor] | None:
        """The served tensors where the sidecar can read them (an engine holding its view in this process), or
        None (they live elsewhere). With them the sidecar joins a version's parts coded against their base."""
        return None

    @property
    def decodes_context(self) -> bool:
        """Whether ``stage`` decodes patches whose positions are coded against their base (``ctx``): true for
        every engine that holds its view, or a host copy of it, where the sidecar runs."""
        return True

    @property
    def tokenizer_digest(self) -> str | None:
        """A short digest of how the engine turns prompts into token ids (`engines.tokenization`: a text prompt's
        BOS and specials, the chat template, the stop tokens), for its member record; None where the sidecar
        cannot tell. A gateway routes one model name only to replicas whose digests agree."""
        return None

    def label_version(self, view_fp: str, version: int) -> None:
        """Name the board version of a view before it is committed (an engine that stamps its outputs with
        a version uses it); the sidecar calls it before every commit and keyframe load."""

    def health(self) -> bool:
        """False when the engine cannot serve (crashed, unreachable)."""
        return True

    def load(self) -> EngineLoad | None:
        """The engine's load now (requests waiting and running, KV-cache use), for routing; None where the engine
        cannot say (the sidecar then reads a vLLM or SGLang server's ``/metrics`` itself). Must be cheap."""
        return None

    def close(self) -> None:
        """Release the engine's resources."""
