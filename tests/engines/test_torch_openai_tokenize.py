"""One model name, one behaviour: the model folder flipsync writes (``flipsync model``) tokenizes, through
transformers (what vLLM loads), exactly as the torch engine does: one BOS in front of a completions prompt, and
chat by the same template, bitwise; and the folder is one both engines load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from typer.testing import CliRunner

from flipsync.checkpoint import load_checkpoint, save_checkpoint
from flipsync.cli.main import app
from flipsync.cli.model import write_model
from flipsync.engines.torch.engine import SamplingParams, TorchEngine
from flipsync.engines.torch.models import build_model, load_config
from flipsync.engines.torch.tokenizer import CHAT_TEMPLATE, ByteTokenizer
from flipsync.errors import ConfigError

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "reverse 123"}],
    [
        {"role": "system", "content": "sé bref"},
        {"role": "user", "content": "héllo 世界 🙂"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again\nwith a newline and <|end|> inside"},
    ],
    [{"role": "user", "content": ""}],
    [{"role": "assistant", "content": "starts with the assistant"}, {"role": "user", "content": "  spaces  "}],
]

PROMPTS = ["hello", "", "héllo 世界", " leading space", "<|eos|> special inside", "tab\tand\nnewline"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model") / "llama-1m", preset="llama-1m", seed=3)


@pytest.fixture(scope="module")
def hf(folder: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(folder))


def _ids(out: object) -> list[int]:
    """apply_chat_template's ids, whichever shape this transformers returns (a list, or a BatchEncoding)."""
    ids = out["input_ids"] if not isinstance(out, list) else out  # type: ignore[index]
    return [int(i) for i in ids]


def test_completions_prompts_get_the_same_ids(hf: PreTrainedTokenizerBase) -> None:
    tok = ByteTokenizer()
    for text in PROMPTS:
        assert hf(text).input_ids == tok.encode(text), text  # vLLM's completions: add_special_tokens=True
        assert hf(text, add_special_tokens=False).input_ids == tok.encode(text, bos=False), text
        assert tok.encode(text)[:1] == [tok.bos_id]
    assert tok.encode("a<|eos|>b") == [tok.bos_id, 97, tok.eos_id, 98]  # a special's name is that token


@pytest.mark.parametrize("messages", CHATS)
def test_chat_renders_the_same_ids(hf: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> None:
    tok = ByteTokenizer()
    ids = _ids(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert ids == tok.chat_prompt(messages)
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == tok.render_chat(messages)
    assert hf(text, add_special_tokens=False).input_ids == ids  # vLLM's chat: the rendered text, no extra BOS
    assert ids.count(tok.bos_id) == 1 and ids[-1] == tok.special_ids["<|assistant|>"]


def test_the_chat_prompt_is_the_documented_layout() -> None:
    tok = ByteTokenizer()
    ids = tok.chat_prompt([{"role": "system", "content": "s"}, {"role": "user", "content": "é"}])
    sp = tok.special_ids
    assert ids == [
        sp["<|bos|>"],
        sp["<|system|>"],
        ord("s"),
        sp["<|end|>"],
        sp["<|user|>"],
        *"é".encode(),
        sp["<|end|>"],
        sp["<|assistant|>"],
    ]
    # OpenAI text parts are joined with "\n", as vLLM joins them for a template that reads a string
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert tok.chat_prompt([{"role": "user", "content": parts}]) == tok.chat_prompt(  # type: ignore[list-item]
        [{"role": "user", "content": "a\nb"}]
    )
    with pytest.raises(ConfigError, match="unknown chat role"):
        tok.chat_prompt([{"role": "tool", "content": "x"}])
    with pytest.raises(ConfigError, match="text parts"):
        tok.chat_prompt([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_the_folder_is_one_both_engines_load(folder: Path, hf: PreTrainedTokenizerBase) -> None:
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    assert "model.safetensors" in names
    tcfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == CHAT_TEMPLATE and tcfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = ByteTokenizer()
    gen_cfg = json.loads((folder / "generation_config.json").read_text())
    assert sorted(gen_cfg["eos_token_id"]) == sorted(tok.stop_ids)  # vLLM stops where the torch engine does
    assert hf.bos_token_id == tok.bos_id and hf.eos_token_id == tok.eos_id
    cfg = AutoConfig.from_pretrained(str(folder))
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.bos_token_id == tok.bos_id

    # The torch engine: the architecture from the folder (sidecar --model FOLDER), the weights loaded as a view.
    view = load_checkpoint(folder / "model.safetensors")
    engine = TorchEngine(build_model(load_config(str(folder)), seed=99))
    engine.load_view(view)
    prompt = tok.encode("12")
    greedy = engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0, stop_token_ids=frozenset()))
    # transformers' own load of the folder computes the same next-token logits (same weights, same ids)
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    assert int(torch.argmax(logits)) == greedy.tokens[0]
    # (BF16 arithmetic: the two forward passes may round differently in the last bits)
    assert greedy.logprobs[0] == pytest.approx(float(torch.log_softmax(logits, -1)[greedy.tokens[0]]), abs=2e-2)


def test_the_model_command_writes_given_weights_and_refuses_bad_input(tmp_path: Path, folder: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "given"
    # FP32 masters of the folder's shape become its served BF16 view
    masters = {k: v.float() for k, v in load_checkpoint(folder / "model.safetensors").items()}
    save_checkpoint(masters, tmp_path / "masters.safetensors")
    r = runner.invoke(
        app, ["model", str(out), "--config", str(folder), "--weights", str(tmp_path / "masters.safetensors")]
    )
    assert r.exit_code == 0, r.output
    written = load_checkpoint(out / "model.safetensors")
    original = load_checkpoint(folder / "model.safetensors")
    assert all(torch.equal(written[k].view(torch.int16), original[k].view(torch.int16)) for k in original)
    assert AutoTokenizer.from_pretrained(str(out))("x").input_ids == [ByteTokenizer().bos_id, ord("x")]

    def refused(*args: str) -> str:
        res = runner.invoke(app, ["model", *args])
        assert res.exit_code == 2, res.output
        return res.output

    assert "not empty" in refused(str(out), "--preset", "llama-1m")
    assert "unknown demo model" in refused(str(tmp_path / "a"), "--preset", "llama-9b")
    assert "one of --preset" in refused(str(tmp_path / "b"))
    assert "does not exist" in refused(str(tmp_path / "c"), "--preset", "llama-1m", "--weights", str(tmp_path / "no"))
    other = {k: v for k, v in masters.items() if "layers.1." not in k}
    save_checkpoint(other, tmp_path / "partial.safetensors")
    assert "missing" in refused(
        str(tmp_path / "d"), "--preset", "llama-1m", "--weights", str(tmp_path / "partial.safetensors")
    )
    small = tmp_path / "small.json"
    small.write_text(
        json.dumps({"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "num_attention_heads": 1})
    )
    assert "vocab_size is 100" in refused(str(tmp_path / "e"), "--config", str(small))
    assert not (tmp_path / "e").exists()  # nothing written for refused input
