"""Fixtures for the fleet tests: a real local-directory board a trainer publishes real patches to, sidecars
(torch engines behind their proxies, on loopback) that join the fleet, and gateways over the board."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fleet.fleet_helpers import GatewayFactory, MemberFactory, Members, make_gateways


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """Every test here on one torch thread (tests/sidecar/board_fixtures.py, with board_dir, store, trainer)."""


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
