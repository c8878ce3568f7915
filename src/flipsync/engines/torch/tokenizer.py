"""A byte-level tokenizer with a few special tokens (no vocabulary files, no downloads): enough for the torch
engine, whose weights come from the board rather than from a pretrained checkpoint.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping, Sequence

from flipsync.errors import ConfigError

SPECIALS = ("<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus ``SPECIALS`` (ids 256...)."""

    def __init__(self) -> None:
        self.special_ids = {name: 256 + i for i, name in enumerate(SPECIALS)}
        self.vocab_size = 256 + len(SPECIALS)
        self.bos_id = self.special_ids["<|bos|>"]
        self.eos_id = self.special_ids["<|eos|>"]
        self.end_of_turn_id = self.special_ids["<|end|>"]
        self._roles = {role: self.special_ids[f"<|{role}|>"] for role in ("system", "user", "assistant")}

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end a generation (and are not part of its text)."""
        return frozenset((self.eos_id, self.end_of_turn_id))

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: Sequence[Mapping[str, object]]) -> list[int]:
        """``<|bos|>`` then ``<|role|>content<|end|>`` per message, then ``<|assistant|>``."""
        ids = [self.bos_id]
        for m in messages:
            role = m.get("role")
            if role not in self._roles:
                raise ConfigError(f"unknown chat role {role!r}; use system, user or assistant")
            content = m.get("content", "")
            if isinstance(content, list):  # OpenAI content parts: keep the text ones
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
            ids.append(self._roles[str(role)])
            ids.extend(str(content).encode("utf-8"))
            ids.append(self.end_of_turn_id)
        ids.append(self._roles["assistant"])
        return ids


class StreamDecoder:
    """Turns tokens into text as they come: a character split across byte tokens waits for its last byte."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._dec.decode(bytes([token])) if 0 <= token < 256 else ""

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
