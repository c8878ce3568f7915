"""Model architectures for the in-process torch engine, built from a config with a fixed seed (no downloads):
the weights come from the board, so the model only fixes the names and shapes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PretrainedConfig, PreTrainedModel

from flipsync.engines.torch.tokenizer import ByteTokenizer
from flipsync.errors import ConfigError

BYTE_VOCAB = ByteTokenizer().vocab_size

PRESETS: dict[str, dict[str, Any]] = {
    # hidden 64, 2 layers: unit tests and the CLI demo.
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    # ~12M parameters: the quick sidecar bench.
    "small": dict(
        hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4
    ),
    # ~95M parameters: the full sidecar bench (big enough that O(model) and O(changed) differ clearly).
    "base": dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8
    ),
}


def preset_config(name: str, *, vocab_size: int = BYTE_VOCAB, max_positions: int = 1024) -> LlamaConfig:
    """A Llama config of a named preset, with the byte tokenizer's vocabulary and untied embeddings."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return LlamaConfig(
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        **PRESETS[name],
    )


def load_config(spec: str) -> PretrainedConfig:
    """A preset name, or a path to a Hugging Face ``config.json`` (or a folder holding one); no downloads."""
    if spec in PRESETS:
        return preset_config(spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"model config {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json")
    try:
        doc = json.loads(path.read_text())
        model_type = doc.pop("model_type", "llama")
        return AutoConfig.for_model(model_type, **doc)
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"cannot read model config {path}: {e}") from None


def build_model(config: PretrainedConfig, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> PreTrainedModel:
    """A causal LM from ``config``, initialised from ``seed`` without touching the global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval().requires_grad_(False)
