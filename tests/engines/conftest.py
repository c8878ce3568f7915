"""Engine tests: helpers live beside this file (``fake_vllm``, ``fake_sglang``, ``tiny_llama``); the torch
engine's tests share the sidecar tests' board and trainer fixtures."""

from tests.sidecar.conftest import _one_torch_thread, board_dir, store, trainer

__all__ = ["_one_torch_thread", "board_dir", "store", "trainer"]
