"""The vLLM engine: the sidecar half (``engine``), the half vLLM loads into every worker (``worker``) and what
both agree on (``wire``); ``create_engine`` for ``flipsync sidecar --engine vllm``. See docs/engines.md.
"""

from flipsync.engines.host_copy import default_host_copy, open_host_copy
from flipsync.engines.registry import EngineOptions
from flipsync.engines.vllm.engine import VllmEngine
from flipsync.engines.vllm.rpc_transports import HttpTransport
from flipsync.engines.vllm.tensor_specs import specs_from_checkpoint
from flipsync.errors import ConfigError

__all__ = ["HttpTransport", "VllmEngine", "create_engine", "specs_from_checkpoint"]


def create_engine(options: EngineOptions) -> VllmEngine:
    """The ``--engine-option`` keys: ``model_dir`` (required: the checkpoint vLLM was started from, for the
    tensor specs), ``source`` (default ``model_dir``), ``admin_url`` (the server with ``/collective_rpc``;
    default ``--upstream``), ``host_copy`` (a safetensors file holding what the workers hold, so that patches
    coded against their base decode; created from ``model_dir`` when missing; default a file under the user's
    cache directory; ``none``: no host copy, for runs published without context coding), ``audit`` (``every``,
    ``sample`` or ``off``: how often the workers compare reloaded layers with a fresh load) and ``repair``
    (``on``/``off``: whether a kind of layer the engine reloads wrongly takes a fresh load's state)."""
    opts = options.options
    url = options.admin_url("vllm")
    if "model_dir" not in opts:
        raise ConfigError("the vllm engine needs --engine-option model_dir=PATH (the checkpoint vLLM serves)")
    repair = opts.get("repair", "on").lower()
    if repair not in ("on", "off"):
        raise ConfigError(f"--engine-option repair must be on or off, not {opts['repair']!r}")
    copy = opts.get("host_copy") or str(default_host_copy(opts["model_dir"]))
    return VllmEngine(
        HttpTransport(url),
        specs_from_checkpoint(opts["model_dir"]),
        source=opts.get("source", opts["model_dir"]),
        host_copy=None if copy == "none" else open_host_copy(copy, opts["model_dir"]),
        audit=opts.get("audit", "every"),
        repair=repair == "on",
    )
