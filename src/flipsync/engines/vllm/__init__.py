"""The vLLM engine: the sidecar half (``engine``) and the half vLLM loads into every worker (``worker``),
with what both agree on (``wire``), the pure block map from checkpoint tensors to vLLM's fused parameters
(``blockmap``), the stand-ins the worker probes its loaders with (``scratch``) and the kernel-state audit's
twins and probes (``kernels``).

Re-exports what ``flipsync sidecar --engine vllm`` builds an engine from.
"""

from flipsync.engines.vllm.engine import HttpTransport, VllmEngine, specs_from_checkpoint

__all__ = ["HttpTransport", "VllmEngine", "specs_from_checkpoint"]
