"""Fixtures the sidecar and fleet tests share: a real local-directory board, a trainer publishing real
patches of a tiny Llama to it, and torch on one thread per test (CI has two cores for two xdist workers).
Registered for the whole suite in tests/conftest.py; a folder's own fixture of the same name wins."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from flipsync.stores import ObstoreStore, open_store
from tests.sidecar.sidecar_helpers import FAST, Trainer


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def board_dir(tmp_path: object) -> str:
    return os.path.join(str(tmp_path), "board")


@pytest.fixture
def store(board_dir: str) -> Iterator[ObstoreStore]:
    s = open_store(board_dir, FAST)
    yield s
    s.close()


@pytest.fixture
def trainer(store: ObstoreStore) -> Trainer:
    return Trainer(store)
