"""Inference engines a sidecar keeps at a board version: the ``Engine`` port and one module per engine.

``base`` is the port; ``torch`` (an in-process Hugging Face model with its small OpenAI server), ``vllm``
(the sidecar half and the worker half that runs inside vLLM) and ``sglang`` implement it; ``memory`` is a
dict of tensors for benchmarks and tests.
"""
