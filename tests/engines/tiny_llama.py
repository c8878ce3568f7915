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


# --------------------------------------------------------------------------------- masters and servable dirs
def tiny_config(arch: str, vocab: int):
    """A tiny Llama (``llama``), Qwen3-MoE (``moe``: 2 layers, 4 experts, top-2) or GLM-4.5-Air-shaped (``glm``:
    a dense layer, then a MoE layer with a shared expert and 4 routed, top-2) config; head size 64, untied."""
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
    )
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(intermediate_size=192, **common)
    if arch == "moe":
        from transformers import Qwen3MoeConfig

        # vLLM CPU's fused MoE wants the per-rank intermediate size a multiple of 32: 64 splits in two for TP 2
        return Qwen3MoeConfig(
            intermediate_size=128,
            moe_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            **common,
        )
    if arch == "glm":
        from transformers import Glm4MoeConfig

        # GLM-4.5-Air's shape, tiny: a dense first layer, then shared + routed experts with a sigmoid router
        # and its FP32 score-correction bias; attention with a QKV bias and half-rotary heads
        return Glm4MoeConfig(
            intermediate_size=128,
            moe_intermediate_size=64,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
            attention_bias=True,
            use_qk_norm=False,
            num_nextn_predict_layers=0,
            **common,
        )
    raise ValueError(arch)


def tiny_masters(arch: str, out: str | Path, *, seed: int = 0) -> tuple[Path, dict[str, torch.Tensor]]:
    """A model folder with the config and tokenizer (no weights yet) and the model's FP32 masters."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = max(build_tokenizer(out), 256)
    config = tiny_config(arch, vocab)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.5)
            for name, b in model.named_buffers():  # GLM's router bias: a persistent buffer, zeros at init
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.5)
    masters = {}
    for k, v in model.state_dict().items():  # experts as released checkpoints name them, one tensor per expert
        v = v.detach().float().clone()
        if k.endswith("mlp.experts.gate_up_proj"):  # transformers 5 fuses them: [E, 2I, H], gate rows first
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                masters[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = v[e, :half].clone()
                masters[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = v[e, half:].clone()
        elif k.endswith("mlp.experts.down_proj"):  # [E, H, I]
            for e in range(v.shape[0]):
                masters[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].clone()
        else:
            masters[k] = v
    doc = config.to_dict()
    doc["torch_dtype"] = "bfloat16"
    doc["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(doc, indent=2))
    return out, masters


def compressed_tensors_config(fmt: str) -> dict:
    """The ``quantization_config`` of a compressed-tensors W8A8 checkpoint (weights per channel, activations
    per token, dynamic) for flipsync's ``int8-channel`` / ``fp8-channel`` views; the LM head stays BF16."""
    kind = {"int8-channel": "int", "fp8-channel": "float"}[fmt]
    args = {"num_bits": 8, "type": kind, "symmetric": True}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if kind == "int" else "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**args, "strategy": "channel", "dynamic": False},
                "input_activations": {**args, "strategy": "token", "dynamic": True},
            }
        },
    }


def write_view(model_dir: str | Path, view: dict[str, torch.Tensor], out: str | Path, fmt: str = "bf16") -> Path:
    """``out``: ``model_dir``'s config and tokenizer with ``view`` as its weights (and, for a quantized view, the
    compressed-tensors ``quantization_config``)."""
    from safetensors.torch import save_file

    src, out = Path(model_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    if fmt != "bf16":
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = compressed_tensors_config(fmt)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in view.items()}, str(out / "model.safetensors"))
    return out
