"""Relay tests use the shared board and trainer fixtures (tests/sidecar/board_fixtures.py) and the sidecar
tests' stacks."""

import pytest

from tests.sidecar.conftest import make_stack

__all__ = ["make_stack"]


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread."""
