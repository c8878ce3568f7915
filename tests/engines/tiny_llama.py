"""Build a tiny Llama-architecture HF checkpoint (bf16) with a locally trained tokenizer; no downloads."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "the trainer publishes patches of the served weights",
    "a sidecar applies them in place with a short pause",
    "every replica reports its version after the digest matches",
    "hello world from a tiny llama model",
]


def build_tokenizer(out: Path, vocab_size: int = 256) -> int:
    """Train a byte-level BPE tokenizer on a few strings and save it as a HF tokenizer dir; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 2,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))
    return tok.get_vocab_size()


def build_tiny_llama(out: str | Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """vLLM's CPU attention supports head sizes from 32 up, so 2 query heads and 1 KV head of 64 each."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out)
    vocab = max(vocab, 256)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden + 64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    gen = out / "generation_config.json"
    if gen.exists():
        gen.unlink()
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
