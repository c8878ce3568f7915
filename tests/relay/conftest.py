"""Relay tests share the sidecar tests' board, trainer and stack fixtures."""

from tests.sidecar.conftest import _one_torch_thread, board_dir, make_stack, store, trainer

__all__ = ["_one_torch_thread", "board_dir", "make_stack", "store", "trainer"]
