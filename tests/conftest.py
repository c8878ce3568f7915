"""Shared test settings: a bounded hypothesis profile so the suite fits CI's 2 cores, and shared fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["tests.sidecar.board_fixtures"]

settings.register_profile(
    "ci",
    max_examples=40,
    deadline=None,
    # CI (CI=true) replays the same examples every run so that a landing never depends on luck;
    # developers' runs explore new ones (and HYPOTHESIS_PROFILE=thorough explores many more).
    derandomize=bool(os.environ.get("CI")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("thorough", max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def no_cloud_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No cloud credentials or endpoints from this machine's environment reach the store under test."""
    for var in list(os.environ):
        if var.startswith(("AWS_", "GOOGLE_", "AZURE_")):
            monkeypatch.delenv(var)
    yield
