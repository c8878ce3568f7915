"""The demo's policy: a Llama-architecture model built from a config (no downloads), and the folder it lives in.

``DEMO_MODELS`` holds the shapes the demo offers. The default, ``llama-20m``, has a Llama-2-sized vocabulary
(32,000 ids) around a small core, so its served BF16 view is about 40 MB: big enough that shipping it whole
over a 100 Mbit/s link takes seconds, small enough that two CPU cores train it. The byte tokenizer uses ids
0..261 only; the embedding rows of the other ids never get a gradient and never change, as the rows of
tokens absent from a batch do not in a real RL step (the LM head's rows all change: every logit gets one).

``moe-2m`` is a Qwen3-MoE-shaped policy (8 experts, top-2, in each of its 2 layers), for the demo on a mixture of
experts: its report gives the share of each expert's values that change beside the dense layers'.

``write_model_dir`` writes what an engine started from disk needs (vLLM): ``config.json``,
``generation_config.json`` (both stop tokens), a Hugging Face tokenizer that reproduces `ByteTokenizer`'s ids
exactly (a BOS in front of a text prompt, the torch engine's chat template) and, given one, a served view as
``model.safetensors``. ``flipsync model`` (``flipsync.cli.model``) writes such a folder from the command line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, PretrainedConfig, Qwen3MoeConfig

from flipsync.checkpoint import save_checkpoint
from flipsync.engines.torch.tokenizer import CHAT_TEMPLATE, SPECIALS, ByteTokenizer
from flipsync.errors import ConfigError

DEMO_MODELS: dict[str, dict[str, Any]] = {
    # ~20M parameters, 40.6 MB in BF16: the default (a full checkpoint takes ~3.3 s at 100 Mbit/s).
    "llama-20m": dict(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # ~1.3M parameters, 2.7 MB: tests and quick looks (still a checkpoint 30x a typical patch).
    "llama-1m": dict(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
    # ~1.5M parameters, 3 MB: a Qwen3-MoE shape, 8 experts of 128 (vLLM CPU's MoE wants multiples of 32), top-2.
    "moe-2m": dict(
        arch="qwen3_moe",
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    ),
}


def demo_config(name: str) -> PretrainedConfig:
    """A Llama (or Qwen3-MoE) config of a demo model (head size 64: vLLM's CPU attention supports it); untied
    embeddings."""
    if name not in DEMO_MODELS:
        raise ConfigError(f"unknown demo model {name!r}; models: {', '.join(DEMO_MODELS)}")
    tok = ByteTokenizer()
    shape = dict(DEMO_MODELS[name])
    if shape["vocab_size"] < tok.vocab_size:
        raise ConfigError(f"demo model {name!r} has fewer ids than the byte tokenizer ({tok.vocab_size})")
    arch = shape.pop("arch", "llama")
    common = dict(
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
    )
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(decoder_sparse_step=1, norm_topk_prob=True, **common, **shape)
    return LlamaConfig(**common, **shape)


def _byte_level_tokenizer(out: Path) -> None:
    """An HF fast tokenizer with ByteTokenizer's ids: byte b is id b, the specials follow from 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    tok = ByteTokenizer()
    alphabet = sorted(ByteLevel.alphabet(), key=lambda ch: _unicode_to_byte()[ch])
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    hf = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(list(SPECIALS))
    if [hf.token_to_id(s) for s in SPECIALS] != [tok.special_ids[s] for s in SPECIALS]:
        raise ConfigError("the byte-level tokenizer's special ids differ from ByteTokenizer's")
    bos = SPECIALS[0]
    # A text prompt gets one BOS, as ByteTokenizer.encode gives it (vLLM's completions add special tokens).
    hf.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.bos_id)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=hf, bos_token=bos, eos_token=SPECIALS[1])
    fast.chat_template = CHAT_TEMPLATE  # renders what ByteTokenizer.chat_prompt encodes
    fast.save_pretrained(str(out))
    # The generic class, which transformers 4 and 5 both load; transformers 5 rebuilds the post-processor from
    # add_bos_token / add_eos_token, so they say what the post-processor above does.
    config_path = out / "tokenizer_config.json"
    doc = json.loads(config_path.read_text())
    doc.update(tokenizer_class="PreTrainedTokenizerFast", add_bos_token=True, add_eos_token=False)
    # In tokenizer_config.json, where every transformers version (and vLLM) reads it; transformers 5 writes a
    # chat_template.jinja instead, which would take precedence: one copy only.
    doc["chat_template"] = CHAT_TEMPLATE
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config_path.write_text(json.dumps(doc, indent=2))


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table (the one ByteLevel uses), reversed."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def write_model_dir(out: Path, config: PretrainedConfig, view: Mapping[str, torch.Tensor] | None = None) -> Path:
    """``config.json``, ``generation_config.json``, the byte-level tokenizer (with its chat template) and, with
    ``view``, ``model.safetensors`` holding that served view: a folder an engine can start from. Returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    doc = config.to_dict()
    doc["torch_dtype"] = "bfloat16"
    if not doc.get("architectures") and config.model_type in _ARCHITECTURES:  # vLLM picks its model class by it
        doc["architectures"] = [_ARCHITECTURES[config.model_type]]
    (out / "config.json").write_text(json.dumps(doc, indent=2))
    tok = ByteTokenizer()
    # Both stop tokens, as the torch engine stops (vLLM adds generation_config's eos ids to its stop tokens).
    generation = {"bos_token_id": tok.bos_id, "eos_token_id": sorted(tok.stop_ids)}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _byte_level_tokenizer(out)
    if view is not None:
        save_checkpoint(dict(view), out / "model.safetensors")
    return out
