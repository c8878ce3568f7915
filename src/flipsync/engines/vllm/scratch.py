"""What probing loads into instead of the live parameters (scratch copies, write-refusing tripwires), and the
policy of which parameters a patch may write in place. See docs/engines.md ("Two ways to write").
"""

from __future__ import annotations

from collections.abc import Callable
from types import MethodType

import torch

# A policy says whether the kernel computes from a parameter as loaded: (module name, module, param) -> (ok, why).
Policy = Callable[[str, torch.nn.Module, str, torch.Tensor], tuple[bool, str]]
# Makes a zeroed model-format scratch parameter for (module, parameter name, live parameter or None where the
# engine dropped it); None when it cannot (a dropped parameter whose model format is unknown).
ScratchFactory = Callable[[torch.nn.Module, str, "torch.Tensor | None"], "torch.Tensor | None"]


def copy_attrs(dst: torch.Tensor, template: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """Give ``dst`` the class and attributes (weight_loader, output_dim, ...) of ``template``, bound to module."""
    attrs = dict(template.__dict__)
    for key, value in attrs.items():
        if key in ("weight_loader", "_weight_loader"):  # vLLM's layerwise-reload wrappers stay on after a reload
            while getattr(value, "__name__", "") == "online_process_loader" and hasattr(value, "__wrapped__"):
                value = value.__wrapped__
            attrs[key] = value
        if isinstance(value, MethodType) and not isinstance(value.__self__, torch.nn.Module | type):
            attrs[key] = value.__func__.__get__(module)
    dst.__class__ = template.__class__
    dst.__dict__.update(attrs)
    return dst


def default_scratch(module: torch.nn.Module, pname: str, live: torch.Tensor | None) -> torch.Tensor | None:
    if live is None:
        return None
    return copy_attrs(torch.zeros(live.shape, dtype=live.dtype, device=live.device), live, module)


def default_policy(module_name: str, module: torch.nn.Module, pname: str, param: torch.Tensor) -> tuple[bool, str]:
    if param.numel() == 0:
        return False, "the parameter was dropped after loading (the kernel holds a repacked copy)"
    return True, "the kernel computes from the parameter as loaded"


def tripwire(live: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """A zero-stride stand-in: reading works, any write raises (more than one element per memory location)."""
    t = torch.zeros((), dtype=live.dtype, device=live.device).expand(live.shape)
    return copy_attrs(t, live, module)


def vllm_policy(module_name: str, module: torch.nn.Module, pname: str, param: torch.Tensor) -> tuple[bool, str]:
    """Whether vLLM's kernel reads this parameter as loaded (then patches go in place)."""
    if param.numel() == 0:
        return False, "dropped after loading: the kernel holds a repacked copy"
    quant = getattr(module, "quant_method", None)
    qname = type(quant).__name__ if quant is not None else None
    if qname not in (None, "UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
        return False, f"{qname} may repack or rescale the weight"
    if hasattr(module, "cpu_linear") and type(module).__name__ != "VocabParallelEmbedding":
        return False, "the CPU GEMM computes from a packed copy (oneDNN / sgl-kernel)"
    return True, "the kernel reads the parameter as loaded"


def vllm_scratch(module: torch.nn.Module, pname: str, live: torch.Tensor | None) -> torch.Tensor | None:
    """Zeroed scratch in *model format*: vLLM records it before kernel processing (layerwise reload metadata),
    also for a parameter the engine set to None after loading (None where no such record exists)."""
    template = None
    device = live.device if live is not None else torch.device("cpu")
    try:
        from vllm.model_executor.model_loader.reload import layerwise

        info = layerwise.LAYERWISE_INFO.get(module)
        if info is not None:
            template = info.restore_metadata[0].get(pname)
            if live is None or live.numel() == 0:
                device = torch.device(info.restore_device)
    except ImportError:  # older vLLM: the live parameter is the template
        template = None
    if template is None:
        return default_scratch(module, pname, live)
    t = torch.zeros(tuple(template.shape), dtype=template.dtype, device=device)
    return copy_attrs(t, template, module)
