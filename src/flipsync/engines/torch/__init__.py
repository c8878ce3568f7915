"""The in-process torch engine: a Hugging Face causal LM built from a config, its byte tokenizer, the
decode/write lock and the OpenAI-compatible server the sidecar's proxy forwards to (the ``torch-engine`` extra)."""

from flipsync.errors import require_extra

require_extra("the torch engine", "torch-engine", "transformers", "jinja2")
