"""The in-process torch engine: a Hugging Face causal LM built from a config, its byte tokenizer, the
decode/write lock and the OpenAI-compatible server the sidecar's proxy forwards to."""
