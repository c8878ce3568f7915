"""Engine tests: helpers live beside this file (``fake_vllm``, ``fake_sglang``, ``tiny_llama``); the torch
engine's tests use the shared board and trainer fixtures (tests/sidecar/board_fixtures.py)."""

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread."""
