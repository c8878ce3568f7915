"""When to write a keyframe and which squashed spans to publish: pure policy, no I/O. Keyframes bound what a
replica that is behind pays; aligned power-of-two spans keep any catch-up to O(log k) downloads.
See docs/board.md ("Cadence").
"""

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
    *,
    chain_bytes: int,
    keyframe_bytes: int | None,
    versions_since: int,
    policy: KeyframePolicy | None = None,
) -> bool:
    """Whether the version just published should also get a keyframe.

    ``chain_bytes``: total bytes of the patches published since the newest keyframe; ``keyframe_bytes``:
    the size of that keyframe (None when the run has none yet: then always); ``versions_since``: how many
    versions were published after it.
    """
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
    """The (base, target) spans to squash right after ``version`` is published, smallest first.

    ``origin`` is the first version of the lineage (the snapshot the patch chain starts from): spans are
    aligned relative to it and never start before it.
    """
    p = policy or SpanPolicy()
    offset = version - origin
    out: list[tuple[int, int]] = []
    for level in range(p.min_level, p.max_level + 1):
        width = 1 << level
        if offset < width or offset % width:
            break
        out.append((version - width, version))
    return out
