"""The kernel-state audit's hooks: build a freshly loaded *twin* of a touched layer and compare it with the live
one. See docs/engines.md#the-kernel-state-audit."""

from __future__ import annotations

import copy
import hashlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from flipsync.codec.bits import int_view

# (module name, live module, loaded model-format tensors by attribute, the module's other parameters and buffers
# as the engine's fresh load left them) -> a processed twin, outside the model.
TwinFactory = Callable[[str, torch.nn.Module, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], torch.nn.Module]
# (module name, module, probe rows (None: all), seed) -> the kernel's outputs on fixed inputs, by label.
Prober = Callable[[str, torch.nn.Module, "int | None", int], dict[str, torch.Tensor]]
# (live module, twin): the live module takes the twin's opaque (non-tensor) processed state.
Transplant = Callable[[torch.nn.Module, torch.nn.Module], None]
# module -> its kind (class names of the module and of the method objects that process it).
KindOf = Callable[[torch.nn.Module], str]

#: Probe rows per layer in ``sample`` mode (``every`` probes every row).
SAMPLE_ROWS = 64

# The objects whose post-load step turns a layer into kernel format (vLLM: the quant method and, for
# compressed-tensors, the layer's scheme); a twin gets them afresh.
_METHODS = ("quant_method", "scheme")
_ORIGIN = "_flipsync_twin_of"  # a twin's attribute naming the live layer it was made from
ADOPTED = "_flipsync_adopted_twin"  # a live layer's attribute holding the twin whose opaque state it took


@dataclass(frozen=True)
class KernelHooks:
    """How the audit builds and inspects twins for one engine."""

    twin: TwinFactory
    probe: Prober
    transplant: Transplant
    kind: KindOf


# ------------------------------------------------------------------------------------------ comparisons
def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's own parameters and buffers that are set (not its children's)."""
    out = {n: p for n, p in module._parameters.items() if p is not None}
    out.update({n: b for n, b in module._buffers.items() if b is not None})
    return out


def state_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a layer's kernel may compute from: its own parameters and buffers, tensors kept in plain
    attributes of the layer, and those of its method objects (attributes or child modules: vLLM's MoE quant
    method is a child module whose packed copies are plain attributes). Blind spot 1 of the audit was to compare
    only the first group."""
    out = module_tensors(module)
    for key, value in vars(module).items():
        if isinstance(value, torch.Tensor) and key not in out and not key.startswith("__"):
            out[key] = value
    for attr in _METHODS:
        method = _method(module, attr)
        if method is None:
            continue
        if isinstance(method, torch.nn.Module):
            out.update({f"{attr}.{n}": t for n, t in module_tensors(method).items()})
        for key, value in vars(method).items():
            if isinstance(value, torch.Tensor) and f"{attr}.{key}" not in out:
                out[f"{attr}.{key}"] = value
    return out


def storage_of(module: torch.nn.Module) -> dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(address, shape, strides) of each set, non-empty parameter and buffer: what a captured CUDA graph reads."""
    return {
        n: (t.data_ptr(), tuple(t.shape), tuple(t.stride())) for n, t in module_tensors(module).items() if t.numel()
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return int_view(t.detach().cpu().contiguous())


def compare(live: Mapping[str, torch.Tensor], twin: Mapping[str, torch.Tensor], prefix: str = "") -> list[str]:
    """What differs between two sets of named tensors (empty: the same bits in the same layouts)."""
    bad = []
    for name in sorted(set(live) | set(twin)):
        a, b = live.get(name), twin.get(name)
        if a is None or b is None:
            bad.append(f"{prefix}{name} is {'missing here' if a is None else 'absent from a fresh load'}")
        elif tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            bad.append(f"{prefix}{name} is {tuple(a.shape)} {a.dtype} here, {tuple(b.shape)} {b.dtype} in a fresh load")
        elif a.numel() > 1 and a.stride() != b.stride():
            bad.append(f"{prefix}{name} has strides {a.stride()} here, {b.stride()} in a fresh load")
        elif not torch.equal(x := _bits(a), y := _bits(b)):
            bad.append(f"{prefix}{name} differs from a fresh load at {int((x != y).sum())} of {a.numel()} elements")
    return bad


def digest(t: torch.Tensor) -> list[Any]:
    """[shape, dtype, strides, blake2b of the bits in logical order]: what two engines can compare."""
    h = hashlib.blake2b(_bits(t).numpy().tobytes(), digest_size=16).hexdigest()
    return [list(t.shape), str(t.dtype).removeprefix("torch."), list(t.stride()), h]


def fingerprint(t: torch.Tensor) -> tuple[tuple[int, ...], str, tuple[int, ...], int]:
    """Shape, dtype, strides and a 128-bit xxh3 of the bits: whether a tensor changed within one process (the
    audit's early probes), several times faster than `digest`, which is what two engines exchange."""
    return tuple(t.shape), str(t.dtype), tuple(t.stride()), xxhash.xxh3_128_intdigest(_bits(t).numpy().data)


def probe_rows(k: int, rows: int | None, seed: int) -> np.ndarray:
    """Which rows of the k x k identity a probe feeds: all, or ``rows`` of them drawn with ``seed``."""
    if rows is None or rows >= k:
        return np.arange(k, dtype=np.int64)
    return np.sort(np.random.default_rng(seed).choice(k, size=rows, replace=False)).astype(np.int64)


def identity_rows(k: int, rows: np.ndarray, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    x = torch.zeros((rows.size, k), dtype=dtype, device=device)
    x[torch.arange(rows.size), torch.from_numpy(rows).to(x.device)] = 1
    return x


# ------------------------------------------------------------------------------------ method objects
def _plain(value: Any) -> bool:
    """An object whose state processing may change (a quant method's kernel), not a tensor, module or code."""
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, torch.Tensor | torch.nn.Module | type)
        and not callable(value)
        and not inspect.ismodule(value)
    )


def fresh(obj: Any, context: Callable[[], Any] | None = None) -> Any:
    """A method object as its constructor made it: rebuilt from its constructor's arguments, which vLLM's
    method objects keep under the same names; attributes set after construction (by ``create_weights``, a
    kernel chosen for the layer) are carried over, plain objects among them copied, so that processing the
    twin never writes into the live layer's objects. Falls back to a copy when the constructor cannot be
    called that way."""
    cls = type(obj)
    try:
        sig = inspect.signature(cls.__init__)
        args = {}
        for pname, p in list(sig.parameters.items())[1:]:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            if pname in vars(obj):
                args[pname] = vars(obj)[pname]
            elif p.default is p.empty:
                raise TypeError(f"no attribute {pname!r}")
        with context() if context is not None else nullcontext():
            new = cls(**args)
    except Exception:
        new = copy.copy(obj)
        for key, value in vars(obj).items():
            if _plain(value):
                vars(new)[key] = copy.copy(value)
        return new
    for key, value in vars(obj).items():  # not what shadows the class's own (a method patched on the instance)
        if key not in vars(new) and not hasattr(cls, key):
            vars(new)[key] = copy.copy(value) if _plain(value) else value
    return new


def shell(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object sharing ``module``'s attributes, with parameter, buffer and child dicts of its own."""
    twin = object.__new__(type(module))
    twin.__dict__.update(module.__dict__)
    twin._parameters = dict(module._parameters)  # type: ignore[assignment]
    twin._buffers = {n: (b.detach().clone() if b is not None else None) for n, b in module._buffers.items()}  # type: ignore[assignment]
    twin._modules = dict(module._modules)  # type: ignore[assignment]
    return twin


def _as_param(t: torch.Tensor) -> torch.nn.Parameter:
    if isinstance(t, torch.nn.Parameter):
        return t
    p = torch.nn.Parameter(t, requires_grad=False)
    p.__dict__.update(t.__dict__)
    return p


# ------------------------------------------------------------------------------------------ defaults
def default_twin(
    mname: str, module: torch.nn.Module, loaded: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]
) -> torch.nn.Module:
    """A twin for models whose layers are processed by ``layer.quant_method.process_weights_after_loading(layer)``
    (the method object built afresh) or by their own ``process_weights_after_loading()``. Parameters and buffers
    the checkpoint does not feed take ``state`` (as the engine's fresh load left them), not the live values."""
    twin = shell(module)
    _fresh_state(twin, state, loaded)
    for name, t in loaded.items():
        twin._parameters[name] = _as_param(t)
    _freshen(module, twin, None)
    method = _method(twin)
    with torch.no_grad():
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(twin)
        elif callable(getattr(twin, "process_weights_after_loading", None)):
            twin.process_weights_after_loading()
    return twin


def _fresh_state(twin: torch.nn.Module, state: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor]) -> None:
    """Blind spot 3: a twin that took the live layer's non-checkpoint parameters and buffers compared a broken
    value with itself; they come from the snapshot of the engine's fresh load instead."""
    for name, t in state.items():
        if name in loaded:
            continue
        if name in twin._parameters:
            twin._parameters[name] = _as_param(t.detach().clone())
        elif name in twin._buffers:
            twin._buffers[name] = t.detach().clone()


def _freshen(module: torch.nn.Module, twin: torch.nn.Module, context: Callable[[], Any] | None) -> None:
    """The twin's method objects built afresh (attributes, or children where they are modules: vLLM's MoE
    quant method is one); its other plain objects copied, so that nothing is shared with the live layer."""
    for key, value in vars(module).items():
        if key in _METHODS and hasattr(value, "process_weights_after_loading"):
            vars(twin)[key] = fresh(value, context)
        elif _plain(value):
            vars(twin)[key] = copy.copy(value)
    for key, child in module._modules.items():
        if key in _METHODS and child is not None and hasattr(child, "process_weights_after_loading"):
            twin._modules[key] = fresh(child, context)


def _method(module: torch.nn.Module, name: str = "quant_method") -> Any:
    return vars(module).get(name, module._modules.get(name))


def default_probe(mname: str, module: torch.nn.Module, rows: int | None, seed: int) -> dict[str, torch.Tensor]:
    return {}


def default_transplant(live: torch.nn.Module, twin: torch.nn.Module) -> None:
    """The live module takes every attribute of the twin that is not a parameter, buffer or child, and its method
    objects where they are child modules (vLLM's MoE quant method: blind spot 1 skipped it)."""
    skip = {"_parameters", "_buffers", "_modules", _ORIGIN, ADOPTED}
    for key, value in vars(twin).items():
        if key not in skip and vars(live).get(key) is not value:
            vars(live)[key] = value
    for key in _METHODS:
        child = twin._modules.get(key)
        if child is not None and live._modules.get(key) is not child:
            live._modules[key] = child


def default_kind(module: torch.nn.Module) -> str:
    return type(module).__name__


DEFAULT_HOOKS = KernelHooks(default_twin, default_probe, default_transplant, default_kind)


# --------------------------------------------------------------------------------------------- vLLM
def vllm_kind(module: torch.nn.Module) -> str:
    """The module's class and those of its method objects and their kernels (what decides its update path)."""
    parts = [type(module).__name__]
    for attr in _METHODS:
        obj = _method(module, attr)
        if obj is None:
            continue
        parts.append(type(obj).__name__)
        for inner in ("kernel", "moe_kernel"):
            k = getattr(obj, inner, None)
            if k is not None:
                parts.append(type(k).__name__)
                experts = getattr(k, "fused_experts", None)
                if experts is not None:
                    parts.append(type(experts).__name__)
    return "/".join(parts)


def vllm_hooks(vllm_config: Any) -> KernelHooks:
    """Hooks for a vLLM worker: twins processed as at engine start (the model dtype as default dtype, the
    vLLM config current), probes through the layer's quant method, and the live layer taking the twin's method
    objects and the attributes its post-load step set (the GEMM closure holding a oneDNN handle, ...)."""

    @contextmanager
    def first_load() -> Iterator[None]:
        from vllm.config import set_current_vllm_config
        from vllm.utils.torch_utils import set_default_torch_dtype

        with set_current_vllm_config(vllm_config), set_default_torch_dtype(vllm_config.model_config.dtype):
            yield

    def twin(
        mname: str, module: torch.nn.Module, loaded: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]
    ) -> torch.nn.Module:
        from vllm.model_executor.model_loader.reload import layerwise

        tw = shell(module)
        vars(tw)[_ORIGIN] = module  # the probe reads the layer's recorded model format through it
        info = layerwise.LAYERWISE_INFO.get(module)
        meta_params, meta_buffers = info.restore_metadata if info is not None else ({}, {})
        for name in list(tw._parameters):
            if name in meta_params or name in loaded:
                tw._parameters[name] = None  # set below, in model format
        for name, meta in meta_params.items():
            if name in loaded:
                tw._parameters[name] = _as_param(loaded[name])
            else:  # not in the checkpoint: as the fresh load left it where it kept the model-format layout
                kept = state.get(name)
                if kept is not None and tuple(kept.shape) == tuple(meta.shape) and kept.dtype == meta.dtype:
                    tw._parameters[name] = _as_param(kept.detach().clone())
                else:
                    tw._parameters[name] = _as_param(torch.zeros(tuple(meta.shape), dtype=meta.dtype))
        for name, t in loaded.items():
            if name not in meta_params:
                tw._parameters[name] = _as_param(t)
        for name, t in state.items():  # buffers as the fresh load left them, not the live values
            if name in tw._buffers and t is not None:
                tw._buffers[name] = t.detach().clone()
        for name, meta in meta_buffers.items():
            if tw._buffers.get(name) is None:
                tw._buffers[name] = torch.zeros(tuple(meta.shape), dtype=meta.dtype)
        _freshen(module, tw, first_load)
        method = _method(tw)
        with first_load(), torch.no_grad():
            if method is not None:
                method.process_weights_after_loading(tw)
            if hasattr(tw, "update_param_tp_status"):
                tw.update_param_tp_status()
        return tw

    def probe(mname: str, module: torch.nn.Module, rows: int | None, seed: int) -> dict[str, torch.Tensor]:
        """A linear layer's kernel on identity rows (weights it computes from, read back); {} for others."""
        from vllm.model_executor.model_loader.reload import layerwise

        method = _method(module)
        apply = getattr(method, "apply", None)
        info = layerwise.LAYERWISE_INFO.get(vars(module).get(_ORIGIN, module))
        if apply is not None and _moe_like(module):
            return _moe_probe(module, apply, rows, seed, vllm_config.model_config.dtype)
        if apply is None or info is None or "weight" not in info.restore_metadata[0]:
            return {}
        meta = info.restore_metadata[0]["weight"]
        shape = tuple(meta.shape)
        if len(shape) != 2 or not _linear_like(module):
            return {}
        k = shape[1]
        picked = probe_rows(k, rows, seed)
        dtype = probe_dtype(meta.dtype, vllm_config.model_config.dtype)
        device = next((t.device for t in module_tensors(module).values()), torch.device("cpu"))
        x = identity_rows(k, picked, dtype, device)
        with torch.no_grad():
            y = apply(module, x, None)
        if isinstance(y, tuple):
            y = y[0]
        return {"identity": y}

    return KernelHooks(twin, probe, default_transplant, vllm_kind)


def probe_dtype(weight_dtype: torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a linear layer's identity probe: the dtype its forward feeds the kernel. An unquantized
    weight kept in its own floating dtype (GLM's FP32 router ``GateLinear`` in a BF16 model) gets inputs cast
    to it (``GateLinear.forward``); the CPU's packed kernel fed BF16 rows against FP32 packed weights reads
    past them, so such a probe differed between two equal loads. Quantized weights take the model dtype."""
    if weight_dtype.is_floating_point and weight_dtype.itemsize >= 2:
        return weight_dtype
    return model_dtype


def _moe_like(module: torch.nn.Module) -> bool:
    """vLLM's fused experts (``FusedMoE`` / ``RoutedExperts``): stacked ``w13_weight`` / ``w2_weight``."""
    params = module._parameters
    return "w13_weight" in params and "w2_weight" in params and hasattr(module, "local_num_experts")


#: Probe tokens per expert (``sample``: half as many).
MOE_PROBE_TOKENS = 8


def moe_routing(n_experts: int, top_k: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forced routing: token block ``e`` goes to expert ``e`` with weight 1 (its other slots to the next experts
    with weight 0), so each expert's kernel output is seen on its own."""
    ids = torch.arange(n_experts, dtype=torch.int32).repeat_interleave(tokens)
    topk_ids = torch.stack([(ids + j) % n_experts for j in range(top_k)], dim=1).to(torch.int32).contiguous()
    topk_weights = torch.zeros(topk_ids.shape, dtype=torch.float32)
    topk_weights[:, 0] = 1.0
    return topk_weights, topk_ids


def _moe_probe(
    module: torch.nn.Module, apply: Callable[..., Any], rows: int | None, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Blind spot 1: the fused experts' own kernel on fixed inputs, every local expert forced in turn."""
    n = int(module.local_num_experts)
    top_k = max(1, min(int(getattr(module, "top_k", 1) or 1), n))
    tokens = MOE_PROBE_TOKENS if rows is None else max(1, MOE_PROBE_TOKENS // 2)
    hidden = int(getattr(module, "hidden_size", 0) or module._parameters["w13_weight"].shape[-1])  # type: ignore[union-attr]
    device = module._parameters["w13_weight"].device  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(seed if rows is not None else 0)
    x = torch.randn((n * tokens, hidden), generator=g).to(dtype).to(device)
    w, ids = moe_routing(n, top_k, tokens)
    with torch.no_grad():
        y = apply(module, x, w.to(device), ids.to(device), None, None)
    if isinstance(y, tuple):
        y = y[0]
    return {"experts": y}


def _linear_like(module: torch.nn.Module) -> bool:
    """Layers whose quant method's ``apply(layer, x, bias)`` is a GEMM with the weight (linear, LM head)."""
    names = {c.__name__ for c in type(module).__mro__}
    return bool(names & {"LinearBase", "ParallelLMHead"})
