"""flipsync: keep a scattered RL rollout fleet bitwise in sync with its trainer with small lossless patches."""

from flipsync.errors import FlipsyncError

__all__ = ["FlipsyncError", "__version__"]
__version__ = "0.1.0"
