"""A change that the ``ctx`` coder codes against its base in a few bytes (shared by the engine tests and the
live vLLM check, which imports this file by path)."""

from __future__ import annotations

import torch

from flipsync.codec.bits import int_view


def one_class_step(view: dict[str, torch.Tensor], name: str | None = None) -> dict[str, torch.Tensor]:
    """``view`` with every element of the commonest exponent class of one BF16 tensor (``name``, else the largest)
    moved by one step of its bit pattern: positions the encoder codes against the base (``ctx``)."""
    name = name or max(view, key=lambda k: view[k].numel())
    if view[name].dtype != torch.bfloat16:
        raise ValueError(f"{name!r} is {view[name].dtype}; the class rule here is BF16's exponent")
    out = {k: v.clone() for k, v in view.items()}
    flat = int_view(out[name]).view(-1)
    exponent = (flat >> 7) & 0xFF
    flat[exponent == exponent.mode().values] += 1
    return out
