"""The vLLM engine: the sidecar half (``engine``) and the half vLLM loads into every worker (``worker``).

Re-exports what ``flipsync sidecar --engine vllm`` builds an engine from.
"""

from flipsync.engines.vllm.engine import HttpTransport, VllmEngine, specs_from_checkpoint

__all__ = ["HttpTransport", "VllmEngine", "specs_from_checkpoint"]
