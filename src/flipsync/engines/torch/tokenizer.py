"""A byte-level tokenizer with a few special tokens (no vocabulary files, no downloads): enough for the torch
engine, whose weights come from the board rather than from a pretrained checkpoint.

It tokenizes as the Hugging Face tokenizer of the model folder flipsync writes (``flipsync model``,
``flipsync.engines.torch.model_dir``) does, so the torch engine and vLLM serving that folder see the same ids: a text
prompt gets one ``<|bos|>`` in front (HF: the ``TemplateProcessing`` post-processor, ``add_special_tokens=True``),
special-token names inside a text are those tokens (HF's added-token split), and chat goes through
``CHAT_TEMPLATE``, the ``chat_template`` of the folder's ``tokenizer_config.json``, rendered as transformers
renders it. ``tests/engines/test_torch_openai_tokenize.py`` checks the ids bitwise against transformers.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flipsync.errors import ConfigError

SPECIALS = ("<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")

ROLES = ("system", "user", "assistant")

# ``<|bos|>``, then ``<|role|>content<|end|>`` per message, then ``<|assistant|>`` (with add_generation_prompt).
# The content is a string: vLLM then joins OpenAI text parts with "\n" before rendering, as ``chat_prompt`` does.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role ' ~ message['role'] ~ '; use system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' ~ message['role'] ~ '|>' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class ByteTokenizer:
    """UTF-8 bytes as tokens, plus ``SPECIALS`` (ids 256...)."""

    def __init__(self) -> None:
        self.special_ids = {name: 256 + i for i, name in enumerate(SPECIALS)}
        self.vocab_size = 256 + len(SPECIALS)
        self.bos_id = self.special_ids["<|bos|>"]
        self.eos_id = self.special_ids["<|eos|>"]
        self.end_of_turn_id = self.special_ids["<|end|>"]
        self._roles = {role: self.special_ids[f"<|{role}|>"] for role in ROLES}
        self._split = re.compile("(" + "|".join(re.escape(s) for s in SPECIALS) + ")")
        self._template: Any = None  # compiled on the first chat (jinja2 is imported only then)

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end a generation (and are not part of its text)."""
        return frozenset((self.eos_id, self.end_of_turn_id))

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        """``<|bos|>`` (unless ``bos=False``), then the UTF-8 bytes, a special token's name being that token."""
        ids = [self.bos_id] if bos else []
        for i, piece in enumerate(self._split.split(text)):
            if i % 2:  # re.split puts the captured separators (the specials) at odd positions
                ids.append(self.special_ids[piece])
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """The text of the byte tokens (special tokens are not text, as vLLM's ``skip_special_tokens``)."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        """One token on its own, as HF's ``decode([token])`` gives it (vLLM's logprob token strings): a byte
        outside ASCII is U+FFFD, a special its name, an id the tokenizer has no token for the empty string."""
        if 0 <= token < 256:
            return bytes([token]).decode("utf-8", errors="replace")
        if 256 <= token < self.vocab_size:
            return SPECIALS[token - 256]
        return ""

    def token_bytes(self, token: int) -> list[int]:
        """The bytes of one token (OpenAI's ``bytes``: the raw byte of a byte token, which ``token_text`` may
        show as U+FFFD; the UTF-8 of a special's name)."""
        if 0 <= token < 256:
            return [token]
        return list(self.token_text(token).encode("utf-8"))

    def chat_prompt(self, messages: Sequence[Mapping[str, object]]) -> list[int]:
        """The ids of ``CHAT_TEMPLATE`` rendered for ``messages`` with the generation prompt (vLLM's chat path:
        OpenAI text content parts joined with "\\n", the rendered text tokenized without another BOS)."""
        flat = [{"role": m.get("role"), "content": _content(m.get("content"))} for m in messages]
        for m in flat:
            if m["role"] not in self._roles:
                raise ConfigError(f"unknown chat role {m['role']!r}; use system, user or assistant")
        text = self.render_chat(flat)
        return self.encode(text, bos=False)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """``CHAT_TEMPLATE`` rendered as transformers' ``apply_chat_template(..., tokenize=False)`` renders it."""
        from jinja2 import TemplateError

        if self._template is None:
            self._template = _compile(CHAT_TEMPLATE)
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=SPECIALS[0],
                eos_token=SPECIALS[1],
            )
        except TemplateError as e:
            raise ConfigError(f"the chat messages do not fit the chat template: {e}") from None


def _content(content: object) -> str:
    """A message's content as text: a string, None (empty) or OpenAI content parts (the text ones, "\\n" apart)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) for p in content):
        texts = []
        for p in content:
            if p.get("type", "text") != "text" or not isinstance(p.get("text"), str):
                raise ConfigError("chat content parts must be text parts ({'type': 'text', 'text': '...'})")
            texts.append(str(p["text"]))
        return "\n".join(texts)
    raise ConfigError("a chat message's content must be a string or a list of text parts")


def _compile(source: str) -> Any:
    """The template compiled as transformers compiles chat templates (a sandbox, trim_blocks, lstrip_blocks)."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class StreamDecoder:
    """Turns tokens into text as they come: a character split across byte tokens waits for its last byte."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._dec.decode(bytes([token])) if 0 <= token < 256 else ""

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
