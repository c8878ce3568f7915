"""Inference engines a sidecar keeps at a board version: the ``Engine`` port (``base``), the in-process ``torch``
engine, ``vllm``, ``sglang``, and ``memory`` (a dict of tensors for benchmarks and tests).
"""
