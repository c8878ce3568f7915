"""When to write a keyframe and which squashed spans to publish: pure policy, no I/O. See docs/board.md#cadence."""

from __future__ import annotations

from dataclasses import dataclass

from flipsync.errors import ConfigError


@dataclass(frozen=True)
class KeyframePolicy:
    chain_fraction: float = 0.5  # keyframe once the chain since the last one reaches this share of a keyframe
    max_interval: int = 1000  # ... or after this many versions, whatever the bytes
    min_interval: int = 1  # never two keyframes closer than this

    def __post_init__(self) -> None:
        if not self.chain_fraction > 0:
            raise ConfigError("chain_fraction must be positive")
        if self.max_interval < 1 or self.min_interval < 1 or self.min_interval > self.max_interval:
            raise ConfigError("need 1 <= min_interval <= max_interval")


def should_write_keyframe(
    *, chain_bytes: int, keyframe_bytes: int | None, versions_since: int, policy: KeyframePolicy | None = None
) -> bool:
    """Whether the version just published should also get a keyframe, given the bytes of the patches since
    the newest keyframe, that keyframe's size (None: the run has none yet, so always) and the versions since."""
    p = policy or KeyframePolicy()
    if keyframe_bytes is None:
        return True
    if versions_since < p.min_interval:
        return False
    if versions_since >= p.max_interval:
        return True
    return chain_bytes >= p.chain_fraction * keyframe_bytes


@dataclass(frozen=True)
class SpanPolicy:
    min_level: int = 1  # smallest span: 2**min_level versions
    max_level: int = 8  # largest span: 2**max_level versions

    def __post_init__(self) -> None:
        if not 1 <= self.min_level <= self.max_level <= 40:
            raise ConfigError("need 1 <= min_level <= max_level <= 40")


def spans_to_publish(version: int, *, origin: int = 0, policy: SpanPolicy | None = None) -> list[tuple[int, int]]:
    """The (base, target) spans to squash right after ``version`` is published, smallest first, aligned to
    ``origin`` (the snapshot the patch chain starts from) and never starting before it."""
    p = policy or SpanPolicy()
    offset = version - origin
    out: list[tuple[int, int]] = []
    for level in range(p.min_level, p.max_level + 1):
        width = 1 << level
        if offset < width or offset % width:
            break
        out.append((version - width, version))
    return out
