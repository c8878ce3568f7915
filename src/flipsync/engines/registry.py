"""The engines a sidecar can drive: a kind names the module whose ``create_engine(EngineOptions) -> Engine``
builds it; a new engine is such a module and one line in `ENGINES` (torch is served in process)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from flipsync.engines.base import Engine
from flipsync.errors import ConfigError

# kind -> the module with its ``create_engine`` (None: built in process by the sidecar)
ENGINES: dict[str, str | None] = {
    "torch": None,
    "vllm": "flipsync.engines.vllm",
    "sglang": "flipsync.engines.sglang",
}


@dataclass(frozen=True)
class EngineOptions:
    """What ``create_engine`` gets from the command line (``--upstream``, ``--format``, ``--engine-option``)."""

    upstream_url: str | None = None
    served_format: str | None = None
    device: str = "cpu"
    options: dict[str, str] = field(default_factory=dict)

    def admin_url(self, kind: str) -> str:
        """Where the engine's admin API is: ``admin_url``, else the upstream server."""
        url = self.options.get("admin_url") or self.upstream_url
        if not url:
            raise ConfigError(f"the {kind} engine needs --upstream URL (or --engine-option admin_url=URL)")
        return url


def check_kind(kind: str) -> str:
    if kind not in ENGINES:
        raise ConfigError(f"unknown engine {kind!r}; engines: {', '.join(ENGINES)}")
    return kind


def load_engine(kind: str, options: EngineOptions) -> Engine:
    """Build an engine the sidecar reaches over HTTP (each module's ``create_engine`` documents its options)."""
    module_name = ENGINES[check_kind(kind)]
    if module_name is None:
        raise ConfigError(f"the {kind} engine is served by the sidecar itself, not loaded")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"the {kind} engine is not available: {e}") from None
    engine = module.create_engine(options)
    if not isinstance(engine, Engine):
        raise ConfigError(f"the {kind} engine factory returned {type(engine).__name__}, not an Engine")
    return engine
