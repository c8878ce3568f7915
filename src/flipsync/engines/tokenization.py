"""A short digest of how an engine turns prompts into token ids, which the sidecar puts on its member record so
that a gateway puts only replicas that tokenize alike behind one model name (docs/fleet.md#the-gateway).

The digest is of behaviour, not of files: the ids of a fixed text prompt (so the BOS rule and the specials
count), of a fixed chat conversation through the chat template, and the stop tokens. An engine that tokenizes as
a model folder's Hugging Face tokenizer does (the torch engine's `ByteTokenizer` and the folder flipsync writes)
gets the digest of that folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

DIGEST_CHARS = 16
# What is tokenized: plain text with a non-ASCII character and a number, and a chat of every role.
PROBE_TEXT = "Hello, w\u00f6rld! 12 + 30 = 42\n"
PROBE_CHAT: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Reverse 123."},
    {"role": "assistant", "content": "321"},
    {"role": "user", "content": "And 45?"},
)


class ChatTokenizer(Protocol):
    """What the torch engine's tokenizer offers (``ByteTokenizer``)."""

    @property
    def stop_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, *, bos: bool = True) -> list[int]: ...

    def chat_prompt(self, messages: Sequence[Any]) -> list[int]: ...


def digest(prompt_ids: Sequence[int], chat_ids: Sequence[int], stop_ids: Iterable[int]) -> str:
    """The digest of a tokenizer's answers to the probe."""
    doc = {"prompt": list(prompt_ids), "chat": list(chat_ids), "stop": sorted(set(stop_ids))}
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:DIGEST_CHARS]


def tokenizer_digest(tokenizer: ChatTokenizer) -> str:
    """The digest of an engine-side tokenizer: a completion prompt gets what ``encode`` gives (its BOS too)."""
    return digest(tokenizer.encode(PROBE_TEXT), tokenizer.chat_prompt(list(PROBE_CHAT)), tokenizer.stop_ids)


def folder_tokenizer_digest(model_dir: str | os.PathLike[str]) -> str | None:
    """The digest of the Hugging Face tokenizer in ``model_dir`` as vLLM uses it (a completion prompt with special
    tokens added, chat rendered by the chat template with the generation prompt, the stop tokens of the tokenizer
    and of ``generation_config.json``); None, logged, where it cannot be loaded (the gateway then cannot judge)."""
    folder = Path(model_dir)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder))
        prompt = _ids(tok(PROBE_TEXT))
        chat: list[int] = []
        if getattr(tok, "chat_template", None):  # none: vLLM refuses chat, and so does the digest's probe
            chat = _ids(tok.apply_chat_template(list(PROBE_CHAT), add_generation_prompt=True, tokenize=True))
        stop = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        generation = folder / "generation_config.json"
        if generation.is_file():
            eos = json.loads(generation.read_text()).get("eos_token_id")
            stop |= {int(i) for i in (eos if isinstance(eos, list) else [] if eos is None else [eos])}
    except Exception as e:  # any failure to load means "unknown", never a sidecar that cannot start
        log.warning("cannot tell how %s tokenizes (its member record will not say): %s", folder, e)
        return None
    return digest(prompt, chat, stop)


def _ids(chat: Any) -> list[int]:
    """``apply_chat_template``'s ids: a list, or (transformers 5) a mapping holding ``input_ids``."""
    if hasattr(chat, "keys"):
        chat = chat["input_ids"]
    return [int(i) for i in chat]
