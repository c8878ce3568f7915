"""The `ServedFormat` contract (a master tensor -> the payload and scales an engine holds, by a pinned recipe in
torch ops, the same bytes on CPU and CUDA: docs/formats.md) and the helpers every recipe shares."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import torch

from flipsync.errors import FormatError, NonFiniteError

#: Master dtypes accepted; bf16/fp16 masters are upcast to fp32 exactly.
MASTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Substrings that keep a weight in high precision under the quantized formats (engines do the same).
UNQUANTIZED_MARKERS = ("embed", "lm_head", "norm")

E4M3_MAX = 448.0


def all_finite(t: torch.Tensor) -> bool:
    """True when ``t`` holds no NaN or inf: NaN propagates through min/max and an inf is the min or the max, so
    one fused min/max pass tells (``isfinite(t).all()`` is ten times slower: the largest cost of a served view)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(torch.stack((lo, hi))).all())


def check_master(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A floating master tensor as float32 (exact upcast for bf16/fp16); FormatError for float64 (every cast
    from it rounds twice) and other dtypes, NonFiniteError (naming the tensor) when it holds NaN or inf."""
    if tensor.dtype == torch.float64:
        raise FormatError(
            f"master tensor {name!r} is float64; served views need float32 masters because casting "
            "float64 down rounds twice (via float32) — convert the master with .float() first"
        )
    if tensor.dtype not in MASTER_DTYPES:
        raise FormatError(
            f"master tensor {name!r} has dtype {tensor.dtype}; served views take float32 (or bfloat16/float16) masters"
        )
    x = tensor.float()
    if all_finite(x):
        return x
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        bad = int(finite.numel() - int(finite.sum()))
        raise NonFiniteError(
            f"master tensor {name!r} (shape {list(tensor.shape)}) holds {bad} NaN/inf value(s); "
            "served views of non-finite masters are undefined — fix the training step before publishing"
        )
    return x


def cast_checked(name: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """RNE cast of finite fp32 `x` to bf16/fp16 (torch `.to`), refusing values that round to inf."""
    y = x.to(dtype)
    if not all_finite(y) and bool(torch.isinf(y).any()):
        limit = torch.finfo(dtype).max
        raise FormatError(
            f"tensor {name!r} (shape {list(x.shape)}) has values that overflow {dtype} "
            f"(|x| rounds beyond {limit:.6g}); rescale the weights or use a format with a wider range"
        )
    return y


def cast_master(name: str, master: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``cast_checked(name, check_master(name, master), dtype)`` with one finiteness pass instead of two (the
    checks run only on a non-finite result, to raise their errors). ``out``: a tensor to cast an fp32 master
    into; a reused one spares the page faults of a fresh allocation, which cost as much as the cast on the CPU."""
    if master.dtype in MASTER_DTYPES:
        if out is not None and master.dtype == torch.float32 and fits_out(out, master, dtype):
            y = out.view(master.shape).copy_(master)
        else:
            y = master.float().to(dtype)
        if all_finite(y):
            return y
    return cast_checked(name, check_master(name, master), dtype)


def fits_out(out: torch.Tensor, master: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``out`` can take the ``dtype`` cast of ``master`` (dtype, device, contiguous, element count)."""
    return out.dtype == dtype and out.device == master.device and out.is_contiguous() and out.numel() == master.numel()


def engine_input(name: str, master: torch.Tensor, *, from_fp32: bool) -> torch.Tensor:
    """The fp32 tensor a quantized recipe starts from: `bf16(master)` upcast to fp32, as an engine receives
    it from an RL trainer, or with `from_fp32=True` the fp32 master itself."""
    x = check_master(name, master)
    return x if from_fp32 else cast_checked(name, x, torch.bfloat16).float()


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim fp32 tensor on x's device (exact; 0 for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.abs().amax().float()


def pad_last_dim(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the last dim of `x` up to a multiple of `multiple` (zeros never change an amax)."""
    pad = -x.shape[-1] % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def require_2d(fmt: str, name: str, x: torch.Tensor) -> None:
    if x.dim() != 2 or x.numel() == 0:
        raise FormatError(
            f"format {fmt!r} quantizes non-empty 2-D weights [N, K], but {name!r} has shape "
            f"{list(x.shape)}; keep it unquantized (keep=...) or reshape it"
        )


def is_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """The quantized formats' default selection: floating, non-empty 2-D tensors whose name ends in ``weight``
    and contains none of ``embed``, ``lm_head``, ``norm`` (engines keep the others in high precision)."""
    return (
        tensor.is_floating_point()
        and tensor.dim() == 2
        and tensor.numel() > 0
        and name.endswith("weight")
        and not any(marker in name for marker in UNQUANTIZED_MARKERS)
    )


class ServedFormat(ABC):
    """One served-format recipe: subclasses set the class attributes and implement `encode` (prepared fp32
    input -> components) and `dequantize` (components -> float32)."""

    #: The format's name (one of FORMAT_NAMES).
    name: ClassVar[str]
    #: dtype of the tensors this format does not quantize.
    unquantized_dtype: ClassVar[torch.dtype] = torch.bfloat16
    #: Suffixes appended to the master name for the scale components, in output order.
    scale_suffixes: ClassVar[tuple[str, ...]] = ()
    #: dtype of the payload component (the one named like the master).
    payload_dtype: ClassVar[torch.dtype]
    #: True when members of a fused group share a scale computed from the group amax.
    uses_group_amax: ClassVar[bool] = False
    #: True when the format quantizes a tensor at all (False: a plain cast of every float tensor).
    quantized: ClassVar[bool] = True

    def selects(self, name: str, tensor: torch.Tensor) -> bool:
        """True when `served_view` runs this format's recipe on `tensor` (before `keep`)."""
        return is_quantizable(name, tensor) if self.quantized else tensor.is_floating_point()

    def component_names(self, name: str) -> tuple[str, ...]:
        """Names of the checkpoint components of master `name` (payload first)."""
        return (name, *(name + suffix for suffix in self.scale_suffixes))

    def prepare(self, name: str, master: torch.Tensor, *, from_fp32: bool = False) -> torch.Tensor:
        """Validate `master` and return the fp32 tensor the recipe starts from (see `engine_input`)."""
        return engine_input(name, master, from_fp32=from_fp32)

    def quantize(
        self,
        name: str,
        x: torch.Tensor,
        *,
        group_amax: torch.Tensor | float | None = None,
        from_fp32: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Master tensor `x` -> its checkpoint components, keyed by checkpoint name. `group_amax`: the max |input|
        over its fused group (formats with a shared per-tensor scale only). `from_fp32`: start from the fp32 master."""
        prepared = self.prepare(name, x, from_fp32=from_fp32)
        amax = None
        if self.uses_group_amax and group_amax is not None:
            amax = torch.as_tensor(group_amax, dtype=torch.float32, device=prepared.device).reshape(())
            own = tensor_amax(prepared)
            if not bool(torch.isfinite(amax)) or bool(amax < own):
                raise FormatError(
                    f"group_amax {float(amax)!r} given for {name!r} is not finite or is below the "
                    f"tensor's own amax {float(own)!r}; pass the max |x| over the whole fused group"
                )
        return self.encode(name, prepared, amax)

    @abstractmethod
    def encode(self, name: str, x: torch.Tensor, group_amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Prepared fp32 `x` -> components. `group_amax` is None or a 0-dim fp32 tensor >= amax(x)."""

    def dequantize(self, name: str, components: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Components of master `name` (as returned by `quantize`) -> float32 values the engine uses; by
        default the payload times its one scale (a per-tensor or per-row multiplier)."""
        return components[name].float() * components[name + self.scale_suffixes[0]].float()

    def __repr__(self) -> str:
        return f"<ServedFormat {self.name}>"
