"""Fixtures for the fleet tests: a real local-directory board a trainer publishes real patches to, sidecars
(torch engines behind their proxies, on loopback) that join the fleet, and gateways over the board."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from flipsync.stores import ObstoreStore, open_store
from tests.fleet.fleet_helpers import GatewayFactory, MemberFactory, Members, make_gateways
from tests.sidecar.sidecar_helpers import FAST, Trainer


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
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


@pytest.fixture
def make_member(board_dir: str) -> Iterator[MemberFactory]:
    members = Members(board_dir)
    yield members.make
    members.close()


@pytest.fixture
def make_gateway(board_dir: str) -> Iterator[GatewayFactory]:
    factory, close = make_gateways(board_dir)
    yield factory
    close()
